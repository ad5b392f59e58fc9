"""What people do to a logical job beside the daemon: name it any way they know it
(`resolve`), cancel it, resubmit it once it failed, and see it as on-call needs to
(`display_state`, pure).

Every write is a compare-and-set on the state (federation.state), so a command racing the
daemon never overwrites it: a move in flight when a job is cancelled finds its `submitted`
refused and cancels what it just submitted (federation.mover).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from slurm_geo.exitcodes import ExitCode
from slurm_geo.federation.engine.core import Federation
from slurm_geo.federation.model import (
    ClusterStatus,
    FederationStateError,
    Health,
    Incarnation,
    IncarnationEnd,
    JobStatus,
    LeftHome,
    LogicalJob,
    NotActionable,
    StaleJob,
    UnknownLogicalJob,
    answering,
)
from slurm_geo.federation.state.interface import State
from slurm_geo.slurm import JobInfo, SlurmClient, SlurmError
from slurm_geo.slurm.errors import JobNotFound

CAS_ATTEMPTS = 3  # a status read and its compare-and-set, tried again if the daemon won


class AmbiguousJobReference(FederationStateError):
    exit_code = ExitCode.USAGE

    def __init__(self, ref: str, candidates: Iterable[str]):
        super().__init__(f"'{ref}' names more than one logical job: {', '.join(candidates)}; "
                         "name one by its logical job id or as CLUSTER:JOBID")


class ResubmitFailed(FederationStateError):
    """A resubmission was allowed but did not (yet) start a new incarnation."""

    exit_code = ExitCode.RESUBMIT_FAILED


# --- naming a job ---------------------------------------------------------------------------


def resolve(state: State, ref: str) -> LogicalJob:
    """The logical job `ref` names: its logical job id, `CLUSTER:JOBID` of any of its
    incarnations, a bare Slurm job id of any incarnation (refused when incarnations of
    different logical jobs on different clusters share it), or its run name."""
    try:
        return state.job(ref)
    except UnknownLogicalJob:
        pass
    cluster, colon, number = ref.rpartition(":")
    if colon and number.isdigit():
        found = state.find_job(cluster, int(number))
        if found is None:
            raise UnknownLogicalJob(ref)
        return found
    if ref.isdigit():
        pairs = state.find_by_job_id(int(ref))
        return _one(ref, {j.logical_job: j for _, j in pairs},
                    [f"{c}:{ref} ({j.logical_job})" for c, j in pairs])
    runs = state.find_by_run(ref) if ref else []
    return _one(ref, {j.logical_job: j for j in runs},
                [f"{j.logical_job} (run {ref})" for j in runs])


def _one(ref: str, found: dict[str, LogicalJob], candidates: list[str]) -> LogicalJob:
    if not found:
        raise UnknownLogicalJob(ref)
    if len(found) > 1:
        raise AmbiguousJobReference(ref, candidates)
    return next(iter(found.values()))


# --- what on-call sees ----------------------------------------------------------------------


@dataclass(frozen=True)
class Display:
    """The STATUS column: a state on-call can act on, and why (Slurm's reason for a hold)."""

    state: str
    reason: str = ""


def display_state(job: LogicalJob, health: dict[str, Health],
                  slurm: JobInfo | None) -> Display:
    """`slurm`: the current incarnation as its cluster reports it (None when not asked:
    the job is not running, or its cluster does not answer). Pure."""
    if job.status.is_final():
        return Display(job.status.value)
    if job.status is JobStatus.MOVING:
        return Display("moving", f"to {job.cluster}")
    if job.awaiting_approval:
        return Display("awaiting-approval", f"move to {job.awaiting_approval}: `slurm-geo "
                       f"approve {job.logical_job} {job.awaiting_approval}`")
    here = health.get(job.cluster)
    if here is not None and here.status is ClusterStatus.OUT:
        return Display("cluster-out", f"{job.cluster} is out"
                       + (f": {here.last_error}" if here.last_error else ""))
    if slurm is not None and slurm.held:
        return Display("held", slurm.reason)
    return Display(job.status.value)


def current_in_slurm(clients: Mapping[str, SlurmClient], jobs: Iterable[LogicalJob],
                     health: dict[str, Health]) -> dict[str, JobInfo]:
    """Per logical job, its current incarnation as Slurm reports it, for the running jobs
    whose cluster answers: one `jobs()` call per such cluster, within its client's
    timeout; a cluster that fails the call is left out."""
    wanted: dict[str, dict[int, str]] = {}
    for job in jobs:
        if job.status is JobStatus.RUNNING and job.job_id is not None \
                and answering(health, job.cluster) and job.cluster in clients:
            wanted.setdefault(job.cluster, {})[job.job_id] = job.logical_job
    found: dict[str, JobInfo] = {}
    for cluster, ids in wanted.items():
        try:
            infos = clients[cluster].jobs()
        except SlurmError:
            continue
        found.update({ids[i.job_id]: i for i in infos if i.job_id in ids})
    return found


# --- cancel ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """What became of one incarnation's Slurm job."""

    generation: int
    cluster: str
    job_id: int | None
    result: str      # cancelled | ended STATE | gone | not submitted | not reached
    detail: str = ""

    @property
    def reached(self) -> bool:
        return self.result != "not reached"


@dataclass(frozen=True)
class CancelReport:
    job: LogicalJob
    who: str
    outcomes: tuple[Outcome, ...]

    def unreached(self) -> tuple[Outcome, ...]:
        return tuple(o for o in self.outcomes if not o.reached)

    def to_json(self) -> dict[str, Any]:
        return {"logical_job": self.job.logical_job, "status": self.job.status.value,
                "by": self.who, "incarnations": [
                    {"generation": o.generation, "cluster": o.cluster, "job_id": o.job_id,
                     "result": o.result, "detail": o.detail} for o in self.outcomes]}


def cancel(federation: Federation, job: LogicalJob, who: str) -> CancelReport:
    """Cancel `job` and every incarnation of it Slurm still runs or queues. The status
    goes to cancelled first (so no incarnation gets a lease again), then the lease is
    released, then each open incarnation is cancelled where its cluster answers. Those
    it cannot reach stay open and are reported; `cancel` again once they answer (a
    cancelled job with open incarnations is the one final job it accepts)."""
    state = federation.state
    job, retry = _mark_cancelled(state, job.logical_job, federation.clock)
    state.release_lease(job.logical_job)
    health = state.health()
    outcomes = tuple(_cancel_incarnation(federation, job, i, health)
                     for i in state.incarnations(job.logical_job) if i.ended_at is None)
    unreached = [f"{o.cluster}:{o.job_id}" for o in outcomes if not o.reached]
    federation.audit.append(
        "cancel", job.logical_job, ("incarnations left open retried" if retry
                                    else f"cancelled at generation {job.generation}"),
        f"by {who}" + (f"; not reached: {', '.join(unreached)}" if unreached else ""),
        who=who, incarnations=[[o.cluster, o.job_id, o.result] for o in outcomes])
    return CancelReport(job, who, outcomes)


def _mark_cancelled(state: State, logical_job: str,
                    clock: Callable[[], float]) -> tuple[LogicalJob, bool]:
    """(the job, now cancelled; whether it was already and only its open incarnations
    are retried). A compare-and-set from running or moving, read again if the daemon
    changed the status in between."""
    for _ in range(CAS_ATTEMPTS):
        job = state.job(logical_job)
        if job.status is JobStatus.CANCELLED and _open_in_slurm(state, logical_job):
            return job, True
        if job.status.is_final():
            raise NotActionable(f"logical job {logical_job} is {job.status.value}; there "
                                "is nothing to cancel")
        try:
            return state.move_status(logical_job, job.status, JobStatus.CANCELLED,
                                     clock()), False
        except StaleJob:
            continue
    raise NotActionable(f"logical job {logical_job} kept changing under the cancel; "
                        "try again")


def _open_in_slurm(state: State, logical_job: str) -> bool:
    return any(i.ended_at is None and i.job_id is not None
               for i in state.incarnations(logical_job))


def _cancel_incarnation(federation: Federation, job: LogicalJob, incarnation: Incarnation,
                        health: dict[str, Health]) -> Outcome:
    cluster, job_id = incarnation.cluster, incarnation.job_id
    outcome = Outcome(incarnation.generation, cluster, job_id, "not submitted")
    known = health.get(cluster)
    if job_id is not None and known is not None and not known.answering:
        return Outcome(incarnation.generation, cluster, job_id, "not reached",
                       f"{cluster} does not answer the daemon's probes")
    if job_id is not None:
        try:
            outcome = _cancel_in_slurm(federation.clients[cluster], incarnation)
        except SlurmError as exc:
            return Outcome(incarnation.generation, cluster, job_id, "not reached", str(exc))
    reason = (IncarnationEnd.CANCELLED if outcome.result in ("cancelled", "not submitted")
              else IncarnationEnd.ENDED)
    federation.state.end_incarnation(job.logical_job, incarnation.generation, reason,
                                     federation.clock())
    return outcome


def _cancel_in_slurm(client: SlurmClient, incarnation: Incarnation) -> Outcome:
    assert incarnation.job_id is not None
    generation, cluster, job_id = incarnation.generation, incarnation.cluster, \
        incarnation.job_id
    try:
        info = client.job(job_id)
    except JobNotFound:
        return Outcome(generation, cluster, job_id, "gone", "Slurm no longer knows it")
    if info.state.is_terminal():
        return Outcome(generation, cluster, job_id, f"ended {info.state.value}")
    client.cancel(job_id)
    return Outcome(generation, cluster, job_id, "cancelled", f"was {info.state.value}")


# --- resubmit -------------------------------------------------------------------------------


def resubmit(federation: Federation, job: LogicalJob, who: str) -> LogicalJob:
    """A failed job as a new generation from its newest checkpoint that verifies where it
    goes: home if home answers, else where the plan chooses. Its lost restarts start
    again from zero. Returns the job as it stands after the submission."""
    state = federation.state
    job = state.job(job.logical_job)
    if job.status is JobStatus.CANCELLED:
        raise NotActionable(f"logical job {job.logical_job} is cancelled, and a cancel is "
                            f"final; to train run {job.run} on, submit a new job naming it")
    if job.status is not JobStatus.FAILED:
        raise NotActionable(f"logical job {job.logical_job} is {job.status.value}; only a "
                            "failed job can be resubmitted")
    health = state.health()
    target = _resubmit_target(federation, job, health)
    try:
        state.reset_lost_restarts(job.logical_job, federation.clock())
    except StaleJob as exc:
        raise NotActionable(str(exc)) from None
    left_home = None if target == federation.home else LeftHome.OUTAGE
    try:
        moved = federation.mover.move(job, target, f"resubmitted by {who}", health,
                                      left_home=left_home)
    except SlurmError as exc:
        return _submission_refused(federation, job, target, who, exc)
    if moved is None:
        raise ResubmitFailed(f"logical job {job.logical_job} was not resubmitted: no "
                             f"checkpoint of run {job.run} verifies in {target}'s store, or "
                             "the job changed meanwhile; `slurm-geo audit show --job "
                             f"{job.logical_job}` says which")
    federation.audit.append("resubmit", job.logical_job, f"generation {moved.generation} "
                            f"on {moved.cluster}:{moved.job_id}", f"by {who}; it had "
                            f"failed at generation {job.generation} on {job.cluster}",
                            who=who, cluster=moved.cluster, job_id=moved.job_id,
                            generation=moved.generation, resume_step=moved.resume_step)
    return moved


def _resubmit_target(federation: Federation, job: LogicalJob,
                     health: dict[str, Health]) -> str:
    if answering(health, federation.home):
        return federation.home
    chosen = federation.plan_for(job, health)
    if not answering(health, chosen.choice):
        raise NotActionable(f"logical job {job.logical_job}: home ({federation.home}) does "
                            f"not answer and no cluster that answers can take it "
                            f"({chosen.reason}); `slurm-geo plan {job.logical_job}`")
    return chosen.choice


def _submission_refused(federation: Federation, job: LogicalJob, target: str, who: str,
                        exc: SlurmError) -> NoReturn:
    """The generation was bumped but Slurm refused the job: the daemon submits it again
    each round (a move it finds half done), so the resubmission stands."""
    now = federation.state.job(job.logical_job)
    if now.generation == job.generation:
        raise ResubmitFailed(f"logical job {job.logical_job} was not resubmitted: {exc}")
    federation.audit.append("resubmit", job.logical_job, f"generation {now.generation} on "
                            f"{target}, not submitted yet", f"by {who}; {exc}", who=who,
                            cluster=target, generation=now.generation)
    raise ResubmitFailed(f"logical job {job.logical_job} is at generation {now.generation} "
                         f"for {target}, but {target} refused the job ({exc}); the "
                         "federation daemon submits it again each round")
