# A bug these tests found, fixed in b6ce6cc while they were written; the rows marked
# "(b6ce6cc)" in FAILBACK below keep it fixed. A trainer releases its lease when it is done
# (lease/client.py: `run.release(final_step)`, "finished or moving"). A job away from home
# whose trainer had released its lease with no move planned had finished training, while
# Slurm could still report the job RUNNING or COMPLETING (the rest of its batch script, the
# epilog). `reconcile` sent it down the failback branch: PLAN(failback), then PLAN_FAILBACK
# (`plan_move(move_to=home)`), and the round after, "move_to set and the lease released at
# the current generation" read as a planned move: MOVE home, resubmitting a finished job.

"""The federation daemon's pure reconciler, one table row per branch of `reconcile`.

The world: the job `onprem-7` was submitted on its home `onprem`; `cloud` and `edge` are
the other clusters. `NOW` is a fixed clock; Slurm's times are UTC datetimes derived from it.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest

from slurm_geo.config.model import Prices
from slurm_geo.federation.decide.planner import ClusterView, JobNeeds, Plan, plan
from slurm_geo.federation.decide.reconcile import (
    PlanPurpose,
    Settings,
    Snapshot,
    StepKind,
    failback_key,
    reconcile,
)
from slurm_geo.federation.model import (
    ClusterStatus,
    Health,
    Incarnation,
    JobStatus,
    Lease,
    LeftHome,
    LogicalJob,
)
from slurm_geo.policy.directives import Directives
from slurm_geo.policy.geo import GeoPolicy, GeoRules
from slurm_geo.slurm.models import JobInfo, JobState
from tests.kit import builders as kit

NOW = 1_800_000_000.0
HOME, CLOUD, EDGE = "onprem", "cloud", "edge"
NAME = "onprem-7"
TTL_S = 30.0
MARGIN_S = 60.0
STABLE_S = 300.0
ALICE_UID = 2001

SETTINGS = Settings(home=HOME, lease_ttl_s=TTL_S, margin_s=MARGIN_S, failback=True,
                    failback_stable_s=STABLE_S, max_restarts=2)
NO_FAILBACK = replace(SETTINGS, failback=False)


def at(offset_s: float) -> datetime:
    """A UTC datetime `offset_s` seconds from NOW (negative: before)."""
    return datetime.fromtimestamp(NOW + offset_s, tz=UTC)


# --- builders --------------------------------------------------------------------------------

def job(**overrides: Any) -> LogicalJob:
    """The job at home, generation 0, running as Slurm job 7; `overrides` change fields."""
    return kit.logical_job(**{"logical_job": NAME, "home": HOME, "cluster": HOME,
                              "script": "#!/bin/bash\n", "spec": {}, "directives": {},
                              "created_at": NOW - 7200, "updated_at": NOW - 7200, **overrides})


def away(**overrides: Any) -> LogicalJob:
    """The job after a failover: generation 1 on cloud as Slurm job 70."""
    return job(**{"generation": 1, "cluster": CLOUD, "job_id": 70, "resume_step": 100,
                  "left_home": LeftHome.OUTAGE, **overrides})


def lease_of(owner: LogicalJob, **overrides: Any) -> Lease:
    """A live lease of `owner`'s current generation, renewed 5 s ago at checkpoint 100."""
    return kit.lease(**{"logical_job": owner.logical_job, "generation": owner.generation,
                        "cluster": owner.cluster, "job_id": owner.job_id or 0,
                        "renewed_at": NOW - 5, "last_step": 100, **overrides})


def expired(owner: LogicalJob, **overrides: Any) -> Lease:
    return lease_of(owner, **{"renewed_at": NOW - TTL_S - 1, **overrides})


def released(owner: LogicalJob, **overrides: Any) -> Lease:
    return lease_of(owner, **{"released": True, **overrides})


def slurm(state: JobState, *, submitted: float | None = -3600.0,
          starts: float | None = -3000.0, reason: str = "None",
          ended: float | None = None, cancelled_by: str | None = None,
          uid: int | None = ALICE_UID) -> JobInfo:
    """What Slurm says of the current incarnation (alice's); times are offsets from NOW.
    `cancelled_by`: who accounting says cancelled it (a uid or a user name)."""
    return kit.job_info(cluster=HOME, job_id=7, name=NAME, state=state, reason=reason,
                        account="ml", partition="gpu",
                        submit_time=None if submitted is None else at(submitted),
                        start_time=None if starts is None else at(starts),
                        end_time=None if ended is None else at(ended), uid=uid, gid=uid,
                        cancelled_by=cancelled_by)


def pending(*, submitted: float | None = -600.0, starts: float | None = 900.0,
            reason: str = "None") -> JobInfo:
    return slurm(JobState.PENDING, submitted=submitted, starts=starts, reason=reason)


