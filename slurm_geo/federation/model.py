"""What the federation daemon knows: logical jobs and their lifecycle, incarnations,
leases and cluster health. Pure values; `FederationState` stores them.

A *logical job* is what the user submitted once on the home cluster. Each time the daemon
moves it, its *generation* goes up by one and it runs as a new Slurm job on another
cluster (an *incarnation*). Only the current generation holds a training lease; that is
what keeps two incarnations from ever training at once.

The logical job's lifecycle, enforced by `FederationState.move_status` (a compare-and-set
on the current status):

        registered (first lease of a home job, or pending at home)
              |
              v
           RUNNING ---(Slurm says it ended, lease released)------------> COMPLETED
            |    ^  \\
            |    |   +--(ended without a lease, restarts spent; or failed)--> FAILED
     a move |    | submitted                                                  |
     starts:|    | on the target                                              |
     gen + 1|    |                                                            |
            v    |                                                            |
           MOVING <--------------------- slurm-geo resubmit -------------------+
       (copy, verify, fence, submit;
        repeated from the top after a crash)

           RUNNING or MOVING ---(slurm-geo cancel)---> CANCELLED
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import Any

from slurm_geo.errors import SlurmGeoError
from slurm_geo.exitcodes import ExitCode
from slurm_geo.lifecycle import Lifecycle
from slurm_geo.policy.world import World
from slurm_geo.slurm.models import JobState, Owner


class JobStatus(Enum):
    RUNNING = "running"      # the current generation is queued or running on `cluster`
    MOVING = "moving"        # a new generation is being placed; no lease is granted
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"  # by a person (`slurm-geo cancel`): every incarnation too

    def is_final(self) -> bool:
        return self in _FINAL


_FINAL = frozenset({JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED})

TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    JobStatus.RUNNING: frozenset({JobStatus.MOVING, JobStatus.COMPLETED, JobStatus.FAILED,
                                  JobStatus.CANCELLED}),
    JobStatus.MOVING: frozenset({JobStatus.RUNNING, JobStatus.CANCELLED}),
    JobStatus.COMPLETED: frozenset(),
    JobStatus.FAILED: frozenset({JobStatus.MOVING}),
    JobStatus.CANCELLED: frozenset(),
}


class LeftHome(Enum):
    """Why a job runs away from home. Only a job that left because its cluster was lost
    fails back: one that left a hopeless queue (home was up all along) or that a person
    moved (`slurm-geo approve` while it ran) stays until moved again or its cluster is
    lost."""

    OUTAGE = "outage"
    QUEUE = "queue"
    CHOSEN = "chosen"


class ClusterStatus(Enum):
    UP = "up"
    OUT = "out"


class FederationStateError(SlurmGeoError):
    exit_code = ExitCode.FEDERATION_STATE


class UnknownLogicalJob(FederationStateError):
    exit_code = ExitCode.JOB_NOT_FOUND  # not found, as a job Slurm does not know

    def __init__(self, name: str):
        super().__init__(f"no logical job '{name}' in the federation state; `slurm-geo status` "
                         "without an argument lists them")


class NotActionable(FederationStateError):
    """The job's status does not allow what was asked (cancel, resubmit, approve): nothing
    was done."""

    exit_code = ExitCode.NOT_ACTIONABLE


class IllegalTransition(FederationStateError):
    def __init__(self, logical_job: str, current: JobStatus, wanted: JobStatus):
        self.current, self.wanted = current, wanted
        super().__init__(f"logical job {logical_job}: {current.value} -> {wanted.value} is "
                         "not a transition of the logical job's lifecycle")


class OwnerUnknown(FederationStateError):
    """The state has no owner for the job (registered before slurm-geo recorded owners):
    the daemon never submits a job without one, so nothing runs as root by default."""

    def __init__(self, logical_job: str):
        super().__init__(f"logical job {logical_job} has no recorded owner, so it is never "
                         "submitted again (it would not run as its owner); cancel it with "
                         f"`slurm-geo cancel {logical_job}` and let its owner submit it anew")


class StaleJob(FederationStateError):
    """The job changed under us (another writer moved it first): nothing was written."""

    def __init__(self, logical_job: str, expected: str):
        super().__init__(f"logical job {logical_job} is no longer {expected}")


@dataclass(frozen=True)
class Replica:
    """One federation daemon of a replicated state: what a follower tells a caller to
    redirect to when this one leads."""

    name: str
    site: str
    url: str


class NotLeader(FederationStateError):
    """A write by a replica that does not lead (a follower, or a leader deposed since):
    nothing was written. `leader` is who leads now, when anyone does."""

    exit_code = ExitCode.NOT_LEADER

    def __init__(self, writer: str, leader: Replica | None):
        self.leader = leader
        where = (f"{leader.name} at site {leader.site} ({leader.url}) leads"
                 if leader is not None else "no replica leads right now")
        super().__init__(f"{writer} does not lead the federation state, so it wrote "
                         f"nothing: {where}; send the change there")


class StateUnavailable(FederationStateError):
    """etcd did not answer (no member reachable, or a write whose outcome is unknown)."""

    def __init__(self, detail: str):
        super().__init__(f"the federation state in etcd is unavailable: {detail}")


LIFECYCLE: Lifecycle[JobStatus, str] = Lifecycle(JobStatus, TRANSITIONS, IllegalTransition)


@dataclass(frozen=True, kw_only=True)
class LogicalJob:
    """One logical job as the state holds it (21 fields: built by keyword only)."""

    logical_job: str
    run: str
    home: str
    script: str
    spec: dict[str, Any]
    directives: dict[str, str]
    generation: int
    cluster: str
    job_id: int | None
    resume_step: int | None
    status: JobStatus
    move_to: str | None = None         # a planned move waiting for the next checkpoint
    move_after_step: int | None = None
    created_at: float = 0.0
    updated_at: float = 0.0
    left_home: LeftHome | None = None
    lost_restarts: int = 0             # restarts after a lost incarnation (max_restarts)
    recoveries: int = 0                # incarnations started because the last was lost
    awaiting_approval: str | None = None  # the cluster a move waits for a person to approve
    # Whom Slurm's job record named at registration; every incarnation runs as them.
    owner: Owner | None = None
    # The allow-listed part of the environment the owner submitted with
    # (federation.owners), which later incarnations get again.
    owner_env: dict[str, str] = field(default_factory=dict)

    @property
    def world(self) -> World:
        """What it reads, runs in and writes, as Slurm validated its directives
        (`DirectiveError` if a recorded one no longer parses)."""
        return World.from_options(self.directives)


class IncarnationEnd(StrEnum):
    """Why an incarnation ended, as both backends store it: the values are the strings
    0.1 wrote, so either release reads the other's records.

    Slurm's final state, lowercased, when the daemon saw the job end (`from_slurm`);
    `CANCELLED` also when a person cancelled the logical job (`slurm-geo cancel`, or its
    owner's scancel); `ENDED` when a move or a cancel found it already over in Slurm;
    `FENCED` when a move cancelled it there. A reason this release does not know (a newer
    release's, read during a rolling upgrade) reads as itself, named OTHER, and is kept."""

    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"
    NODE_FAIL = "node_fail"
    PREEMPTED = "preempted"
    BOOT_FAIL = "boot_fail"
    DEADLINE = "deadline"
    OUT_OF_MEMORY = "out_of_memory"
    REVOKED = "revoked"
    SPECIAL_EXIT = "special_exit"
    UNKNOWN = "unknown"
    ENDED = "ended"
    FENCED = "cancelled: fenced"

    @classmethod
    def from_slurm(cls, state: JobState) -> IncarnationEnd:
        return cls(state.value.lower())

    @classmethod
    def read(cls, stored: str | None) -> IncarnationEnd | None:
        return None if stored is None else cls(stored)

    @classmethod
    def _missing_(cls, value: object) -> IncarnationEnd | None:
        if not isinstance(value, str):
            return None
        other = str.__new__(cls, value)
        other._name_, other._value_ = "OTHER", value
        return other


@dataclass(frozen=True)
class Incarnation:
    logical_job: str
    generation: int
    cluster: str
    job_id: int | None
    resume_step: int | None
    submitted_at: float
    training_at: float | None
    ended_at: float | None
    end_reason: IncarnationEnd | None


@dataclass(frozen=True)
class RunOwner:
    """An admin's assignment of `run` to `owner` (federation.runowners)."""

    run: str
    owner: Owner
    assigned_by: str
    assigned_at: float

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "owner": self.owner.user, "uid": self.owner.uid,
                "gid": self.owner.gid, "assigned_by": self.assigned_by,
                "assigned_at": self.assigned_at}

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> RunOwner:
        return cls(str(record["run"]), Owner(str(record["owner"]), int(record["uid"]),
                                             int(record["gid"])),
                   str(record["assigned_by"]), float(record["assigned_at"]))


@dataclass(frozen=True)
class Lease:
    logical_job: str
    generation: int
    cluster: str
    job_id: int
    restart: int
    renewed_at: float
    last_step: int | None
    released: bool

    def expired(self, now: float, ttl_s: float) -> bool:
        return self.released or now - self.renewed_at > ttl_s


@dataclass(frozen=True)
class Health:
    cluster: str
    status: ClusterStatus
    failures: int           # probes failed in a row
    since: float            # when `status` began
    last_ok: float | None
    last_error: str | None

    @property
    def answering(self) -> bool:
        """Up, and its last probe answered: safe to wait on its controller."""
        return self.status is ClusterStatus.UP and self.failures == 0


def answering(health: dict[str, Health], cluster: str) -> bool:
    known = health.get(cluster)
    return known is not None and known.answering


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()
