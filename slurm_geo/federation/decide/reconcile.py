"""The federation daemon's decisions, one logical job at a time. Pure.

Level-triggered, as a Kubernetes controller is: each round the daemon gathers a `Snapshot`
(the logical job, its lease, what Slurm says of its current incarnation, the clusters'
health, the time) and `reconcile` returns the one next `Step`; the daemon applies it and
asks again next round. It never relies on having seen an event, so a daemon killed
between two steps continues where things stand.

Planning asks every controller for a start estimate and reads a manifest, so it is not
part of the snapshot: when a decision needs a plan, the step is `PLAN` (with what for),
and the daemon asks again with `snapshot.plan` filled in.

The order of the questions is the order of their urgency:
  1. older incarnations still alive on a cluster that answers are fenced first;
  2. a move the daemon was stopped in is finished;
  3. the job's cluster is out: once the lease has run out, move where the plan says
     (or wait for a person's approval, or stay when nowhere else is eligible);
  4. a planned move (failback, approval) happens once the trainer released its lease at
     a checkpoint;
  5. Slurm says the job ended: cancelled by its owner (`scancel`) -> cancelled, never
     restarted (slurm_geo.federation.decide.cancels); released lease -> finished; unreleased ->
     lost: restarted from its newest verified checkpoint (where the plan says) until
     `max_restarts`;
  6. still queued, never trained: leave a hopeless queue when another cluster starts it
     sooner by more than the margin, and only when it waits for home's nodes (never for
     `--begin`, a dependency, a hold, a reservation: slurm_geo.federation.decide.pending);
  7. away from home (not for a hopeless queue) and home stable: plan the failback once
     per checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from slurm_geo.federation.decide.cancels import (
    Canceller,
    accounting_overdue,
    cancelled_by_text,
    canceller,
)
from slurm_geo.federation.decide.pending import queue_move_blocker
from slurm_geo.federation.decide.planner import Plan
from slurm_geo.federation.model import (
    ClusterStatus,
    Health,
    Incarnation,
    JobStatus,
    Lease,
    LeftHome,
    LogicalJob,
)
from slurm_geo.slurm.models import JobInfo, JobState


class StepKind(Enum):
    WAIT = "wait"                      # nothing to do this round
    FENCE_STALE = "fence-stale"        # cancel and fence older incarnations that answer
    COMPLETE_MOVE = "complete-move"    # fence and submit a move cut short by a crash
    PLAN = "plan"                      # a decision needs a plan: ask again with one
    MOVE = "move"                      # a new generation on `target`
    RESTART_LOST = "restart-lost"      # a move after a lost incarnation (counts a restart)
    GIVE_UP = "give-up"                # lost, and max_restarts spent: failed
    FINISH = "finish"                  # Slurm says it ended after releasing its lease
    OWNER_CANCELLED = "owner-cancelled"  # its owner's scancel: the job ends cancelled
    HOLD_FOR_LEASE = "hold-for-lease"  # its cluster is out but the lease is live
    STRANDED = "stranded"              # its cluster is out and nowhere else is eligible
    AWAIT_APPROVAL = "await-approval"  # the plan moves it; --geo-failover asks a person
    PLAN_FAILBACK = "plan-failback"    # go home at the next checkpoint


class PlanPurpose(Enum):
    FAILOVER = "failover"
    RESTART = "restart"
    QUEUE = "queue"
    FAILBACK = "failback"


@dataclass(frozen=True)
class Step:
    kind: StepKind
    reason: str = ""
    target: str | None = None
    plan: Plan | None = None
    purpose: PlanPurpose | None = None
    current_wait_s: float | None = None  # PLAN for a queue move: Slurm's estimate here
    state: JobState | None = None        # FINISH / GIVE_UP: how Slurm says it ended
    after_step: int | None = None        # PLAN_FAILBACK: the checkpoint to move after
    cancel_current: bool = False         # MOVE from a queue: cancel the queued job
    left_home: LeftHome | None = None
    stale: tuple[Incarnation, ...] = ()  # FENCE_STALE


@dataclass(frozen=True)
class Settings:
    """The config a decision reads ([federation] and [policy] max_restarts)."""

    home: str
    lease_ttl_s: float
    margin_s: float
    failback: bool
    failback_stable_s: float
    max_restarts: int


@dataclass(frozen=True)
class Snapshot:
    job: LogicalJob
    lease: Lease | None
    slurm: JobInfo | None          # the current incarnation; None: unknown to Slurm or unasked
    health: dict[str, Health]
    now: float
    stale: tuple[Incarnation, ...] = ()  # older incarnations not ended, on answering clusters
    plan: Plan | None = None
    failback_planned_for: tuple[int | None, float] | None = None


def wait(reason: str) -> Step:
    return Step(StepKind.WAIT, reason)


def reconcile(snap: Snapshot, settings: Settings) -> Step:
    job = snap.job
    if snap.stale:
        return Step(StepKind.FENCE_STALE, f"the job is at generation {job.generation} on "
                    f"{job.cluster}", stale=snap.stale)
    if job.status.is_final():
        return wait(f"the job is {job.status.value}")
    if job.status is JobStatus.MOVING:
        return Step(StepKind.COMPLETE_MOVE, "finishing a move the daemon was stopped in")
    here = snap.health.get(job.cluster)
    if here is None:
        return wait(f"{job.cluster} is not probed yet")
    if here.status is ClusterStatus.OUT:
        return _failover(snap, settings)
    if here.failures:
        return wait(f"a probe of {job.cluster} just failed; probe again")
    lease = snap.lease
    current_lease = lease is not None and lease.generation == job.generation
    if job.move_to is not None and current_lease and lease is not None and lease.released:
        # A failback comes home; any other planned move was a person's (an approval).
        return Step(StepKind.MOVE, f"planned move to {job.move_to} at checkpoint "
                    f"{lease.last_step}", target=job.move_to,
                    left_home=None if job.move_to == settings.home else LeftHome.CHOSEN)
    info = snap.slurm
    if info is not None and info.state.is_terminal():
        by = canceller(info)
        if by is Canceller.OWNER:
            return Step(StepKind.OWNER_CANCELLED,
                        f"{cancelled_by_text(info)} cancelled generation {job.generation} on "
                        f"{job.cluster}:{job.job_id} (Slurm: CANCELLED by {info.cancelled_by})",
                        state=info.state)
        if by is Canceller.UNKNOWN and not accounting_overdue(info, snap.now):
            return wait("Slurm reports the job CANCELLED; its accounting has yet to say by "
                        "whom (its owner's scancel ends the job, anyone else's restarts it)")
        if current_lease and lease is not None and not lease.released:
            return _restart_lost(snap, settings, info, lease)
        return Step(StepKind.FINISH, "Slurm reports the job finished", state=info.state)
    if info is not None and info.state is JobState.PENDING and lease is None:
        return _queue_move(snap, settings, info)
    if current_lease and lease is not None and lease.released:
        # Done training (no move was planned); the rest of its batch script or its epilog
        # may still run. A failback planned now would resubmit a finished job.
        return wait("its trainer released the lease; Slurm has yet to report the end")
    if settings.failback and job.cluster != settings.home and job.move_to is None:
        if job.left_home is LeftHome.CHOSEN:
            return wait(f"moved to {job.cluster} by approval, it stays there (`slurm-geo "
                        f"approve {job.logical_job} {settings.home}` brings it home)")
        if job.left_home is not LeftHome.QUEUE:
            return _failback(snap, settings)
    return wait("running where it should")


def _failover(snap: Snapshot, settings: Settings) -> Step:
    job, lease = snap.job, snap.lease
    if lease is not None and lease.generation == job.generation and lease.released \
            and job.move_to is None:
        return wait(f"its trainer released the lease (done training); {job.cluster} has "
                    "yet to say the job ended")
    # Checked before planning: no move can start while the lease is live, and a plan
    # costs Slurm calls and a manifest read every round.
    if lease is not None and lease.generation == job.generation \
            and not lease.expired(snap.now, settings.lease_ttl_s):
        return Step(StepKind.HOLD_FOR_LEASE,
                    f"{job.cluster} is out but the job's lease was renewed "
                    f"{snap.now - lease.renewed_at:.1f} s ago; it may still be training")
    if snap.plan is None:
        return Step(StepKind.PLAN, purpose=PlanPurpose.FAILOVER)
    chosen = snap.plan
    if not chosen.moves():
        return Step(StepKind.STRANDED, chosen.reason, plan=chosen)
    if _awaits_approval(job, chosen):
        return _await_approval(chosen)
    return Step(StepKind.MOVE, chosen.reason, target=chosen.choice, plan=chosen,
                left_home=LeftHome.OUTAGE)


def _restart_lost(snap: Snapshot, settings: Settings, info: JobInfo, lease: Lease) -> Step:
    """Slurm says the job ended, but its trainer never released its lease: it was killed
    (a controller and its nodes lost and restarted can even report such a job COMPLETED).
    It continues from its newest verified checkpoint, where the plan says, once the lease
    has run out."""
    job = snap.job
    if not lease.expired(snap.now, settings.lease_ttl_s):
        return wait("the lost incarnation's lease has not run out")
    if job.lost_restarts >= settings.max_restarts:
        return Step(StepKind.GIVE_UP,
                    f"generation {job.generation} ended {info.state.value} without "
                    f"releasing its lease, and {job.lost_restarts} restarts (the policy's "
                    "max_restarts) were spent", state=info.state)
    if snap.plan is None:
        return Step(StepKind.PLAN, purpose=PlanPurpose.RESTART)
    chosen = snap.plan
    target = chosen.choice if chosen.moves() and not chosen.needs_approval else job.cluster
    return Step(StepKind.RESTART_LOST,
                f"generation {job.generation} on {job.cluster}:{job.job_id} ended "
                f"{info.state.value} without releasing its lease (last checkpoint "
                f"{lease.last_step}); it continues on {target}",
                target=target, plan=chosen, state=info.state,
                left_home=LeftHome.OUTAGE if target != job.cluster else None)


def _queue_move(snap: Snapshot, settings: Settings, info: JobInfo) -> Step:
    """A job still pending (never granted a lease) moves when another cluster would
    start it sooner by more than the margin. Its own wait is Slurm's estimate of its
    start; a job pending for less than the margin, or not yet estimated, stays. So does a
    job pending for a reason other than a busy queue (`--begin`, a dependency, a hold, a
    reservation, a limit: slurm_geo.federation.decide.pending)."""
    blocker = queue_move_blocker(info.reason)
    if blocker is not None:
        return wait(f"stays queued: {blocker}")
    if info.submit_time is None or snap.now - info.submit_time.timestamp() < settings.margin_s:
        return wait("queued for less than the margin")
    if info.start_time is None:
        return wait("Slurm has no start estimate for it yet")
    if snap.plan is None:
        return Step(StepKind.PLAN, purpose=PlanPurpose.QUEUE,
                    current_wait_s=max(0.0, info.start_time.timestamp() - snap.now))
    chosen = snap.plan
    if not chosen.moves():
        return wait(chosen.reason)
    if _awaits_approval(snap.job, chosen):
        return _await_approval(chosen)
    return Step(StepKind.MOVE, chosen.reason, target=chosen.choice, plan=chosen,
                cancel_current=True, left_home=LeftHome.QUEUE)


def _failback(snap: Snapshot, settings: Settings) -> Step:
    """Planned once per checkpoint the job commits (or change of home's health): a plan
    asks both clusters for a start estimate, and a failback happens at a checkpoint."""
    home = snap.health.get(settings.home)
    if home is None or home.status is not ClusterStatus.UP or home.last_ok is None \
            or snap.now - home.since < settings.failback_stable_s:
        return wait("home is not up and stable")
    if snap.failback_planned_for == failback_key(snap):
        return wait("failback already planned for this checkpoint")
    if snap.plan is None:
        return Step(StepKind.PLAN, purpose=PlanPurpose.FAILBACK)
    chosen = snap.plan
    if chosen.choice != settings.home or chosen.needs_approval:
        return wait(chosen.reason)
    return Step(StepKind.PLAN_FAILBACK, chosen.reason, target=settings.home, plan=chosen,
                after_step=None if snap.lease is None else snap.lease.last_step)


def failback_key(snap: Snapshot) -> tuple[int | None, float]:
    """What a failback plan was made for: the job's checkpoint and home's up-since."""
    home = snap.health.get(snap.job.home)
    return (None if snap.lease is None else snap.lease.last_step,
            0.0 if home is None else home.since)


def _awaits_approval(job: LogicalJob, chosen: Plan) -> bool:
    """A move the job did not consent to (--geo-failover is not auto) and nobody has
    approved yet."""
    return chosen.needs_approval and job.move_to != chosen.choice


def _await_approval(chosen: Plan) -> Step:
    return Step(StepKind.AWAIT_APPROVAL, chosen.reason + " (--geo-failover is not auto; "
                f"`slurm-geo approve {chosen.logical_job} {chosen.choice}`)",
                target=chosen.choice, plan=chosen)
