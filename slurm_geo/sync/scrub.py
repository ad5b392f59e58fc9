"""Scrubbing the destination: when to re-read a verified replica, and which one.

Bit rot in a replica nobody resumes from would otherwise stay unseen until the day it is
needed. When no replication is due, checkpoint-sync re-reads one verified replica at a
time (every chunk, as verification does), paced to `[sync] scrub_gb_per_day` on average:
after a scrub that read B bytes the next waits B / rate. The replica re-read longest ago
(or never, since its verification) goes first, so every one is re-read once per pass,
and none more often than `scrub_interval_s`.
Pure functions; the daemon (slurm_geo.sync.daemon) and the attempt (slurm_geo.sync.worker)
act on them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from slurm_geo.sync.state import Replica, Status

DAY_S = 86_400.0


@dataclass(frozen=True)
class LastScrub:
    """The scrub that ran last: when it started and the bytes it read."""

    started_at: float
    bytes_read: int


def scrub_due_at(rate_bytes_per_day: float, last: LastScrub | None) -> float | None:
    """When the next scrub may start (Unix seconds; 0: at once); None when scrubbing is
    off (rate 0)."""
    if rate_bytes_per_day <= 0:
        return None
    if last is None:
        return 0.0
    return last.started_at + last.bytes_read / rate_bytes_per_day * DAY_S


def last_checked(replica: Replica) -> float:
    """When the replica's bytes were last read whole: its verification or its last scrub."""
    return max(replica.scrubbed_at or 0.0, replica.verified_at or 0.0)


def pick_scrub(replicas: Iterable[Replica], now: float, interval_s: float) -> Replica | None:
    """The verified replica read longest ago (ties: the oldest row), if that was at least
    `interval_s` before `now`; None when there is no such replica."""
    due = [r for r in replicas
           if r.status is Status.VERIFIED and last_checked(r) + interval_s <= now]
    return min(due, key=lambda r: (last_checked(r), r.id), default=None)



# --- scrub_at = "destination": the report of `slurm-geo sync scrub-here` ------------------

# A report that says nothing new about the replica picked is looked at again at most this
# much later (scrub-here runs once a day or so: see docs/checkpoint-sync.md, "Scrubbing").
REPORT_RECHECK_S = 3600.0
REPORT_MARK = "scrub_report_at"  # meta, per destination: when its newest report finished
NO_REPORT = "none"  # ... or that the last turn found none there (its age: infinite)


def report_recheck_s(interval_s: float, retry_base_s: float) -> float:
    """How long the scrub waits after a report that is no news before it looks again: no
    longer than a replica waits between scrubs (`scrub_interval_s`) nor than an hour, no
    shorter than a failed scrub waits (`retry_base_s`)."""
    return max(retry_base_s, min(REPORT_RECHECK_S, interval_s))


@dataclass(frozen=True)
class Findings:
    """What a scrub turn concludes from a destination's report and its own cheap checks:
    damaged packs (name, why), packs missing there, and, when the report is no news for
    this replica, why (`stale`; None when it counts as a check of the replica's packs)."""

    damaged: tuple[tuple[str, str], ...] = ()
    missing: tuple[str, ...] = ()
    stale: str | None = None

    @property
    def sound(self) -> bool:
        return not self.damaged and not self.missing


def judge_report(report_started_at: float | None, report_damaged: Iterable[str],
                 last_check: float, needed: dict[str, int], listed: dict[str, int]) -> Findings:
    """The findings for a replica whose packs `needed` (name -> bytes its entries reach)
    the destination lists with sizes `listed`, given a report that started scanning at
    `report_started_at` (None: no report) and named `report_damaged`. A report counts only
    when it started after the replica was last checked (`last_check`: verified or
    scrubbed): its listing then held every pack of the replica. What is missing or short
    counts whatever the report's age: it is the listing of now."""
    missing = tuple(sorted(n for n in needed if n not in listed))
    damaged = [(n, f"truncated: {listed[n]} bytes, its entries reach byte {needed[n]}")
               for n in sorted(needed) if n in listed and listed[n] < needed[n]]
    if report_started_at is None:
        return Findings(tuple(damaged), missing, "the destination has no scrub report")
    if report_started_at <= last_check:
        return Findings(tuple(damaged), missing,
                        "the scrub report is older than the replica's last check")
    short = {n for n, _ in damaged}
    damaged += [(n, "scrub-here at the destination: its bytes do not match its name")
                for n in sorted(set(report_damaged) & set(needed)) if n not in short]
    return Findings(tuple(damaged), missing, None)