def cancelled(by: str | None, *, ended: float = -5.0, uid: int | None = ALICE_UID) -> JobInfo:
    """Slurm's CANCELLED record, ended `ended` s from NOW, `by` as accounting names them."""
    return slurm(JobState.CANCELLED, ended=ended, cancelled_by=by, uid=uid)


def up(cluster: str, *, since: float = NOW - 3600, last_ok: float | None = NOW - 10,
       failures: int = 0) -> Health:
    return Health(cluster, ClusterStatus.UP, failures, since, last_ok, None)


def out(cluster: str) -> Health:
    return Health(cluster, ClusterStatus.OUT, 3, NOW - 120, NOW - 300, "connection refused")


def world(*changed: Health, without: tuple[str, ...] = ()) -> dict[str, Health]:
    """Every cluster up and stable for an hour, except `changed` (and `without` unprobed)."""
    health = {name: up(name) for name in (HOME, CLOUD, EDGE)}
    health.update({h.cluster: h for h in changed})
    return {name: h for name, h in health.items() if name not in without}


def stays(current: str) -> Plan:
    return Plan(NAME, current, current, f"stay on {current}", ())


def moves(current: str, choice: str, *, approval: bool = False) -> Plan:
    return Plan(NAME, current, choice, f"move to {choice}", (), needs_approval=approval)


def incarnation(generation: int, cluster: str) -> Incarnation:
    return kit.incarnation(logical_job=NAME, generation=generation, cluster=cluster,
                           submitted_at=NOW - 7200, training_at=NOW - 7100)


def snap(j: LogicalJob | None = None, *, lease: Lease | None = None,
         info: JobInfo | None = None, health: dict[str, Health] | None = None,
         stale: tuple[Incarnation, ...] = (), chosen: Plan | None = None,
         planned_for: tuple[int | None, float] | None = None) -> Snapshot:
    return Snapshot(j if j is not None else job(), lease, info,
                    world() if health is None else health, NOW, stale, chosen, planned_for)


def case(id: str, snapshot: Snapshot, kind: StepKind, settings: Settings = SETTINGS,
         **fields: Any) -> Any:
    """One row: reconciling `snapshot` gives a step of `kind` whose `fields` are these
    (`reason_has`: a part of the step's reason)."""
    return pytest.param(snapshot, settings, kind, fields, id=id)


# --- shared values for the rows --------------------------------------------------------------

AT_HOME = job()
AWAY = away()
STALE = (incarnation(0, HOME),)
HOME_OUT = world(out(HOME))
RUNNING = slurm(JobState.RUNNING)
HOME_KEY = (100, NOW - 3600)  # failback_key of AWAY with its live lease: (step, home since)

OUT_TO_CLOUD = moves(HOME, CLOUD)
OUT_TO_CLOUD_ASKS = moves(HOME, CLOUD, approval=True)
QUEUE_TO_CLOUD = moves(HOME, CLOUD)
QUEUE_TO_CLOUD_ASKS = moves(HOME, CLOUD, approval=True)
BACK_HOME = moves(CLOUD, HOME)
BACK_HOME_ASKS = moves(CLOUD, HOME, approval=True)
ON_TO_EDGE = moves(CLOUD, EDGE)
STAY_HOME = stays(HOME)
STAY_CLOUD = stays(CLOUD)

FIRST = [
    case("stale incarnations are fenced before anything else, even an outage",
         snap(AWAY, health=world(out(CLOUD)), stale=STALE), StepKind.FENCE_STALE,
         stale=STALE, reason_has="generation 1 on cloud"),
    case("stale incarnations are fenced even for a completed job",
         snap(away(status=JobStatus.COMPLETED), stale=STALE), StepKind.FENCE_STALE,
         stale=STALE),
    case("stale incarnations are fenced even mid-move",
         snap(away(status=JobStatus.MOVING, job_id=None), stale=STALE),
         StepKind.FENCE_STALE, stale=STALE),
    case("a completed job waits", snap(job(status=JobStatus.COMPLETED), info=RUNNING),
         StepKind.WAIT, reason_has="completed"),
    case("a failed job waits, even with its cluster out",
         snap(job(status=JobStatus.FAILED), health=HOME_OUT), StepKind.WAIT,
         reason_has="failed"),
    case("a cancelled job waits", snap(job(status=JobStatus.CANCELLED)), StepKind.WAIT,
         reason_has="cancelled"),
    case("a move the daemon was stopped in is completed",
         snap(away(status=JobStatus.MOVING, job_id=None)), StepKind.COMPLETE_MOVE),
    case("a move is completed even when its target is out or unprobed",
         snap(away(status=JobStatus.MOVING, job_id=None), health=world(without=(CLOUD,))),
         StepKind.COMPLETE_MOVE),
    case("a cluster not probed yet waits", snap(AT_HOME, health=world(without=(HOME,))),
         StepKind.WAIT, reason_has="not probed"),
]

