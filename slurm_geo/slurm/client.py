"""The one interface through which slurm-geo asks anything of a Slurm cluster."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime, timedelta

from slurm_geo.slurm.models import (
    AccountingRecord,
    JobInfo,
    JobSpec,
    MalformedAccountingRow,
    NodeInfo,
)


class SlurmClient(ABC):
    """A cluster, reached by its CLI or by slurmrestd.

    Every method returns within the cluster's timeout or raises a `SlurmError` subclass:
    `ControllerUnreachable` when the controller does not answer, `JobNotFound`, or
    `SlurmRejected` when Slurm answered no.
    """

    cluster: str
    timeout_s: float

    @abstractmethod
    def submit(self, spec: JobSpec) -> int:
        """Queue a batch job; returns its job id."""

    @abstractmethod
    def job(self, job_id: int) -> JobInfo:
        """Current state of a job, including finished ones slurmctld or slurmdbd remember."""

    @abstractmethod
    def jobs(self) -> list[JobInfo]:
        """Every job slurmctld currently holds (pending, running, recently finished)."""

    @abstractmethod
    def cancel(self, job_id: int) -> None: ...

    @abstractmethod
    def requeue(self, job_id: int) -> None:
        """Put a running or finished batch job back in the queue, keeping its job id."""

    @abstractmethod
    def batch_script(self, job_id: int) -> str:
        """The batch script a queued or running job was submitted with."""

    @abstractmethod
    def batch_environment(self, job_id: int) -> dict[str, str]:
        """The environment the batch job was submitted with, as Slurm keeps it (slurmdbd
        with AccountingStoreFlags=job_env); SlurmRejected where Slurm keeps none."""

    @abstractmethod
    def hold(self, job_id: int, comment: str | None = None) -> None:
        """Keep a pending job from starting; with `comment`, also set its comment to it,
        where squeue and `scontrol show job` tell its owner why."""

    @abstractmethod
    def release(self, job_id: int) -> None: ...

    @abstractmethod
    def ping(self) -> float:
        """Seconds the controller took to answer; raises ControllerUnreachable if it did not."""

    @abstractmethod
    def nodes(self) -> list[NodeInfo]: ...

    @abstractmethod
    def expected_start(self, spec: JobSpec) -> datetime | None:
        """When a job like `spec` would start if submitted now; None if Slurm cannot tell."""

    def accounting(self, job_ids: Iterable[int] = (), start: datetime | None = None,
                   end: datetime | None = None) -> list[AccountingRecord]:
        """slurmdbd's records, every requeued incarnation included, all users.

        Either `job_ids`, or a window [start, end) the records overlap.
        """
        ids = list(job_ids)
        if ids:
            return self.accounting_of(ids)
        if start is None or end is None:
            raise ValueError("accounting needs job ids or a start and an end")
        return self.accounting_between(start, end)

    @abstractmethod
    def accounting_of(self, job_ids: list[int]) -> list[AccountingRecord]:
        """slurmdbd's records of these jobs, every incarnation."""

    @abstractmethod
    def accounting_between(self, start: datetime, end: datetime) -> list[AccountingRecord]:
        """slurmdbd's records that overlap [start, end), one per incarnation."""

    def accounting_rows(self, start: datetime, end: datetime
                        ) -> Iterator[AccountingRecord | MalformedAccountingRow]:
        """The records `accounting(start=, end=)` answers, one at a time, for a large
        window (billing ingest). A backend that reads them a line at a time (the CLI's
        `sacct --parsable2`) yields a record it cannot read as a MalformedAccountingRow
        instead of failing the window; one that answers a whole document (slurmrestd)
        streams that document's records."""
        yield from self.accounting(start=start, end=end)


def overlaps(record: AccountingRecord, start: datetime, end: datetime) -> bool:
    began = record.start_time or record.submit_time
    if began is None or began >= end:
        return False
    return record.end_time is None or record.end_time >= start


# Windows sent to Slurm are widened by this much, then cut exactly on the epoch times the
# records carry: the server reads window bounds in its own local time zone.
WINDOW_SLACK = timedelta(days=1)


def job_from_records(records: list[AccountingRecord]) -> JobInfo:
    """A job slurmctld has forgotten, rebuilt from its accounting incarnations."""
    last = max(records, key=lambda r: r.submit_time or datetime.min.replace(tzinfo=UTC))
    return JobInfo(
        cluster=last.cluster, job_id=last.job_id, name=last.name, state=last.state,
        reason="", user=last.user, account=last.account, partition=last.partition,
        nodes=last.nodes, restart_count=len(records) - 1, submit_time=last.submit_time,
        start_time=last.start_time, end_time=last.end_time, time_limit_minutes=None,
        exit_code=last.exit_code, cancelled_by=cancel_requester(records),
    )


def cancel_requester(records: list[AccountingRecord]) -> str | None:
    """Who cancelled the job's current (last submitted) incarnation, as accounting names
    them (a uid or a user name); None when it was not cancelled or nobody is named."""
    if not records:
        return None
    last = max(records, key=lambda r: r.submit_time or datetime.min.replace(tzinfo=UTC))
    return last.cancelled_by or None
