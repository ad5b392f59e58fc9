"""Retrying a store's transient failures, as a wrapper around any store.

Only `StoreUnavailable` is retried, and not when it is marked `permanent` (bad credentials,
a missing bucket: an admin must act). `ObjectMissing` and `UnsafeObjectName` are answers,
not failures, and pass straight through. A put() receives its whole object as bytes in
memory, not a stream, so every attempt re-sends it from its first byte: there is nothing
to rewind. (Callers must not change a bytearray while put() runs, as with any store.)
"""

from __future__ import annotations

import logging
import random as _random
import time
from collections.abc import Callable
from typing import TypeVar

from slurm_geo.ckpt.errors import StoreUnavailable
from slurm_geo.ckpt.stores.digests import expected_digest, stored_digest
from slurm_geo.ckpt.stores.store import Bytes, Store

T = TypeVar("T")

log = logging.getLogger(__name__)


def is_permanent(exc: StoreUnavailable) -> bool:
    """Whether retrying cannot help; stores raise such failures with `permanent=True`."""
    return exc.permanent


class RetryingStore:
    """`inner` with each operation tried up to `attempts` times.

    Waits between attempts grow exponentially with "full jitter": before retry k (from 0)
    it sleeps random() * min(max_delay_s, base_delay_s * 2**k), so that many jobs that lost
    the store together do not come back in lockstep.
    """

    def __init__(self, inner: Store, attempts: int = 5, base_delay_s: float = 0.2,
                 max_delay_s: float = 10.0, sleep: Callable[[float], None] = time.sleep,
                 random: Callable[[], float] = _random.random):
        if attempts < 1:
            raise ValueError(f"attempts must be at least 1, not {attempts}")
        self.inner = inner
        self._attempts = attempts
        self._base_delay_s = base_delay_s
        self._max_delay_s = max_delay_s
        self._sleep = sleep
        self._random = random

    def __repr__(self) -> str:
        return f"RetryingStore({self.inner!r}, attempts={self._attempts})"

    def put(self, name: str, data: Bytes) -> None:
        self._retry(lambda: self.inner.put(name, data))

    def get(self, name: str) -> bytes:
        return self._retry(lambda: self.inner.get(name))

    def list(self, prefix: str) -> list[str]:
        return self._retry(lambda: self.inner.list(prefix))

    def delete(self, name: str) -> None:
        self._retry(lambda: self.inner.delete(name))

    def exists(self, name: str) -> bool:
        return self._retry(lambda: self.inner.exists(name))

    def sizes(self, prefix: str) -> dict[str, int]:
        return self._retry(lambda: self.inner.sizes(prefix))

    def digest(self, name: str) -> str | None:
        return self._retry(lambda: stored_digest(self.inner, name))

    def digest_of(self, data: Bytes) -> str:
        return expected_digest(self.inner, data)

    def _retry(self, operation: Callable[[], T]) -> T:
        for attempt in range(self._attempts - 1):
            try:
                return operation()
            except StoreUnavailable as exc:
                if is_permanent(exc):
                    raise
                delay = self._random() * min(self._max_delay_s, self._base_delay_s * 2**attempt)
                log.warning("%s; attempt %d of %d failed, retrying in %.2f s",
                            exc, attempt + 1, self._attempts, delay)
                self._sleep(delay)
        return operation()  # the last attempt: its failure is the caller's
