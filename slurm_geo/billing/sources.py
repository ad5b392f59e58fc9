"""What became of each source billing reads in one `billing ingest` or `billing check`,
and the exit code that follows. Pure.

A source is one thing billing reads, with its own watermark where it has one:

    registry            the controller's job registry: lineage, who owns a checkpoint run
    accounting:CLUSTER  one cluster's accounting (sacct, or slurmrestd's /slurmdb/)
    egress              checkpoint-sync's transfers and the federation daemon's copies (its
                        audit log); `billing check` compares them as egress:checkpoint-sync
                        and egress:federation

Each ends a run in one Outcome:

    READ     read completely; its watermark moved (ingest) or it was compared (check)
    FAILED   not read completely; its watermark stayed where it was, so the next run reads
             the same window again
    SKIPPED  not attempted: it needs a source that failed (accounting and egress need the
             registry's lineage), or it is not configured

The exit code, as borg gives one: when every failed source fails with the same code, that
code (42 the registry, 40 checkpoint-sync's state, 55 the audit log, 52 a cluster's
accounting); when they differ, 52.

Coverage: besides its watermark (where the next ingest starts, held back by jobs still
running), each source read completely records how far billing may be trusted to hold
everything (`covered_key`) and how far it read (`ingested_key`). `billing check` compares
up to the first, no further: what happened after it may not be in the source's own records
yet either; the rest, up to the second, it names as not compared yet (and `--strict` fails
on it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from slurm_geo.billing.errors import SourceUnreadable
from slurm_geo.billing.periods import iso

# The registry and the federation daemon's state and audit log: whose job, whose run.
OWNERSHIP = "ownership"
EGRESS = "egress"
# slurmdbd records a job's start and end a moment after slurmctld (minutes when it is
# loaded or was down): a job that ended in the last seconds before an ingest may still read
# as running there. Checks stop this long before the ingest that ran "until now".
ACCOUNTING_SETTLE_S = 300
# checkpoint-sync records a transfer when its object is in, which may be long after the
# transfer began; ingest reads egress again from an hour before its watermark for that.
EGRESS_SETTLE_S = 3600
# A finished transfer's row (checkpoint-sync's, or the daemon's audit entry) is written as
# its finish is recorded: checks compare egress up to a minute before an ingest that ran
# until now, the window that ingest billed (an hour's margin had left every transfer of the
# last hour billed and never compared: "0 transfers" against 1.78 GB; issue 29).
EGRESS_RECORD_S = 60


class Outcome(Enum):
    READ = "read"
    FAILED = "failed"
    SKIPPED = "skipped"


@dataclass(frozen=True)
class SourceRun:
    """One source in one run: what was read, or why not (the error names the fix)."""

    source: str
    outcome: Outcome
    detail: str
    code: int = 0                 # the exit code a failure of this source alone gives
    since: int | None = None      # the window read, or that would have been
    until: int | None = None
    watermark: int | None = None  # where the next ingest of it starts

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.source, "outcome": self.outcome.value, "detail": self.detail,
                "exit_code": self.code, "since": _iso(self.since), "until": _iso(self.until),
                "watermark": _iso(self.watermark)}


def failed(source: str, error: Exception, since: int | None = None,
           until: int | None = None, watermark: int | None = None) -> SourceRun:
    """A source that could not be read: a cluster's accounting exits 52 whatever the Slurm
    layer's reason (TokenRejected, ControllerUnreachable, ...); a database its own code."""
    code = SourceUnreadable.exit_code if source.startswith("accounting:") else \
        getattr(error, "exit_code", SourceUnreadable.exit_code)
    return SourceRun(source, Outcome.FAILED, str(error), code, since, until, watermark)


def exit_code(runs: Iterable[SourceRun]) -> int:
    """0 when nothing failed; the one code all failures share; else 52."""
    codes = {run.code for run in runs if run.outcome is Outcome.FAILED}
    if not codes:
        return 0
    return codes.pop() if len(codes) == 1 else SourceUnreadable.exit_code


def covered_key(source: str) -> str:
    """The watermarks-table key of how far `source` was read completely (see above)."""
    return f"covered:{source}"


def ingested_key(source: str) -> str:
    """The watermarks-table key of the end of the latest window ingest read of `source`
    (what billing holds, compared or not yet)."""
    return f"ingested:{source}"


def covered_until(until: int | None, now: int, settle_s: int) -> int:
    """How far a window read completely just now can be trusted: an --until the admin gave
    is taken at its word (up to now: nothing later has happened yet); a window that ran
    until now, less what the source may still be recording."""
    return min(until, now) if until is not None else now - settle_s


def _iso(seconds: int | None) -> str | None:
    return None if seconds is None else iso(seconds)
