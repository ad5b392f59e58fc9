"""PrologSlurmctld and EpilogSlurmctld of geo jobs: the registry, and the restart cap.

PrologSlurmctld records each incarnation as it starts. EpilogSlurmctld records how it
ended, and whether a requeue was planned (the job marked it in its comment after saving
its state: slurm_geo.policy.restarts). When Slurm has queued the job again unplanned more
than [policy] max_restarts times, it holds the job (`scontrol hold`, through
`slurm_geo.slurm`), says why in the job's comment and notes it in the registry: a job
that keeps failing should not requeue itself forever, one that keeps surviving its time
limit as it should is never held for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from slurm_geo.hooks.context import JobContext
from slurm_geo.policy.restarts import cap_reached, held_comment, hold_reason, planned_restart
from slurm_geo.registry import IncarnationState, Registry
from slurm_geo.slurm.client import SlurmClient
from slurm_geo.slurm.errors import SlurmError

log = logging.getLogger("slurm_geo.hooks")


def prolog_slurmctld(job: JobContext, registry: Registry, now: float) -> None:
    registry.job_started(job.cluster, job.job_id, job.restart, name=job.name, user=job.user,
                         nodes=job.nodes, directives=job.directives.as_options(), now=now)


def epilog_slurmctld(job: JobContext, registry: Registry, max_restarts: int,
                     client: Callable[[], SlurmClient], now: float) -> bool:
    """Record the incarnation's end; True if the job was held for its restart cap."""
    ended = registry.job_ended(job.cluster, job.job_id, job.restart, job.exit_code, now,
                               planned_restart(job.comment))
    if ended is None or ended.state is not IncarnationState.REQUEUED or ended.planned:
        return False
    unplanned = registry.unplanned_requeues(job.cluster, job.job_id)
    if not cap_reached(unplanned, max_restarts):
        return False
    reason = hold_reason(unplanned, max_restarts)
    try:
        client().hold(job.job_id, comment=held_comment(job.comment, unplanned, max_restarts))
    except SlurmError as exc:
        log.error("job %s: %s, but holding it failed: %s", job.tag, reason, exc)
        return False
    registry.mark_held(job.cluster, job.job_id, reason)
    log.warning("job %s held: %s", job.tag, reason)
    return True