FAILOVER = [
    case("its cluster is out but the lease is live: hold",
         snap(AT_HOME, lease=lease_of(AT_HOME), health=HOME_OUT), StepKind.HOLD_FOR_LEASE,
         reason_has="renewed 5.0 s ago"),
    case("a lease renewed exactly one TTL ago is still live",
         snap(AT_HOME, lease=lease_of(AT_HOME, renewed_at=NOW - TTL_S), health=HOME_OUT),
         StepKind.HOLD_FOR_LEASE),
    case("its cluster is out and the lease ran out: plan a failover",
         snap(AT_HOME, lease=expired(AT_HOME), health=HOME_OUT), StepKind.PLAN,
         purpose=PlanPurpose.FAILOVER, target=None),
    case("out after its trainer released the lease (done training): wait, no move",
         snap(AT_HOME, lease=released(AT_HOME), health=HOME_OUT), StepKind.WAIT,
         reason_has="done training"),
    case("out with a planned move and the lease released at its checkpoint: plan it",
         snap(job(move_to=CLOUD), lease=released(AT_HOME), health=HOME_OUT), StepKind.PLAN,
         purpose=PlanPurpose.FAILOVER),
    case("its cluster is out and it never had a lease: plan a failover",
         snap(AT_HOME, health=HOME_OUT), StepKind.PLAN, purpose=PlanPurpose.FAILOVER),
    case("a live lease of an older generation does not hold a failover",
         snap(AWAY, lease=lease_of(AT_HOME), health=world(out(CLOUD))), StepKind.PLAN,
         purpose=PlanPurpose.FAILOVER),
    case("out, and the plan finds nowhere else: stranded",
         snap(AT_HOME, lease=expired(AT_HOME), health=HOME_OUT, chosen=STAY_HOME),
         StepKind.STRANDED, plan=STAY_HOME, reason_has="stay on onprem"),
    case("out, and the plan's move needs a person: await approval",
         snap(AT_HOME, lease=expired(AT_HOME), health=HOME_OUT, chosen=OUT_TO_CLOUD_ASKS),
         StepKind.AWAIT_APPROVAL, target=CLOUD, plan=OUT_TO_CLOUD_ASKS,
         reason_has="`slurm-geo approve onprem-7 cloud`"),
    case("out, and a person approved another cluster than the plan's: await approval",
         snap(job(move_to=EDGE), lease=expired(AT_HOME), health=HOME_OUT,
              chosen=OUT_TO_CLOUD_ASKS),
         StepKind.AWAIT_APPROVAL, target=CLOUD),
    case("out, and a person approved the plan's choice: move for the outage",
         snap(job(move_to=CLOUD), lease=expired(AT_HOME), health=HOME_OUT,
              chosen=OUT_TO_CLOUD_ASKS),
         StepKind.MOVE, target=CLOUD, plan=OUT_TO_CLOUD_ASKS, left_home=LeftHome.OUTAGE,
         cancel_current=False),
    case("out, and the plan moves it: move for the outage",
         snap(AT_HOME, lease=expired(AT_HOME), health=HOME_OUT, chosen=OUT_TO_CLOUD),
         StepKind.MOVE, target=CLOUD, plan=OUT_TO_CLOUD, left_home=LeftHome.OUTAGE,
         cancel_current=False),
    case("a probe of its cluster just failed: wait and probe again",
         snap(AT_HOME, lease=expired(AT_HOME), info=slurm(JobState.NODE_FAIL),
              health=world(up(HOME, failures=1))),
         StepKind.WAIT, reason_has="probe"),
]

PLANNED_MOVE = [
    case("a planned move happens once the lease is released at its generation",
         snap(away(move_to=HOME, move_after_step=100), lease=released(AWAY, last_step=120),
              info=RUNNING),
         StepKind.MOVE, target=HOME, plan=None, left_home=None, cancel_current=False,
         reason_has="checkpoint 120"),
    case("an approved move off home is a person's choice, remembered as such",
         snap(job(move_to=CLOUD, move_after_step=100), lease=released(AT_HOME, last_step=120),
              info=RUNNING),
         StepKind.MOVE, target=CLOUD, left_home=LeftHome.CHOSEN),
    case("... and so is one on from a cluster the job was moved to",
         snap(away(move_to=EDGE), lease=released(AWAY, last_step=120), info=RUNNING),
         StepKind.MOVE, target=EDGE, left_home=LeftHome.CHOSEN),
    case("a planned move comes before Slurm's report that the job ended",
         snap(away(move_to=HOME), lease=released(AWAY), info=slurm(JobState.COMPLETED)),
         StepKind.MOVE, target=HOME),
    case("a planned move waits while the lease is held",
         snap(away(move_to=HOME), lease=lease_of(AWAY), info=RUNNING),
         StepKind.WAIT, reason_has="running where it should"),
    case("a released lease of an older generation does not start a planned move",
         snap(away(move_to=HOME), lease=released(AT_HOME), info=RUNNING),
         StepKind.WAIT),
]

