"""The keys a repository holds (docs/format.md §4): the site master key, under which it
opens each run's key ring in its store and from which it derives the fence and promotion
keys (`MasterKeyHolder`, the daemons' and the operator's); or one run's ring alone, as a
job holds it (slurm_geo.ckpt.repo.runkey.RunKeyHolder), which opens nothing sealed under `M`."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Protocol

from slurm_geo.ckpt.errors import ObjectMissing
from slurm_geo.ckpt.format.keys import (
    KEY_SIZE,
    SALT_SIZE,
    MasterKeys,
    RandomBytes,
    RunKeyRing,
    fence_key,
    promotion_key,
)
from slurm_geo.ckpt.format.names import check_run_id, key_name
from slurm_geo.ckpt.format.seal import Kind, open_with_ring, seal
from slurm_geo.ckpt.stores.store import Store


class KeyHolder(Protocol):
    def ring(self, run: str, create: bool = False) -> RunKeyRing:
        """The run's key ring (§4.2); with `create`, a run without one gets a new key."""
        ...

    def put_ring(self, run: str, ring: RunKeyRing) -> None:
        """Write `keys/<run>` holding `ring`; read from it from now on."""
        ...

    def fence_keys(self) -> tuple[bytes, ...]:
        """`F`: the key that seals first, then the one a master key rotation replaces."""
        ...

    def promotion_keys(self) -> tuple[bytes, ...]:
        """`P`, as `fence_keys`."""
        ...


class SealedKeyRings:
    """Key rings sealed under the master key in `store`, one object each (`object_name`
    of an id: `keys/<run>`, `tree-keys/<domain>`), opened once and cached; an id without
    one gets a new key when asked with `create`."""

    def __init__(self, store: Store, master_keys: MasterKeys, object_name: Callable[[str], str],
                 random_bytes: RandomBytes = os.urandom):
        self._store = store
        self._master = master_keys
        self._object_name = object_name
        self._random_bytes = random_bytes
        self._rings: dict[str, RunKeyRing] = {}

    def ring(self, ring_id: str, create: bool = False) -> RunKeyRing:
        if ring_id not in self._rings:
            self._rings[ring_id] = self._load(ring_id, create)
        return self._rings[ring_id]

    def put_ring(self, ring_id: str, ring: RunKeyRing) -> None:
        name = self._object_name(ring_id)
        salt = self._random_bytes(SALT_SIZE)
        self._store.put(name, seal(self._master.keys()[0], Kind.DATA_KEY, salt,
                                   ring.to_payload(), name))
        self._rings[ring_id] = ring

    def _load(self, ring_id: str, create: bool) -> RunKeyRing:
        name = self._object_name(ring_id)
        try:
            sealed = self._store.get(name)
        except ObjectMissing:
            if not create:
                raise
            ring = RunKeyRing.of(self._random_bytes(KEY_SIZE))
            self.put_ring(ring_id, ring)
            return ring
        return RunKeyRing.from_payload(
            open_with_ring(self._master.keys(), Kind.DATA_KEY, sealed, name), name)


class MasterKeyHolder(SealedKeyRings):
    """Run key rings opened from `keys/<run>` in `store` under the master key, each once;
    the fence and promotion keys derived from it."""

    def __init__(self, store: Store, master_keys: MasterKeys,
                 random_bytes: RandomBytes = os.urandom):
        super().__init__(store, master_keys, _run_key_name, random_bytes)

    def fence_keys(self) -> tuple[bytes, ...]:
        return tuple(map(fence_key, self._master.keys()))

    def promotion_keys(self) -> tuple[bytes, ...]:
        return tuple(map(promotion_key, self._master.keys()))


def _run_key_name(run: str) -> str:
    return key_name(check_run_id(run))
