"""Pacing transfers: a token bucket shared by every store a process sends through, so a
bandwidth cap (checkpoint-sync's [sync] bandwidth_mb_s) holds for all of its copies:
checkpoint-sync's replications and the federation daemon's moves and probes alike."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from slurm_geo.ckpt.errors import StoreUnavailable
from slurm_geo.ckpt.stores.digests import expected_digest, stored_digest
from slurm_geo.ckpt.stores.store import Bytes, Store

T = TypeVar("T")


class TokenBucket:
    """At most `rate` bytes a second on average (0: no cap), with one second of burst.

    Each object is paid for before it moves; a payment beyond the tokens available waits
    until the debt is repaid, so the average holds over any stretch of objects. Threads
    paying at once (a copy's packs in parallel) queue up: each one's payment is counted
    under the lock, and it waits outside it until the debts before its own are repaid.
    """

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic):
        self.rate = rate
        self._clock = clock
        self._tokens = rate
        self._last = clock()
        self._lock = threading.Lock()

    def set_rate(self, rate: float) -> None:
        with self._lock:
            self.rate, self._tokens = rate, min(self._tokens, rate)

    def take(self, size: int, sleep: Callable[[float], None]) -> None:
        with self._lock:
            if self.rate <= 0:
                return
            now = self._clock()
            self._tokens = min(self.rate, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= size
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            sleep(wait)


Moved = Callable[[str, int, float, float], None]  # name, bytes, started, finished


class Guard(Protocol):
    """Whether the caller's transfer may go on (raises if not), and its interruptible sleep."""

    def check(self) -> None: ...

    def sleep(self, seconds: float) -> None: ...


class Unguarded:
    """A transfer nobody interrupts: only the bucket's waits."""

    def check(self) -> None:
        return None

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class PacedStore:
    """`inner` with a bandwidth cap, a stop/timeout check before every operation, and a
    callback for each object put (for checkpoint-sync's transfers table). A
    StoreUnavailable passing through is tagged with `side` (e.g. "root" or "destination"):
    which store is out. Built by slurm_geo.ckpt.stores.open_store.paced.

    Several threads may use it at once (a copy's packs go in parallel): the bucket and the
    byte count are locked, and `on_put` is called in the thread that put the object."""

    def __init__(self, inner: Store, guard: Guard, side: str, bucket: TokenBucket | None = None,
                 on_put: Moved | None = None, clock: Callable[[], float] = time.time):
        self.inner = inner
        self.side = side
        self.bytes_read = 0
        self._counting = threading.Lock()
        self._guard = guard
        self._bucket = bucket
        self._on_put = on_put
        self._clock = clock

    def put(self, name: str, data: Bytes) -> None:
        size = len(memoryview(data).cast("B"))
        self._guard.check()
        if self._bucket is not None:
            self._bucket.take(size, self._guard.sleep)
        started = self._clock()
        self._call(lambda: self.inner.put(name, data))
        if self._on_put is not None:
            self._on_put(name, size, started, self._clock())

    def get(self, name: str) -> bytes:
        data = self._call(lambda: self.inner.get(name))
        with self._counting:
            self.bytes_read += len(data)
        if self._bucket is not None:
            self._bucket.take(len(data), self._guard.sleep)
        return data

    def list(self, prefix: str) -> list[str]:
        return self._call(lambda: self.inner.list(prefix))

    def delete(self, name: str) -> None:
        self._call(lambda: self.inner.delete(name))

    def exists(self, name: str) -> bool:
        return self._call(lambda: self.inner.exists(name))

    def sizes(self, prefix: str) -> dict[str, int]:
        return self._call(lambda: self.inner.sizes(prefix))

    def digest(self, name: str) -> str | None:
        return self._call(lambda: stored_digest(self.inner, name))

    def digest_of(self, data: Bytes) -> str:
        return expected_digest(self.inner, data)

    def _call(self, operation: Callable[[], T]) -> T:
        self._guard.check()
        try:
            return operation()
        except StoreUnavailable as exc:
            exc.side = self.side
            raise