ENDED = [
    case("Slurm says it ended after the lease was released: finish",
         snap(AT_HOME, lease=released(AT_HOME), info=slurm(JobState.COMPLETED)),
         StepKind.FINISH, state=JobState.COMPLETED),
    case("Slurm's end state is carried: a failed script finishes failed",
         snap(AT_HOME, lease=released(AT_HOME), info=slurm(JobState.FAILED)),
         StepKind.FINISH, state=JobState.FAILED),
    case("ended before its first lease: finish",
         snap(AWAY, info=slurm(JobState.TIMEOUT)), StepKind.FINISH, state=JobState.TIMEOUT),
    case("an unreleased lease of an older generation is not this one's: finish",
         snap(AWAY, lease=expired(AT_HOME), info=slurm(JobState.FAILED)),
         StepKind.FINISH, state=JobState.FAILED),
    case("ended without releasing a live lease: wait for it to run out",
         snap(AT_HOME, lease=lease_of(AT_HOME), info=slurm(JobState.NODE_FAIL)),
         StepKind.WAIT, reason_has="has not run out"),
    case("lost past max_restarts, but the lease is live: wait, not give up",
         snap(job(lost_restarts=2), lease=lease_of(AT_HOME), info=slurm(JobState.NODE_FAIL)),
         StepKind.WAIT),
    case("lost, lease run out, restarts left: plan the restart",
         snap(AT_HOME, lease=expired(AT_HOME), info=slurm(JobState.NODE_FAIL)),
         StepKind.PLAN, purpose=PlanPurpose.RESTART),
    case("reported COMPLETED without releasing its lease: lost, plan the restart",
         snap(job(lost_restarts=1), lease=expired(AT_HOME), info=slurm(JobState.COMPLETED)),
         StepKind.PLAN, purpose=PlanPurpose.RESTART),
    case("lost, and the plan moves it without approval: restart there",
         snap(AT_HOME, lease=expired(AT_HOME), info=slurm(JobState.NODE_FAIL),
              chosen=OUT_TO_CLOUD),
         StepKind.RESTART_LOST, target=CLOUD, plan=OUT_TO_CLOUD, state=JobState.NODE_FAIL,
         left_home=LeftHome.OUTAGE, reason_has="continues on cloud"),
    case("lost, and the plan's move needs approval: restart where it was",
         snap(AT_HOME, lease=expired(AT_HOME), info=slurm(JobState.NODE_FAIL),
              chosen=OUT_TO_CLOUD_ASKS),
         StepKind.RESTART_LOST, target=HOME, plan=OUT_TO_CLOUD_ASKS, left_home=None),
    case("lost, and the plan stays: restart where it was",
         snap(AT_HOME, lease=expired(AT_HOME), info=slurm(JobState.NODE_FAIL),
              chosen=STAY_HOME),
         StepKind.RESTART_LOST, target=HOME, plan=STAY_HOME, state=JobState.NODE_FAIL,
         left_home=None),
    case("lost with max_restarts spent: give up",
         snap(job(lost_restarts=2), lease=expired(AT_HOME), info=slurm(JobState.NODE_FAIL)),
         StepKind.GIVE_UP, state=JobState.NODE_FAIL, reason_has="2 restarts"),
    case("with max_restarts 0 the first loss gives up",
         snap(AT_HOME, lease=expired(AT_HOME), info=slurm(JobState.PREEMPTED)),
         StepKind.GIVE_UP, replace(SETTINGS, max_restarts=0), state=JobState.PREEMPTED),
]

