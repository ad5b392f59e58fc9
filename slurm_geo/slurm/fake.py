"""An in-memory Slurm cluster for unit tests: the federation loop in seconds, no sandbox.

It behaves like the real backends where slurm-geo depends on them (errors by type, job ids
kept across requeues, one accounting record per incarnation, every call failing while the
controller is down or its token is refused), and nothing happens on its own: a test
moves jobs with `start` and `finish`. A job belongs to its spec's owner (else the fake's
own user, uid and gid), and its batch environment is its spec's environment, as slurmdbd
keeps it with AccountingStoreFlags=job_env; `submitted` keeps every spec, owner and
environment included.
It never replaces the sandbox tests, which are what say the real backends behave like this.

A job's states, as the fake drives them (requeue and the test controls are the only ways
out of a state; terminal states stay until a requeue):

    submit --> PENDING --start--> RUNNING --finish--> COMPLETED | FAILED | ...
                 ^  |                |
                 |  +---cancel-------+---cancel-----> CANCELLED
                 +-------requeue (from RUNNING or any terminal state)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

from slurm_geo.slurm.client import SlurmClient, job_from_records, overlaps
from slurm_geo.slurm.errors import (
    ControllerUnreachable,
    JobNotFound,
    SlurmRejected,
    TokenRejected,
)
from slurm_geo.slurm.models import AccountingRecord, JobInfo, JobSpec, JobState, NodeInfo

HELD_REASON = "JobHeldUser"  # what scontrol hold leaves; JobInfo.held reads it
IDLE_REASON = "None"  # squeue's word for "no reason", pending or running
DEFAULT_PARTITION = "batch"  # the sandbox clusters' partition, so fixtures read alike


def default_nodes(cluster: str) -> list[NodeInfo]:
    """Two idle 2-CPU nodes, named like the sandbox's (`<cluster>-n1`, `<cluster>-n2`)."""
    return [NodeInfo(f"{cluster}-n{i}", "idle", (), "", 2, (DEFAULT_PARTITION,))
            for i in (1, 2)]


@dataclass
class _Job:
    job_id: int
    spec: JobSpec
    state: JobState
    reason: str
    submit_time: datetime
    start_time: datetime | None = None
    end_time: datetime | None = None
    exit_code: int | None = None
    nodes: str = ""
    past: list[AccountingRecord] = field(default_factory=list)  # incarnations before requeues
    forgotten: bool = False  # slurmctld purged it (MinJobAge); only slurmdbd still knows
    cancelled_by: str = ""  # the uid that cancelled it, as sacct's "CANCELLED by UID" says


