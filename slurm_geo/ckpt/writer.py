"""Saving chunks: deduplicate by keyed id, encode (maybe as a delta), fill and store packs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from slurm_geo.ckpt.chunking import DEFAULT_CHUNK_SIZE, CdcParams
from slurm_geo.ckpt.codec import DEFAULT_LEVEL, encode, encode_delta
from slurm_geo.ckpt.keys import SALT_SIZE, RandomBytes, RunKeys, chunk_id
from slurm_geo.ckpt.manifest import (
    CHUNK_SIZE_MULTIPLE,
    MAX_CHUNK_SIZE,
    MAX_DELTA_DEPTH,
    ChunkRef,
)
from slurm_geo.ckpt.names import pack_name
from slurm_geo.ckpt.pack import Entry, PackWriter
from slurm_geo.ckpt.store import Store


@dataclass(frozen=True)
class WriteOptions:
    chunk_size: int = DEFAULT_CHUNK_SIZE
    pack_size: int = 16 * 1024 * 1024  # close a pack once it holds this much
    zstd_level: int = DEFAULT_LEVEL
    max_delta_depth: int = 4  # bounds how many chunks one read of a delta chunk needs
    cdc: CdcParams = CdcParams()

    def __post_init__(self) -> None:
        if self.chunk_size % CHUNK_SIZE_MULTIPLE or not 0 < self.chunk_size <= MAX_CHUNK_SIZE:
            raise ValueError(f"chunk_size must be a multiple of {CHUNK_SIZE_MULTIPLE} to 64 MiB")
        if not 0 <= self.max_delta_depth <= MAX_DELTA_DEPTH:
            raise ValueError(f"max_delta_depth must be 0 to {MAX_DELTA_DEPTH}")


DEFAULT_OPTIONS = WriteOptions()


@dataclass(frozen=True)
class _Pending:
    entry: Entry
    size: int
    base: ChunkRef | None


class ChunkWriter:
    """Writes the new chunks of one checkpoint; `ref(id)` locates any chunk it was given.

    `known` holds refs already stored (the parent's), so those chunks are not stored again.
    `read_base` returns the plaintext of a stored chunk, for delta encoding.
    """

    def __init__(
        self, store: Store, keys: RunKeys, options: WriteOptions, random_bytes: RandomBytes,
        known: dict[str, ChunkRef], read_base: Callable[[ChunkRef], bytes],
    ):
        self._store = store
        self._keys = keys
        self._options = options
        self._random_bytes = random_bytes
        self._refs = dict(known)
        self._read_base = read_base
        self._pack: PackWriter | None = None
        self._pending: dict[str, _Pending] = {}

    def add(self, data: memoryview, element_size: int, base: ChunkRef | None = None) -> str:
        """Store `data` unless already stored; return its chunk id (hex)."""
        cid = chunk_id(self._keys.id_key, data).hex()
        if cid in self._refs or cid in self._pending:
            return cid
        blob = encode(data, element_size=element_size, level=self._options.zstd_level)
        used_base = None
        if base is not None and self._may_delta_against(base, len(data)):
            delta = encode_delta(data, self._read_base(base), bytes.fromhex(base.id),
                                 element_size=element_size, level=self._options.zstd_level)
            if len(delta) < len(blob):
                blob, used_base = delta, base
        if self._pack is None:
            self._pack = PackWriter(self._keys.data_key, self._random_bytes(SALT_SIZE))
        entry = self._pack.add(bytes.fromhex(cid), blob)
        self._pending[cid] = _Pending(entry, len(data), used_base)
        if self._pack.size >= self._options.pack_size:
            self.flush()
        return cid

    def _may_delta_against(self, base: ChunkRef, size: int) -> bool:
        return base.size == size and base.depth < self._options.max_delta_depth

    def flush(self) -> None:
        """Store the open pack; its chunks then have refs."""
        if self._pack is None:
            return
        pack_id, data = self._pack.finish()
        self._store.put(pack_name(pack_id), data)
        for cid, pending in self._pending.items():
            entry = pending.entry
            self._refs[cid] = ChunkRef(cid, pack_id, entry.offset, entry.length, pending.size,
                                       pending.base)
        self._pack, self._pending = None, {}

    def ref(self, cid: str) -> ChunkRef:
        return self._refs[cid]
