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