# Issue 29: an owner's scancel is a cancel, never a lost job (federation/cancels.py).
CANCELS = [
    case("its owner's scancel (sacct: CANCELLED by her uid), lease live: cancelled",
         snap(AT_HOME, lease=lease_of(AT_HOME), info=cancelled(str(ALICE_UID))),
         StepKind.OWNER_CANCELLED, state=JobState.CANCELLED,
         reason_has="alice (uid 2001) cancelled generation 0 on onprem:7"),
    case("its owner's scancel, lease run out: still cancelled, never restarted",
         snap(AT_HOME, lease=expired(AT_HOME), info=cancelled(str(ALICE_UID))),
         StepKind.OWNER_CANCELLED),
    case("its owner's scancel with restarts spent: cancelled, not failed",
         snap(job(lost_restarts=2), lease=expired(AT_HOME), info=cancelled(str(ALICE_UID))),
         StepKind.OWNER_CANCELLED),
    case("its owner named by slurmdbd's JSON (kill_request_user): cancelled",
         snap(AWAY, lease=expired(AWAY), info=cancelled("alice")), StepKind.OWNER_CANCELLED),
    case("its owner's scancel of the job still queued: cancelled, not finished failed",
         snap(AT_HOME, info=cancelled(str(ALICE_UID))), StepKind.OWNER_CANCELLED),
    case("its owner's scancel after the trainer released the lease: cancelled",
         snap(AT_HOME, lease=released(AT_HOME), info=cancelled(str(ALICE_UID))),
         StepKind.OWNER_CANCELLED),
    case("root's scancel (the system, an admin): lost, restarted from its checkpoint",
         snap(AT_HOME, lease=expired(AT_HOME), info=cancelled("0")),
         StepKind.PLAN, purpose=PlanPurpose.RESTART),
    case("the SlurmUser's cancel: lost",
         snap(AT_HOME, lease=expired(AT_HOME), info=cancelled("slurm")),
         StepKind.PLAN, purpose=PlanPurpose.RESTART),
    case("the daemon's service account's cancel: lost",
         snap(AT_HOME, lease=expired(AT_HOME), info=cancelled("997")),
         StepKind.PLAN, purpose=PlanPurpose.RESTART),
    case("root's scancel, restarts spent: gives up as before",
         snap(job(lost_restarts=2), lease=expired(AT_HOME), info=cancelled("0")),
         StepKind.GIVE_UP, state=JobState.CANCELLED),
    case("a root-owned job cancelled by root is no owner's cancel",
         snap(AT_HOME, lease=expired(AT_HOME), info=cancelled("0", uid=0)),
         StepKind.PLAN, purpose=PlanPurpose.RESTART),
    case("accounting names nobody yet, just ended: wait for it",
         snap(AT_HOME, lease=expired(AT_HOME), info=cancelled(None)),
         StepKind.WAIT, reason_has="yet to say by whom"),
    case("accounting names nobody, past the grace: lost as before",
         snap(AT_HOME, lease=expired(AT_HOME), info=cancelled(None, ended=-121.0)),
         StepKind.PLAN, purpose=PlanPurpose.RESTART),
    case("a uid, and no uid in the record to compare: wait, then lost",
         snap(AT_HOME, lease=expired(AT_HOME), info=cancelled(str(ALICE_UID), uid=None)),
         StepKind.WAIT, reason_has="yet to say by whom"),
    case("NODE_FAIL is no cancel: lost",
         snap(AT_HOME, lease=expired(AT_HOME),
              info=slurm(JobState.NODE_FAIL, cancelled_by="2001")),
         StepKind.PLAN, purpose=PlanPurpose.RESTART),
]

