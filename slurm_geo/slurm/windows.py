"""Which accounting records a time window holds: every incarnation that overlaps it.

Slurm's accounting (sacct, slurmrestd's /slurmdb/jobs) selects records for a window in
two ways. Without states, those eligible before the window's end and not ended before its
start; with states, those in one of them that ended in the window, by their end time.
slurmctld clears the eligible time of a requeued incarnation's record when the job is held
at once after the requeue (EpilogSlurmctld's hold at [policy] max_restarts, or an admin's
`scontrol hold`): that incarnation is then in no plain window at all, while `sacct -D -j
ID` shows it (issue 29: a job requeued three times and held had its third incarnation
unbilled). So both backends ask twice, plainly and for ENDED_STATES, and keep one record
per incarnation (slurmdbd's own key: job id, submit time).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime

from slurm_geo.slurm.models import AccountingRecord

# The states an incarnation's record ends in, as `sacct --state` and slurmrestd take them.
ENDED_STATES = ("BF", "CA", "CD", "DL", "F", "NF", "OOM", "PR", "RQ", "TO")
STATE_FILTER = ",".join(ENDED_STATES)
# The same by name: slurmrestd's data parser (REST API v0.0.40 on, Slurm 23.11 on) takes
# one full state name per `state=` (26.05 answers 500 "Unknown flag" for codes or a list).
ENDED_STATE_NAMES = ("BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
                     "OUT_OF_MEMORY", "PREEMPTED", "REQUEUED", "TIMEOUT")

IncarnationKey = tuple[int, datetime | None]


def incarnation_key(record: AccountingRecord) -> IncarnationKey:
    return (record.job_id, record.submit_time)


def one_per_incarnation(records: Iterable[AccountingRecord]) -> list[AccountingRecord]:
    """The first record seen of each incarnation, each job's incarnations in the order
    they were submitted, as `sacct -D -j ID` lists them. The order seen is no order: a
    held incarnation comes only from the second query, after its successor."""
    found: dict[IncarnationKey, AccountingRecord] = {}
    for record in records:
        found.setdefault(incarnation_key(record), record)
    return sorted(found.values(), key=incarnation_order)


def incarnation_order(record: AccountingRecord) -> tuple[int, datetime]:
    """Sorts by job, then by submission (a record without a submit time first)."""
    return (record.job_id, record.submit_time or datetime.min.replace(tzinfo=UTC))
