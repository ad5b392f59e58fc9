"""`slurm-geo sync retry --wait`: following requeued replicas until checkpoint-sync is done
with them.

The daemon does the copying; this only reads its state: each replica's status and the
bytes its transfers put since the requeue (verification reads left out). How much is left
is not known up front: a replica requeued after a failure or a repair sends only what the
destination lacks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from slurm_geo.sync.state import StateDB, Status

POLL_S = 0.5  # the daemon records a transfer per pack: a few a second at most


def settled(statuses: Iterable[Status]) -> bool:
    """Every replica is where the daemon moves it no further by itself."""
    return all(status.is_terminal() for status in statuses)


def succeeded(status: Status) -> bool:
    """Verified, or no longer wanted off-site (retention skipped it): nothing to retry."""
    return status in (Status.VERIFIED, Status.SKIPPED)


@dataclass(frozen=True)
class Followed:
    statuses: dict[int, Status]  # replica id -> where it ended
    bytes: int                   # put by its transfers since the requeue

    @property
    def ok(self) -> bool:
        return all(map(succeeded, self.statuses.values()))


def follow(state: StateDB, replica_ids: Sequence[int],
           on_bytes: Callable[[int], None] = lambda _n: None,
           sleep: Callable[[float], None] = time.sleep, poll_s: float = POLL_S) -> Followed:
    """Poll `state` until every replica is settled; `on_bytes(done)` after each look."""
    before = {i: state.transferred_bytes(i) for i in replica_ids}
    while True:
        statuses = {i: state.replica(i).status for i in replica_ids}
        moved = sum(state.transferred_bytes(i) - before[i] for i in replica_ids)
        on_bytes(moved)
        if settled(statuses.values()):
            return Followed(statuses, moved)
        sleep(poll_s)