QUEUE = [
    case("pending for less than the margin: wait",
         snap(AT_HOME, info=pending(submitted=-(MARGIN_S - 1))), StepKind.WAIT,
         reason_has="less than the margin"),
    case("pending with no submit time: wait", snap(AT_HOME, info=pending(submitted=None)),
         StepKind.WAIT, reason_has="less than the margin"),
    case("pending with no start estimate: wait", snap(AT_HOME, info=pending(starts=None)),
         StepKind.WAIT, reason_has="no start estimate"),
    case("pending past the margin: plan a queue move with Slurm's wait from the clock",
         snap(AT_HOME, info=pending(starts=900.0)), StepKind.PLAN,
         purpose=PlanPurpose.QUEUE, current_wait_s=900.0),
    case("pending exactly the margin: plan",
         snap(AT_HOME, info=pending(submitted=-MARGIN_S, starts=42.5)), StepKind.PLAN,
         purpose=PlanPurpose.QUEUE, current_wait_s=42.5),
    case("a start estimate in the past counts as no wait",
         snap(AT_HOME, info=pending(starts=-30.0)), StepKind.PLAN,
         purpose=PlanPurpose.QUEUE, current_wait_s=0.0),
    case("pending, and the plan stays: wait with the plan's reason",
         snap(AT_HOME, info=pending(), chosen=STAY_HOME), StepKind.WAIT,
         reason_has="stay on onprem"),
    case("pending, and the plan's move needs approval: await it",
         snap(AT_HOME, info=pending(), chosen=QUEUE_TO_CLOUD_ASKS), StepKind.AWAIT_APPROVAL,
         target=CLOUD, plan=QUEUE_TO_CLOUD_ASKS),
    case("pending, and a person approved the plan's choice: leave the queue",
         snap(job(move_to=CLOUD), info=pending(), chosen=QUEUE_TO_CLOUD_ASKS),
         StepKind.MOVE, target=CLOUD, cancel_current=True, left_home=LeftHome.QUEUE),
    case("pending, and the plan moves it: cancel the queued job and leave the queue",
         snap(AT_HOME, info=pending(), chosen=QUEUE_TO_CLOUD), StepKind.MOVE,
         target=CLOUD, plan=QUEUE_TO_CLOUD, cancel_current=True, left_home=LeftHome.QUEUE),
    # Issue 29: only a busy queue is hopeless (federation/pending.py), even when Slurm's
    # estimate (a --begin time) is far off and another cluster would start it at once.
    case("--begin (BeginTime): never a hopeless queue",
         snap(AT_HOME, info=pending(starts=7200.0, reason="BeginTime"),
              chosen=QUEUE_TO_CLOUD), StepKind.WAIT, reason_has="--begin"),
    case("a dependency: never a hopeless queue",
         snap(AT_HOME, info=pending(reason="Dependency"), chosen=QUEUE_TO_CLOUD),
         StepKind.WAIT, reason_has="--dependency"),
    case("its owner's hold: never a hopeless queue",
         snap(AT_HOME, info=pending(reason="JobHeldUser"), chosen=QUEUE_TO_CLOUD),
         StepKind.WAIT, reason_has="its owner holds it"),
    case("an admin's hold: never a hopeless queue",
         snap(AT_HOME, info=pending(reason="JobHeldAdmin"), chosen=QUEUE_TO_CLOUD),
         StepKind.WAIT, reason_has="an admin holds it"),
    case("a reservation: never a hopeless queue",
         snap(AT_HOME, info=pending(reason="Reservation"), chosen=QUEUE_TO_CLOUD),
         StepKind.WAIT, reason_has="reservation"),
    case("waiting for nodes (Resources): a queue move is planned",
         snap(AT_HOME, info=pending(reason="Resources")), StepKind.PLAN,
         purpose=PlanPurpose.QUEUE),
    case("waiting its turn (Priority) and the plan moves it: leave the queue",
         snap(AT_HOME, info=pending(reason="Priority"), chosen=QUEUE_TO_CLOUD),
         StepKind.MOVE, target=CLOUD, cancel_current=True),
    case("pending after it trained (a requeue) is no queue move",
         snap(AT_HOME, lease=expired(AT_HOME), info=pending()), StepKind.WAIT,
         reason_has="running where it should"),
]

