"""What slurm-geo knows about jobs, nodes and accounting, independent of how it was asked."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum
from pathlib import Path


class JobState(Enum):
    PENDING = "PENDING"
    CONFIGURING = "CONFIGURING"
    RUNNING = "RUNNING"
    SUSPENDED = "SUSPENDED"
    COMPLETING = "COMPLETING"
    REQUEUED = "REQUEUED"
    REQUEUE_HOLD = "REQUEUE_HOLD"
    REQUEUE_FED = "REQUEUE_FED"
    RESIZING = "RESIZING"
    SIGNALING = "SIGNALING"
    STAGE_OUT = "STAGE_OUT"
    STOPPED = "STOPPED"
    COMPLETED = "COMPLETED"
    CANCELLED = "CANCELLED"
    FAILED = "FAILED"
    TIMEOUT = "TIMEOUT"
    NODE_FAIL = "NODE_FAIL"
    PREEMPTED = "PREEMPTED"
    BOOT_FAIL = "BOOT_FAIL"
    DEADLINE = "DEADLINE"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    REVOKED = "REVOKED"
    SPECIAL_EXIT = "SPECIAL_EXIT"
    UNKNOWN = "UNKNOWN"

    @classmethod
    def parse(cls, text: str) -> JobState:
        # sacct prints e.g. "CANCELLED by 0"; only the first word is the state.
        word = text.split()[0].upper() if text.strip() else "UNKNOWN"
        try:
            return cls(word)
        except ValueError:
            return cls.UNKNOWN

    def is_terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset({
    JobState.COMPLETED, JobState.CANCELLED, JobState.FAILED, JobState.TIMEOUT,
    JobState.NODE_FAIL, JobState.PREEMPTED, JobState.BOOT_FAIL, JobState.DEADLINE,
    JobState.OUT_OF_MEMORY, JobState.REVOKED, JobState.SPECIAL_EXIT,
})


# What a job whose environment names no PATH gets (both backends).
DEFAULT_JOB_PATH = "/usr/local/bin:/usr/bin:/bin"


@dataclass(frozen=True)
class Owner:
    """The account a job belongs to and runs as, as Slurm's job record names it."""

    user: str
    uid: int
    gid: int


@dataclass(frozen=True)
class JobSpec:
    """A batch job to submit: the same fields work through sbatch and through slurmrestd.

    slurmrestd does not read `#SBATCH` lines, so everything Slurm must know is a field here.
    `environment` is the job's whole environment: nothing of the submitting process's own
    reaches the job (PATH is DEFAULT_JOB_PATH when it names none). `owner`: the account
    the job runs as (slurm-geo-submit-as on a CLI cluster; on a REST cluster the account
    mapped to that user); None submits as the caller's own account.
    """

    script: str
    name: str = "slurm-geo"
    working_dir: Path = Path("/tmp")
    environment: dict[str, str] = field(default_factory=dict)
    owner: Owner | None = None
    partition: str | None = None
    time_limit_minutes: int | None = None
    nodes: int = 1
    max_nodes: int | None = None  # sbatch --nodes=MIN-MAX: up to this many when free
    tasks_per_node: int | None = None
    cpus_per_task: int = 1
    requeue: bool | None = None
    signal: str | None = None  # as sbatch --signal, e.g. "B:USR1@60"
    output: str | None = None
    hold: bool = False
    comment: str | None = None


@dataclass(frozen=True)
class JobInfo:
    cluster: str
    job_id: int
    name: str
    state: JobState
    reason: str
    user: str
    account: str
    partition: str
    nodes: str
    restart_count: int
    submit_time: datetime | None
    start_time: datetime | None
    end_time: datetime | None
    time_limit_minutes: int | None
    exit_code: int | None
    uid: int | None = None  # the owner's, as slurmctld has them (accounting has none)
    gid: int | None = None
    # Who asked Slurm to cancel a CANCELLED job: a uid (sacct's "CANCELLED by 2001") or a
    # user name (slurmdbd's kill_request_user); None where nobody said (slurmctld's records
    # never do: the daemon asks accounting, slurm_geo.slurm.client.cancel_requester).
    cancelled_by: str | None = None
    # The job's working directory (where its owner ran sbatch, or its --chdir), as
    # slurmctld has it; None where the record has none (accounting's).
    work_dir: str | None = None

    @property
    def owner(self) -> Owner | None:
        """Whom Slurm runs the job as; None when the record lacks the user, uid or gid."""
        if not self.user or self.uid is None or self.gid is None:
            return None
        return Owner(self.user, self.uid, self.gid)

    @property
    def held(self) -> bool:
        return self.state is JobState.PENDING and self.reason.startswith("JobHeld")


@dataclass(frozen=True)
class NodeInfo:
    name: str
    state: str  # base state in lower case: idle, mixed, allocated, down, ...
    flags: tuple[str, ...]
    reason: str
    cpus: int
    partitions: tuple[str, ...]

    @property
    def available(self) -> bool:
        """Can take new work now or soon: up, and not draining or being powered down."""
        blocked = {"DRAIN", "DRAINING", "DRAINED", "NOT_RESPONDING", "POWERED_DOWN", "FAIL"}
        return self.state in ("idle", "mixed", "allocated", "completing") and not (
            blocked & set(self.flags)
        )


@dataclass(frozen=True)
class AccountingRecord:
    """One incarnation of a job as slurmdbd recorded it (requeues give several)."""

    cluster: str
    job_id: int
    name: str
    user: str
    account: str
    partition: str
    state: JobState
    submit_time: datetime | None
    start_time: datetime | None
    end_time: datetime | None
    elapsed_s: int
    allocated_tres: dict[str, int]
    exit_code: int | None
    nodes: str
    comment: str = ""
    admin_comment: str = ""  # set by job_submit.lua: "geo:cost_center=NAME"
    cancelled_by: str = ""   # a CANCELLED incarnation's requester: a uid or a user name

    @property
    def settled(self) -> bool:
        """slurmdbd holds the job's full record, not the placeholder it keeps briefly.

        For a job that starts right after submission slurmdbd may first store a row with
        no partition and the name "allocation"; the real values follow seconds later.
        """
        return bool(self.partition)


@dataclass(frozen=True)
class MalformedAccountingRow:
    """A line of accounting output that could not be read as a record; kept, never dropped."""

    cluster: str
    line: int
    text: str
    reason: str
