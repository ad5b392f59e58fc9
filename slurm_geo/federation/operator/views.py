"""A logical job as `slurm-geo status` shows it (`job_view`, pure): built where the state
is read, by the CLI of an admin who reads it, or by the daemon for an owner who asks it
(federation.ownerverbs), so both print the same thing."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from slurm_geo.federation.model import LogicalJob
from slurm_geo.federation.operator.operations import Display
from slurm_geo.federation.state.interface import State
from slurm_geo.policy.directives import DirectiveError
from slurm_geo.slurm import JobInfo


def job_view(state: State, job: LogicalJob, display: Display,
             slurm: JobInfo | None, world_staging: dict[str, Any] | None = None
             ) -> dict[str, Any]:
    """`world_staging`: where its world is staged (federation.worldstatus), read from the
    stores for one job asked for by name; None otherwise."""
    lease = state.lease(job.logical_job)
    return {
        "logical_job": job.logical_job, "run": job.run, "home": job.home,
        "status": job.status.value, "shown": {"state": display.state,
                                              "reason": display.reason},
        "generation": job.generation, "cluster": job.cluster, "job_id": job.job_id,
        "where": where(job.cluster, job.job_id), "resume_step": job.resume_step,
        "recoveries": job.recoveries, "lost_restarts": job.lost_restarts,
        "left_home": None if job.left_home is None else job.left_home.value,
        "awaiting_approval": job.awaiting_approval, "move_to": job.move_to,
        "move_after_step": job.move_after_step, "created_at": iso(job.created_at),
        "updated_at": iso(job.updated_at), "directives": job.directives,
        "world": world_view(job), "world_staging": world_staging,
        "options": job.spec, "script": job.script,
        "owner": None if job.owner is None else {"user": job.owner.user, "uid": job.owner.uid,
                                                 "gid": job.owner.gid},
        "owner_env": job.owner_env,
        "slurm": None if slurm is None else {"state": slurm.state.value,
                                             "reason": slurm.reason, "held": slurm.held},
        "lease": None if lease is None else {
            "generation": lease.generation, "cluster": lease.cluster, "job_id": lease.job_id,
            "restart": lease.restart, "renewed_at": iso(lease.renewed_at),
            "last_step": lease.last_step, "released": lease.released},
        "incarnations": [{
            "generation": i.generation, "cluster": i.cluster, "job_id": i.job_id,
            "resume_step": i.resume_step, "submitted_at": iso(i.submitted_at),
            "training_at": iso(i.training_at), "ended_at": iso(i.ended_at),
            "end_reason": i.end_reason} for i in state.incarnations(job.logical_job)],
    }


def world_view(job: LogicalJob) -> dict[str, Any]:
    """Its declared inputs, env and outputs; with "error" instead where a recorded
    directive no longer parses (recorded by an older version)."""
    try:
        return job.world.to_json()
    except DirectiveError as exc:
        return {"inputs": [], "env": None, "outputs": [], "error": str(exc)}


def resubmitted_view(job: LogicalJob) -> dict[str, Any]:
    """A resubmitted logical job as `resubmit` answers it (the daemon's reply, the CLI)."""
    return {"logical_job": job.logical_job, "status": job.status.value,
            "generation": job.generation, "cluster": job.cluster, "job_id": job.job_id,
            "resume_step": job.resume_step, "run": job.run}


def where(cluster: str, job_id: int | None) -> str:
    return f"{cluster}:{'-' if job_id is None else job_id}"


def iso(epoch: float | None) -> str | None:
    return None if epoch is None else datetime.fromtimestamp(epoch, UTC).isoformat(
        timespec="seconds")