FAILBACK = [
    case("failback disabled: stay away", snap(AWAY, lease=lease_of(AWAY), info=RUNNING),
         StepKind.WAIT, NO_FAILBACK, reason_has="running where it should"),
    case("home not probed: no failback",
         snap(AWAY, lease=lease_of(AWAY), info=RUNNING, health=world(without=(HOME,))),
         StepKind.WAIT, reason_has="home is not up and stable"),
    case("home out: no failback",
         snap(AWAY, lease=lease_of(AWAY), info=RUNNING, health=HOME_OUT),
         StepKind.WAIT, reason_has="home is not up and stable"),
    case("home up but never answered: no failback",
         snap(AWAY, lease=lease_of(AWAY), info=RUNNING, health=world(up(HOME, last_ok=None))),
         StepKind.WAIT, reason_has="home is not up and stable"),
    case("home up for less than failback_stable_s: no failback",
         snap(AWAY, lease=lease_of(AWAY), info=RUNNING,
              health=world(up(HOME, since=NOW - STABLE_S + 1))),
         StepKind.WAIT, reason_has="home is not up and stable"),
    case("failback already planned for this checkpoint: wait",
         snap(AWAY, lease=lease_of(AWAY), info=RUNNING, planned_for=HOME_KEY),
         StepKind.WAIT, reason_has="already planned"),
    case("failback planned for an older checkpoint: plan again",
         snap(AWAY, lease=lease_of(AWAY, last_step=200), info=RUNNING, planned_for=HOME_KEY),
         StepKind.PLAN, purpose=PlanPurpose.FAILBACK),
    case("failback planned before home's last outage: plan again",
         snap(AWAY, lease=lease_of(AWAY), info=RUNNING, planned_for=(100, NOW - 86400)),
         StepKind.PLAN, purpose=PlanPurpose.FAILBACK),
    case("away, home stable, no plan yet: plan a failback",
         snap(AWAY, lease=lease_of(AWAY), info=RUNNING), StepKind.PLAN,
         purpose=PlanPurpose.FAILBACK),
    case("away and unknown to Slurm: still plan a failback",
         snap(AWAY, lease=lease_of(AWAY)), StepKind.PLAN, purpose=PlanPurpose.FAILBACK),
    case("the plan chooses home: fail back after the lease's checkpoint",
         snap(AWAY, lease=lease_of(AWAY, last_step=300), info=RUNNING, chosen=BACK_HOME),
         StepKind.PLAN_FAILBACK, target=HOME, plan=BACK_HOME, after_step=300),
    case("the plan chooses home before any lease: fail back after no checkpoint",
         snap(AWAY, info=slurm(JobState.CONFIGURING), chosen=BACK_HOME),
         StepKind.PLAN_FAILBACK, target=HOME, after_step=None),
    case("the plan chooses another cluster: no failback",
         snap(AWAY, lease=lease_of(AWAY), info=RUNNING, chosen=ON_TO_EDGE),
         StepKind.WAIT, reason_has="move to edge"),
    case("the plan stays: no failback",
         snap(AWAY, lease=lease_of(AWAY), info=RUNNING, chosen=STAY_CLOUD),
         StepKind.WAIT, reason_has="stay on cloud"),
    case("the plan's failback needs approval: no failback",
         snap(AWAY, lease=lease_of(AWAY), info=RUNNING, chosen=BACK_HOME_ASKS),
         StepKind.WAIT, reason_has="move to onprem"),
    case("a job that left home for a queue never fails back",
         snap(away(left_home=LeftHome.QUEUE), lease=lease_of(AWAY), info=RUNNING),
         StepKind.WAIT, reason_has="running where it should"),
    case("a job a person moved away never fails back, and says how to bring it home",
         snap(away(left_home=LeftHome.CHOSEN), lease=lease_of(AWAY), info=RUNNING,
              chosen=BACK_HOME),
         StepKind.WAIT, reason_has="by approval"),
    case("... but fails over when its cluster is lost",
         snap(away(left_home=LeftHome.CHOSEN), lease=expired(AWAY), info=RUNNING,
              health=world(out(CLOUD)), chosen=BACK_HOME),
         StepKind.MOVE, target=HOME),
    case("a job away for no recorded reason does fail back",
         snap(away(left_home=None), lease=lease_of(AWAY), info=RUNNING), StepKind.PLAN,
         purpose=PlanPurpose.FAILBACK),
    case("a job with a move planned already is not failed back again",
         snap(away(move_to=EDGE), lease=lease_of(AWAY), info=RUNNING), StepKind.WAIT,
         reason_has="running where it should"),
    case("(b6ce6cc) its trainer released the lease away from home: wait for Slurm's end",
         snap(AWAY, lease=released(AWAY, last_step=500), info=RUNNING), StepKind.WAIT,
         reason_has="released the lease"),
    case("(b6ce6cc) ... even when a failback plan would choose home",
         snap(AWAY, lease=released(AWAY, last_step=500), info=slurm(JobState.COMPLETING),
              chosen=BACK_HOME),
         StepKind.WAIT, reason_has="released the lease"),
    case("(b6ce6cc) its trainer released the lease at home: wait for Slurm's end",
         snap(AT_HOME, lease=released(AT_HOME), info=RUNNING), StepKind.WAIT,
         reason_has="released the lease"),
    case("a job at home never fails back",
         snap(AT_HOME, lease=lease_of(AT_HOME), info=RUNNING), StepKind.WAIT,
         reason_has="running where it should"),
    case("a job at home unknown to Slurm waits",
         snap(AT_HOME, lease=lease_of(AT_HOME)), StepKind.WAIT,
         reason_has="running where it should"),
]

CASES = FIRST + FAILOVER + PLANNED_MOVE + ENDED + CANCELS + QUEUE + FAILBACK


@pytest.mark.parametrize(("snapshot", "settings", "kind", "fields"), CASES)
def test_reconcile(snapshot: Snapshot, settings: Settings, kind: StepKind,
                   fields: dict[str, Any]) -> None:
    step = reconcile(snapshot, settings)
    assert step.kind is kind, step
    for name, want in fields.items():
        if name == "reason_has":
            assert want in step.reason, step.reason
        else:
            assert getattr(step, name) == want, (name, step)


def test_the_table_reaches_every_step_kind_and_plan_purpose() -> None:
    steps = [reconcile(p.values[0], p.values[1]) for p in CASES]
    assert {s.kind for s in steps} == set(StepKind)
    assert {s.purpose for s in steps if s.kind is StepKind.PLAN} == set(PlanPurpose)
    assert len({p.id for p in CASES}) == len(CASES)


def test_only_plan_steps_ask_for_a_plan_and_a_plan_is_never_asked_twice() -> None:
    """The daemon asks again with the plan filled in: that answer is never PLAN."""
    for row in CASES:
        snapshot, settings = row.values[0], row.values[1]
        step = reconcile(snapshot, settings)
        assert (step.purpose is not None) == (step.kind is StepKind.PLAN), row.id
        if step.kind is StepKind.PLAN:
            again = reconcile(replace(snapshot, plan=stays(snapshot.job.cluster)), settings)
            assert again.kind is not StepKind.PLAN, row.id


