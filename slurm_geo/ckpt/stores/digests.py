"""Verified as written: a copy checks what the destination holds without reading it back.

A store that keeps a digest of each object (S3's x-amz-checksum-sha256, checked by the
server before it commits a put; a local file hashed where it lies) says it through
`digest(name)`, and `digest_of(data)` says what it would say of `data`. `CheckedWrites`
wraps a destination: after each put it asks the destination for the object's digest and
compares it with the digest of the bytes the writer handed over, so a byte changed
anywhere between the two (a wrapper, the network, the server) fails the put with
`CorruptObject` and is never counted as written. The digest travels, not the object.

Stores without digests (an S3 service that keeps no checksums, a wrapper that does not pass
them on) answer None: what was put there is then read back and compared, that object only,
and named in `CheckedWrites.read_back` (docs/checkpoint-sync.md, "What verified proves").
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

from slurm_geo.ckpt.errors import CkptError, CorruptObject
from slurm_geo.ckpt.stores.store import Bytes, Store
from slurm_geo.ckpt.stores.sums import sha256_b64


def stored_digest(store: Store, name: str) -> str | None:
    """The digest `store` keeps of object `name`; None when it keeps none (ObjectMissing
    when there is no such object)."""
    digest = getattr(store, "digest", None)
    return None if digest is None else digest(name)


def expected_digest(store: Store, data: Bytes) -> str:
    """What `stored_digest(store, name)` says of an object holding `data`."""
    digest_of = getattr(store, "digest_of", None)
    return sha256_b64(data) if digest_of is None else digest_of(data)


class CheckedWrites:
    """`inner`, each put checked against the digest the destination then reports (or, where
    it keeps none, against the object read back).

    Thread-safe: a copy puts several packs at once. `written` maps each object put (and
    checked) to its size and its digest as the destination reports it (as `digest_of`
    computes it where the destination keeps none); `read_back` names the objects checked
    by reading them back, and `bytes_read_back` counts their bytes."""

    def __init__(self, inner: Store):
        self.inner = inner
        self.written: dict[str, tuple[int, str]] = {}
        self.read_back: set[str] = set()
        self.bytes_read_back = 0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"CheckedWrites({self.inner!r})"

    def put(self, name: str, data: Bytes) -> None:
        view = memoryview(data).cast("B")
        expected = expected_digest(self.inner, view)
        self.inner.put(name, view)
        found = stored_digest(self.inner, name)
        if found is None:
            self.check_by_reading(name, lambda held: sha256_b64(held) == sha256_b64(view))
        elif found != expected:
            self._drop(name)
            raise CorruptObject(name, f"the destination reports digest {found} for what was "
                                f"sent with digest {expected}: it held other bytes (deleted); "
                                "the copy puts it again")
        with self._lock:
            self.written[name] = (len(view), expected)

    def check_by_reading(self, name: str, sound: Callable[[bytes], bool]) -> None:
        """Read `name` back from the destination and raise CorruptObject unless `sound`."""
        held = self.inner.get(name)
        with self._lock:
            self.read_back.add(name)
            self.bytes_read_back += len(held)
        if not sound(held):
            self._drop(name)
            raise CorruptObject(name, "read back from the destination, it held other bytes "
                                "than were sent (deleted); the copy puts it again")

    def _drop(self, name: str) -> None:
        """A damaged object is never left for a reader to find (best effort)."""
        with contextlib.suppress(CkptError):
            self.inner.delete(name)

    def get(self, name: str) -> bytes:
        return self.inner.get(name)

    def list(self, prefix: str) -> list[str]:
        return self.inner.list(prefix)

    def delete(self, name: str) -> None:
        self.inner.delete(name)

    def exists(self, name: str) -> bool:
        return self.inner.exists(name)

    def sizes(self, prefix: str) -> dict[str, int]:
        return self.inner.sizes(prefix)

    def digest(self, name: str) -> str | None:
        return stored_digest(self.inner, name)

    def digest_of(self, data: Bytes) -> str:
        return expected_digest(self.inner, data)
