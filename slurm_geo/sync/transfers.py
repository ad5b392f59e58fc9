"""An attempt's rows of checkpoint-sync's transfers table: one per object put, and one per
read from the destination (a read-back, a scrub's), which billing charges as egress.

Objects are put from the copy's threads: `put` queues a row in the thread that put the
object, and `write` moves the queue into the state database from the attempt's own
thread, whose connection it is.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from slurm_geo.ckpt.format.names import PACK_PREFIXES, manifest_name
from slurm_geo.sync.state import Replica, StateDB


class Route(Protocol):
    """Where the transfers go (slurm_geo.sync.worker.Route)."""

    @property
    def root(self) -> str: ...
    @property
    def root_region(self) -> str: ...
    @property
    def destination(self) -> str: ...
    @property
    def destination_region(self) -> str: ...


class TransferLog:
    def __init__(self, state: StateDB, route: Route, clock: Callable[[], float] = time.time):
        self._state = state
        self._route = route
        self._clock = clock
        self._unwritten: list[dict[str, Any]] = []  # transfers put, not yet in the state
        self._lock = threading.Lock()

    def put(self, name: str, size: int, started: float, finished: float) -> None:
        """Called in the thread that put the object: queued for `write`."""
        route = self._route
        kind = "packs" if name.startswith(PACK_PREFIXES) else name.split("/", 1)[0]
        row = {"object": name, "kind": kind, "bytes": size,
               "source": route.root, "destination": route.destination,
               "source_region": route.root_region,
               "destination_region": route.destination_region,
               "started_at": started, "finished_at": finished}
        with self._lock:
            self._unwritten.append(row)

    def write(self, replica: Replica) -> None:
        """The rows queued so far, into the state, as transfers of `replica`."""
        with self._lock:
            rows, self._unwritten = self._unwritten, []
        for row in rows:
            self._state.record_transfer(replica, row)

    def read(self, replica: Replica, size: int, started: float) -> None:
        """`size` bytes read from the destination for `replica` since `started`: traffic
        out of the destination's region."""
        route = self._route
        self._state.record_transfer(replica, {
            "object": manifest_name(replica.run, replica.step), "kind": "verify",
            "bytes": size, "source": route.destination,
            "destination": route.root, "source_region": route.destination_region,
            "destination_region": route.root_region,
            "started_at": started, "finished_at": self._clock()})
