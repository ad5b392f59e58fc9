"""Refused requests in the audit log, at a rate no caller can push up.

The lease and key service answers anyone who reaches its port, before anything proves who
they are; an entry per refusal would let a loop of bad requests grow the audit log (and
the daemon's memory) without bound. So a refusal (400, 401, 403, 404, 409, 429) is audited at
most once per source address per interval; the refusals left out are counted in the next
entry for that source, and nothing else of them is kept.

Memory is bounded too: at most MAX_SOURCES addresses are remembered, least recently
audited first out (one not audited for a whole interval holds no debt worth keeping).
When every remembered address was audited within the interval, the addresses beyond them
share one budget, so a crowd of sources still writes one entry per interval.

What an entry says comes from the request and is clipped: at most FIELD_CHARS printable
characters per text, control characters replaced, so a request cannot write megabytes or
terminal escapes into what an operator reads with `slurm-geo audit`.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_SOURCES = 4096
FIELD_CHARS = 200
SOURCE_CHARS = 64
REFUSED = "refused"  # the audit kind of a refusal that names no fence


def clip(text: str, limit: int = FIELD_CHARS) -> str:
    """`text` as an audit field: printable characters only, at most `limit` of them."""
    printable = "".join(c if c.isprintable() else "?" for c in text[:limit + 1])
    return printable if len(printable) <= limit else printable[:limit - 1] + "~"


@dataclass(frozen=True)
class Refusal:
    """What the audit entry of one refused request says."""

    kind: str                 # "fence" for a stale incarnation's lease, else "refused"
    logical_job: str | None   # the logical job the request named, when it named a real one
    what: str
    why: str


@dataclass
class _Budget:
    audited_at: float
    left_out: int = 0


class RefusalAudit:
    """Audits refusals through `append` (AuditLog.append's signature), at most one entry per
    source address per `interval_s` of `clock`. Safe to call from many threads; the
    entry is written outside the lock."""

    def __init__(self, append: Callable[..., Any], clock: Callable[[], float],
                 interval_s: float = 60.0, max_sources: int = MAX_SOURCES):
        self._append = append
        self._clock = clock
        self.interval_s = interval_s
        self._max_sources = max_sources
        self._budgets: OrderedDict[str, _Budget] = OrderedDict()
        self._crowd: _Budget | None = None  # the shared budget of sources beyond the map
        self._lock = threading.Lock()

    def refused(self, source: str, status: int, path: str, refusal: Refusal) -> bool:
        """Audit `refusal` of a request from `source` unless that source was audited within
        the interval; True when an entry was written."""
        source = clip(source, SOURCE_CHARS)
        with self._lock:
            left_out = self._spend(source, self._clock())
        if left_out is None:
            return False
        self._append(refusal.kind, refusal.logical_job, clip(refusal.what), clip(refusal.why),
                     source=source, status=status, path=clip(path, 100), left_out=left_out)
        return True

    @property
    def sources(self) -> int:
        """How many source addresses are remembered now."""
        return len(self._budgets)

    def _spend(self, source: str, now: float) -> int | None:
        """The refusals left out since `source`'s last entry, when it may have one now;
        None (and one more left out) when it may not."""
        budget = self._budgets.get(source) or self._budget_for_new(source, now)
        if now - budget.audited_at < self.interval_s:
            budget.left_out += 1
            return None
        left_out, budget.audited_at, budget.left_out = budget.left_out, now, 0
        if source in self._budgets:
            self._budgets.move_to_end(source)  # least recently audited first
        return left_out

    def _budget_for_new(self, source: str, now: float) -> _Budget:
        """A fresh budget for `source`, made room for by forgetting the source audited
        least recently if that was a whole interval ago; else the crowd's shared one."""
        if len(self._budgets) >= self._max_sources:
            oldest, budget = next(iter(self._budgets.items()))
            if now - budget.audited_at < self.interval_s:
                if self._crowd is None:
                    self._crowd = _Budget(-math.inf)
                return self._crowd
            del self._budgets[oldest]
        budget = self._budgets[source] = _Budget(-math.inf)
        return budget
