"""An audit log filled as a test of the chain fills it, on either backend."""

from __future__ import annotations

from slurm_geo.federation.state.interface import Audit
from tests.kit.clock import ManualClock

T0 = 1_795_975_200.0  # 2026-11-29T18:00:00Z

Log = Audit


def audit_clock() -> ManualClock:
    """From T0, 1.5 s on at every read: each entry a moment after the last."""
    return ManualClock(T0, step=1.5)


def fill(log: Log, n: int = 6) -> Log:
    """`n` decisions appended, alternating between onprem:1 and onprem:0."""
    for i in range(1, n + 1):
        log.append("decision", f"onprem:{i % 2}", f"move to rented #{i}", "onprem is down",
                   checkpoint={"run": "llm", "step": 100 * i}, clusters=["onprem", "rented"],
                   bytes=i * 10**9)
    return log