class FakeSlurm(SlurmClient):
    """A cluster whose controller is this object; see the module docstring.

    `expected_start` answers "now" until told otherwise (`set_expected_start`), as an idle
    cluster does. Node states are what the test sets; jobs do not occupy nodes.
    Calls on a down controller raise at once rather than after `timeout_s`, so tests stay fast.
    """

    def __init__(self, cluster: str, clock: Callable[[], float] = time.time,
                 timeout_s: float = 1.0, *, nodes: list[NodeInfo] | None = None,
                 user: str = "fake-user", account: str = "fake-account", uid: int = 1000,
                 gid: int = 1000):
        self.cluster = cluster
        self.timeout_s = timeout_s
        self.user = user
        self.account = account
        self.uid, self.gid = uid, gid
        self._clock = clock
        # One lock for everything: the daemon calls from its probe thread and its main loop,
        # and the test's controls come from a third.
        self._lock = threading.Lock()
        self._jobs: dict[int, _Job] = {}
        self._submitted: list[tuple[int, JobSpec]] = []
        self._nodes = list(default_nodes(cluster) if nodes is None else nodes)
        self._expected: datetime | float | None = 0.0
        self._down = False
        self._token_refused = ""  # why every call is refused as a bad JWT; "" when it is not
        self._rejections: list[str] = []

    # --- SlurmClient ------------------------------------------------------------------------

    def submit(self, spec: JobSpec) -> int:
        with self._controller():
            if self._rejections:
                raise SlurmRejected(self.cluster, "submit", self._rejections.pop(0))
            job_id = len(self._submitted) + 1
            self._jobs[job_id] = _Job(job_id, spec, JobState.PENDING,
                                      HELD_REASON if spec.hold else IDLE_REASON, self._now())
            self._submitted.append((job_id, spec))
            return job_id

    def job(self, job_id: int) -> JobInfo:
        with self._controller():
            job = self._jobs.get(job_id)
            if job is None:
                raise JobNotFound(self.cluster, job_id)
            if job.forgotten:  # as the real backends do: rebuilt from accounting
                return job_from_records(self._records(job))
            return self._info(job)

    def jobs(self) -> list[JobInfo]:
        with self._controller():
            return [self._info(j) for j in self._jobs.values() if not j.forgotten]

    def cancel(self, job_id: int, by_uid: int | None = None) -> None:
        """scancel as this client's account, or (a test's) as `by_uid`: the job's owner,
        root; accounting names who it was, as sacct's "CANCELLED by UID"."""
        with self._controller():
            job = self._held_by_ctld(job_id)
            if not job.state.is_terminal():  # scancel on a finished job says nothing
                self._end(job, JobState.CANCELLED, exit_code=0)
                job.cancelled_by = str(self.uid if by_uid is None else by_uid)

    def requeue(self, job_id: int) -> None:
        with self._controller():
            job = self._held_by_ctld(job_id)
            if job.state is JobState.PENDING:
                raise SlurmRejected(self.cluster, "requeue", "Job is pending execution")
            if job.spec.requeue is False:
                raise SlurmRejected(self.cluster, "requeue",
                                    "Requested operation is presently disabled")
            if not job.state.is_terminal():
                # sacct shows an incarnation cut short by a requeue as REQUEUED.
                self._end(job, JobState.REQUEUED, exit_code=0)
            job.past.append(self._record(job))
            # A new incarnation gets its own submit time, so job_from_records finds it last.
            job.state, job.reason, job.submit_time = JobState.PENDING, IDLE_REASON, self._now()
            job.start_time = job.end_time = job.exit_code = None
            job.nodes, job.cancelled_by = "", ""

    def batch_script(self, job_id: int) -> str:
        with self._controller():
            return self._held_by_ctld(job_id).spec.script

    def batch_environment(self, job_id: int) -> dict[str, str]:
        with self._controller():  # from slurmdbd: a job slurmctld purged has it too
            return dict(self._known(job_id).spec.environment)

    def hold(self, job_id: int, comment: str | None = None) -> None:
        """As scontrol and slurmrestd do: a pending job is held; a running one is only
        marked (it runs on, its reason says held); a finished one is refused."""
        with self._controller():
            job = self._unfinished(job_id, "hold")
            job.reason = HELD_REASON
            if comment is not None:
                job.spec = replace(job.spec, comment=comment)

    def release(self, job_id: int) -> None:
        with self._controller():
            job = self._unfinished(job_id, "release")
            job.reason = IDLE_REASON

    def ping(self) -> float:
        with self._controller():
            return 0.0

    def nodes(self) -> list[NodeInfo]:
        with self._controller():
            return list(self._nodes)

    def expected_start(self, spec: JobSpec) -> datetime | None:
        with self._controller():
            return self._expected_start()

    def _expected_start(self) -> datetime | None:
        if isinstance(self._expected, float):
            return self._now() + timedelta(seconds=self._expected)
        return self._expected

    def accounting_of(self, job_ids: list[int]) -> list[AccountingRecord]:
        with self._controller():
            return [r for i in job_ids if i in self._jobs for r in self._records(self._jobs[i])]

    def accounting_between(self, start: datetime, end: datetime) -> list[AccountingRecord]:
        with self._controller():
            return [r for j in self._jobs.values() for r in self._records(j)
                    if overlaps(r, start, end)]

    # --- test controls: the cluster doing things on its own ---------------------------------

    def start(self, job_id: int) -> None:
        """The scheduler starts a pending, unheld job on the first nodes it needs."""
        with self._lock:
            job = self._known(job_id)
            if job.state is not JobState.PENDING or job.reason == HELD_REASON:
                raise ValueError(f"job {job_id} is {job.state.value} ({job.reason}); "
                                 "only a pending job that is not held can start")
            job.state, job.reason, job.start_time = JobState.RUNNING, IDLE_REASON, self._now()
            job.nodes = ",".join(n.name for n in self._nodes[:job.spec.nodes])

    def finish(self, job_id: int, state: JobState = JobState.COMPLETED,
               exit_code: int | None = None) -> None:
        """The job ends in `state`; exit code 0 for COMPLETED, else 1, unless given."""
        if not state.is_terminal():
            raise ValueError(f"{state.value} is not a state a job finishes in")
        with self._lock:
            job = self._known(job_id)
            if job.state.is_terminal():
                raise ValueError(f"job {job_id} already ended {job.state.value}")
            code = exit_code if exit_code is not None else int(state is not JobState.COMPLETED)
            self._end(job, state, code)

    def forget(self, job_id: int) -> None:
        """slurmctld purges a finished job (MinJobAge); `job` then answers from accounting."""
        with self._lock:
            job = self._known(job_id)
            if not job.state.is_terminal():
                raise ValueError(f"job {job_id} is {job.state.value}; slurmctld keeps it")
            job.forgotten = True

    def go_down(self) -> None:
        """From now on every client call raises ControllerUnreachable; jobs keep their state."""
        with self._lock:
            self._down = True

    def come_back(self) -> None:
        with self._lock:
            self._down = False

    def refuse_token(self, detail: str = "Protocol authentication error") -> None:
        """From now on every call raises TokenRejected, as a REST cluster does once the
        daemon's JWT has expired; `accept_token` ends it (a new token was written)."""
        with self._lock:
            self._token_refused = detail

    def accept_token(self) -> None:
        with self._lock:
            self._token_refused = ""

    def reject_next_submit(self, message: str = "Batch job submission failed") -> None:
        """The next submission (one per call, queued) is refused with SlurmRejected."""
        with self._lock:
            self._rejections.append(message)

    def set_expected_start(self, when: datetime | float | None) -> None:
        """What `expected_start` answers: this datetime; this many seconds after the clock's
        now at each call; or None, "Slurm cannot tell"."""
        with self._lock:
            self._expected = float(when) if isinstance(when, int | float) else when

    def set_nodes(self, nodes: list[NodeInfo]) -> None:
        with self._lock:
            self._nodes = list(nodes)

    @property
    def submitted(self) -> list[tuple[int, JobSpec]]:
        """Every accepted submission in order, for tests to read scripts and environments."""
        with self._lock:
            return list(self._submitted)

    # --- inside -----------------------------------------------------------------------------

    @contextmanager
    def _controller(self) -> Iterator[None]:
        with self._lock:
            if self._down:
                raise ControllerUnreachable(self.cluster, "fake controller is down",
                                            self.timeout_s)
            if self._token_refused:
                raise TokenRejected(self.cluster, "call", self.user,
                                    Path(f"/fake/{self.cluster}.jwt"), self._token_refused)
            yield

    def _now(self) -> datetime:
        return datetime.fromtimestamp(self._clock(), UTC)

    def _known(self, job_id: int) -> _Job:
        job = self._jobs.get(job_id)
        if job is None:
            raise JobNotFound(self.cluster, job_id)
        return job

    def _held_by_ctld(self, job_id: int) -> _Job:
        """Commands that go to slurmctld: a purged job is an invalid job id there."""
        job = self._known(job_id)
        if job.forgotten:
            raise JobNotFound(self.cluster, job_id)
        return job

    def _unfinished(self, job_id: int, action: str) -> _Job:
        job = self._held_by_ctld(job_id)
        if job.state.is_terminal():
            raise SlurmRejected(self.cluster, action, "Job has already finished")
        return job

    def _end(self, job: _Job, state: JobState, exit_code: int) -> None:
        job.state, job.reason, job.exit_code = state, IDLE_REASON, exit_code
        job.end_time = self._now()

    def _info(self, job: _Job) -> JobInfo:
        # A pending job's start time is Slurm's estimate of it, as squeue and slurmrestd
        # report it; the same estimate `expected_start` gives.
        pending = job.state is JobState.PENDING and not job.reason.startswith("JobHeld")
        owner = job.spec.owner
        return JobInfo(
            cluster=self.cluster, job_id=job.job_id, name=job.spec.name, state=job.state,
            reason=job.reason, user=self._user_of(job), account=self.account,
            partition=job.spec.partition or DEFAULT_PARTITION, nodes=job.nodes,
            restart_count=len(job.past), submit_time=job.submit_time,
            start_time=self._expected_start() if pending else job.start_time,
            end_time=job.end_time,
            time_limit_minutes=job.spec.time_limit_minutes, exit_code=job.exit_code,
            uid=self.uid if owner is None else owner.uid,
            gid=self.gid if owner is None else owner.gid,
        )

    def _user_of(self, job: _Job) -> str:
        return self.user if job.spec.owner is None else job.spec.owner.user

    def _records(self, job: _Job) -> list[AccountingRecord]:
        return [*job.past, self._record(job)]

    def _record(self, job: _Job) -> AccountingRecord:
        """The current incarnation as slurmdbd has it; a running one's elapsed time grows."""
        began = job.start_time
        elapsed = 0 if began is None else int(((job.end_time or self._now()) - began)
                                              .total_seconds())
        tres = {} if began is None else {"cpu": job.spec.cpus_per_task * job.spec.nodes,
                                         "node": job.spec.nodes}
        return AccountingRecord(
            cluster=self.cluster, job_id=job.job_id, name=job.spec.name,
            user=self._user_of(job), account=self.account,
            partition=job.spec.partition or DEFAULT_PARTITION,
            state=job.state, submit_time=job.submit_time, start_time=began,
            end_time=job.end_time, elapsed_s=elapsed, allocated_tres=tres,
            exit_code=job.exit_code, nodes=job.nodes, comment=job.spec.comment or "",
            cancelled_by=job.cancelled_by,
        )