def test_reconcile_is_pure_the_same_snapshot_gives_the_same_step() -> None:
    for row in CASES:
        assert reconcile(row.values[0], row.values[1]) == reconcile(row.values[0],
                                                                    row.values[1]), row.id


@pytest.mark.parametrize(("snapshot", "key"), [
    pytest.param(snap(AWAY, lease=lease_of(AWAY, last_step=300)), (300, NOW - 3600),
                 id="the lease's checkpoint and home's up-since"),
    pytest.param(snap(AWAY), (None, NOW - 3600), id="no lease: no checkpoint"),
    pytest.param(snap(AWAY, health=world(without=(HOME,))), (None, 0.0),
                 id="home not probed: up-since 0"),
])
def test_failback_key(snapshot: Snapshot, key: tuple[int | None, float]) -> None:
    assert failback_key(snapshot) == key


def test_a_failback_asked_once_per_checkpoint_as_the_daemon_records_it() -> None:
    """The daemon records failback_key when it plans; the next round at the same
    checkpoint waits, and the next checkpoint plans again."""
    first = snap(AWAY, lease=lease_of(AWAY), info=RUNNING)
    assert reconcile(first, SETTINGS).purpose is PlanPurpose.FAILBACK
    recorded = failback_key(first)
    same = replace(first, failback_planned_for=recorded)
    assert reconcile(same, SETTINGS).kind is StepKind.WAIT
    later = replace(same, lease=lease_of(AWAY, last_step=101))
    assert reconcile(later, SETTINGS).purpose is PlanPurpose.FAILBACK


# --- with a Plan from the real planner -------------------------------------------------------

RULES = GeoRules(GeoPolicy(), {HOME: "home", CLOUD: "eu", EDGE: "us"})


def real_plan(current: str, failover: str, *, current_up: bool = True,
              waits: dict[str, float] | None = None) -> Plan:
    waits = {HOME: 0.0, CLOUD: 30.0, EDGE: 5000.0, **(waits or {})}
    needs = JobNeeds(logical_job=NAME, home=HOME, current=current, nodes=1, cpus=8, gpus=1,
                     remaining_s=3600.0, checkpoint_bytes=10**9, checkpoint_store=current,
                     directives=Directives(ckpt_dir="/ckpt", failover=failover))
    views = [ClusterView(name, region, name, Prices(), up=name != current or current_up,
                         queue_wait_s=waits[name], fits=True)
             for name, region in RULES.cluster_regions.items()]
    return plan(needs, views, RULES, lambda _src, _dst, _n: 10.0, margin_s=MARGIN_S)


def test_a_real_failover_plan_moves_an_auto_job_for_the_outage() -> None:
    chosen = real_plan(HOME, "auto", current_up=False)
    step = reconcile(snap(AT_HOME, lease=expired(AT_HOME), health=HOME_OUT, chosen=chosen),
                     SETTINGS)
    assert (step.kind, step.target, step.left_home) == (StepKind.MOVE, CLOUD,
                                                        LeftHome.OUTAGE)


def test_a_real_failover_plan_of_a_manual_job_awaits_approval() -> None:
    chosen = real_plan(HOME, "manual", current_up=False)
    step = reconcile(snap(AT_HOME, lease=expired(AT_HOME), health=HOME_OUT, chosen=chosen),
                     SETTINGS)
    assert (step.kind, step.target) == (StepKind.AWAIT_APPROVAL, CLOUD)


def test_a_real_failover_plan_of_a_never_job_strands_it() -> None:
    chosen = real_plan(HOME, "never", current_up=False)
    step = reconcile(snap(AT_HOME, lease=expired(AT_HOME), health=HOME_OUT, chosen=chosen),
                     SETTINGS)
    assert step.kind is StepKind.STRANDED


def test_a_real_plan_leaves_a_hopeless_queue() -> None:
    chosen = real_plan(HOME, "auto", waits={HOME: 900.0})
    step = reconcile(snap(AT_HOME, info=pending(starts=900.0), chosen=chosen), SETTINGS)
    assert (step.kind, step.target, step.cancel_current) == (StepKind.MOVE, CLOUD, True)


def test_a_real_plan_fails_back_home_when_it_starts_at_once() -> None:
    chosen = real_plan(CLOUD, "auto", waits={CLOUD: 0.0})
    step = reconcile(snap(AWAY, lease=lease_of(AWAY), info=RUNNING, chosen=chosen), SETTINGS)
    assert (step.kind, step.target, step.after_step) == (StepKind.PLAN_FAILBACK, HOME, 100)
