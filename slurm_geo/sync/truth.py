"""Is a job's checkpoint directory replicated, as checkpoint-sync's state says: pure.

`jobdirs.protection` answers from the configuration alone: whether checkpoint-sync is
*meant* to replicate a directory. What it has done is in its state database: the
`sources` row of the directory (a directory it cannot read, or that conflicts with
another, replicates nothing) and the replicas of its runs (a checkpoint sealed under a
user's own key, say, fails every attempt). The node epilog records the verdict of
`sync_verdict` ("replicated": false and why, whenever the state says so), and `slurm-geo
sync status` warns with `failing_runs`'s lines, so neither says "replicated" while the
daemon fails.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from slurm_geo.sync.jobdirs import Protection, SourceStatus
from slurm_geo.sync.state import Replica, Source, Status

_BROKEN = (Status.FAILED, Status.CORRUPTED)
_TRYING = (Status.PENDING, Status.UPLOADING)


@dataclass(frozen=True)
class Failing:
    """A run whose newest checkpoint at a destination checkpoint-sync keeps failing."""

    run: str
    destination: str
    step: int
    status: Status
    failures: int
    last_error: str

    def line(self) -> str:
        what = {Status.FAILED: "gave up", Status.CORRUPTED: "found it damaged"}.get(
            self.status, "retrying")
        if self.failures:
            what += f" after {self.failures} failed attempt{'s' if self.failures != 1 else ''}"
        return (f"run {self.run}: checkpoint-sync has not replicated step {self.step} to "
                f"{self.destination} ({what}: {self.last_error or '-'})")


def failing_runs(replicas: Iterable[Replica], run: str | None = None) -> list[Failing]:
    """Per run (only `run`, when given) and destination: its newest step's replica when
    it failed, is damaged, or is being retried after a failure, with nothing verified at
    that step or later. Sorted by run, destination."""
    newest: dict[tuple[str, str], Replica] = {}
    verified: dict[tuple[str, str], int] = {}
    for replica in replicas:
        if run is not None and replica.run != run:
            continue
        key = (replica.run, replica.destination)
        if replica.status is Status.VERIFIED:
            verified[key] = max(verified.get(key, -1), replica.step)
        if replica.status is Status.SKIPPED:
            continue
        if key not in newest or replica.step > newest[key].step:
            newest[key] = replica
    found = []
    for key, replica in sorted(newest.items()):
        if verified.get(key, -1) >= replica.step:
            continue
        if replica.status in _BROKEN or (replica.status in _TRYING and replica.failures > 0):
            found.append(Failing(replica.run, replica.destination, replica.step,
                                 replica.status, replica.failures, replica.last_error or ""))
    return found


def sync_verdict(meant: Protection, source: Source | None, replicas: Iterable[Replica],
                 run: str | None = None) -> Protection:
    """`meant` (the configuration's answer), unless the state says otherwise: the
    directory's source row is a problem, or kept home, or one of its runs (`run`, when the
    job's final checkpoint names one) is failing."""
    if not meant.replicated:
        return meant
    if source is not None and (source.status.is_problem
                               or source.status is SourceStatus.KEPT_HOME):
        return Protection(None, False, f"checkpoint-sync finds the directory "
                                       f"{source.status.value}: {source.detail or '-'}")
    failing = failing_runs(replicas, run)
    if failing:
        return Protection(None, False, failing[0].line())
    return meant
