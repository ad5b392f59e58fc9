"""The keys a repository holds (docs/format.md §4): the site master key, under which it
opens each run's key ring in its store and from which it derives the fence and promotion
keys (`MasterKeyHolder`, the daemons' and the operator's); or one run's ring alone, as a
job holds it (slurm_geo.ckpt.runkey.RunKeyHolder), which opens nothing sealed under `M`."""

from __future__ import annotations

import os
from typing import Protocol

from slurm_geo.ckpt.errors import ObjectMissing
from slurm_geo.ckpt.keys import (
    KEY_SIZE,
    SALT_SIZE,
    MasterKeys,
    RandomBytes,
    RunKeyRing,
    fence_key,
    promotion_key,
)
from slurm_geo.ckpt.names import check_run_id, key_name
from slurm_geo.ckpt.seal import Kind, open_with_ring, seal
from slurm_geo.ckpt.store import Store


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


class MasterKeyHolder:
    """Run key rings opened from `keys/<run>` in `store` under the master key, each once."""

    def __init__(self, store: Store, master_keys: MasterKeys,
                 random_bytes: RandomBytes = os.urandom):
        self._store = store
        self._master = master_keys
        self._random_bytes = random_bytes
        self._rings: dict[str, RunKeyRing] = {}

    def ring(self, run: str, create: bool = False) -> RunKeyRing:
        if run not in self._rings:
            self._rings[run] = self._load(run, create)
        return self._rings[run]

    def put_ring(self, run: str, ring: RunKeyRing) -> None:
        name = key_name(check_run_id(run))
        salt = self._random_bytes(SALT_SIZE)
        self._store.put(name, seal(self._master.keys()[0], Kind.DATA_KEY, salt,
                                   ring.to_payload(), name))
        self._rings[run] = ring

    def fence_keys(self) -> tuple[bytes, ...]:
        return tuple(map(fence_key, self._master.keys()))

    def promotion_keys(self) -> tuple[bytes, ...]:
        return tuple(map(promotion_key, self._master.keys()))

    def _load(self, run: str, create: bool) -> RunKeyRing:
        name = key_name(check_run_id(run))
        try:
            sealed = self._store.get(name)
        except ObjectMissing:
            if not create:
                raise
            ring = RunKeyRing.of(self._random_bytes(KEY_SIZE))
            self.put_ring(run, ring)
            return ring
        return RunKeyRing.from_payload(
            open_with_ring(self._master.keys(), Kind.DATA_KEY, sealed, name), name)
