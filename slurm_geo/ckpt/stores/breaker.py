"""A store that, once it failed, answers at once for a while instead of waiting again.

The federation daemon decides every round and tries again the next, from one thread. A
store behind a cut link made each of its calls wait out every timeout: in the chaos
benchmark's partition-rented trials one listing of the unreachable off-site store held a
whole round for 25 s (five attempts, 5 s connect timeout each), and the job came home 36 s
after the cut against a target of 18. Behind a `BreakerStore`, the first failure costs
what the inner store's patience allows; for `open_for_s` after it every call fails at once
with `StoreSkipped`; then one call goes through again (and, if it fails, opens the breaker
anew). An answer is not a failure: `ObjectMissing` and the like pass through and close it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

from slurm_geo.ckpt.errors import CkptError, StoreUnavailable
from slurm_geo.ckpt.stores.digests import expected_digest, stored_digest
from slurm_geo.ckpt.stores.retry import is_permanent
from slurm_geo.ckpt.stores.store import Bytes, Store

T = TypeVar("T")

class StoreSkipped(StoreUnavailable):
    """Not tried: the store failed moments ago. Transient, as the failure it stands for."""

    def __init__(self, name: str, store: str, failed: StoreUnavailable, ago_s: float):
        self.failed = failed
        super().__init__(name, f"not tried: store '{store}' failed {ago_s:.1f} s ago: "
                               f"{failed}")


class BreakerStore:
    def __init__(self, inner: Store, store_name: str, open_for_s: float,
                 monotonic: Callable[[], float] = time.monotonic):
        self.inner = inner
        self.store_name = store_name
        self._open_for_s = open_for_s
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._failure: tuple[float, StoreUnavailable] | None = None

    def __repr__(self) -> str:
        return f"BreakerStore({self.inner!r}, {self.store_name!r})"

    def put(self, name: str, data: Bytes) -> None:
        self._call(name, lambda: self.inner.put(name, data))

    def get(self, name: str) -> bytes:
        return self._call(name, lambda: self.inner.get(name))

    def list(self, prefix: str) -> list[str]:
        return self._call(prefix, lambda: self.inner.list(prefix))

    def delete(self, name: str) -> None:
        self._call(name, lambda: self.inner.delete(name))

    def exists(self, name: str) -> bool:
        return self._call(name, lambda: self.inner.exists(name))

    def sizes(self, prefix: str) -> dict[str, int]:
        return self._call(prefix, lambda: self.inner.sizes(prefix))

    def digest(self, name: str) -> str | None:
        return self._call(name, lambda: stored_digest(self.inner, name))

    def digest_of(self, data: Bytes) -> str:
        return expected_digest(self.inner, data)

    def _call(self, name: str, operation: Callable[[], T]) -> T:
        skipped = self._skip_reason(name)
        if skipped is not None:
            raise skipped
        try:
            result = operation()
        except StoreUnavailable as exc:
            if not is_permanent(exc):  # a permanent failure is an admin's, not the link's
                with self._lock:
                    self._failure = (self._monotonic(), exc)
            raise
        except CkptError:
            self._close()  # the store answered (a missing object, a bad name)
            raise
        self._close()
        return result

    def _close(self) -> None:
        with self._lock:
            self._failure = None

    def _skip_reason(self, name: str) -> StoreSkipped | None:
        with self._lock:
            if self._failure is None:
                return None
            at, failed = self._failure
        ago = self._monotonic() - at
        return StoreSkipped(name, self.store_name, failed, ago) if ago < self._open_for_s \
            else None
