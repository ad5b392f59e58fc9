"""Saving chunks: deduplicate by keyed id, encode (maybe as a delta), fill and store packs.

The pipeline, per chunk: keyed hash, byte planes, zstd (worker threads, in parallel:
blake3, numpy and zstandard release the GIL), then, in submission order, AES-GCM into the
open pack (the caller's thread: an entry's nonce is its offset, known only in order), then
the pack's hash and its upload (two uploader threads). Entries, packs and random salts
follow the order of submission, so the bytes written depend neither on the number of
workers nor on timing (`workers=1` runs everything in the caller's thread). Memory stays
bounded: `WriteOptions.window` chunks in flight, the open pack, and at most
`UPLOAD_WINDOW` finished packs waiting for the store; pack buffers are reused.
"""

from __future__ import annotations

import mmap
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from types import TracebackType

from slurm_geo.ckpt.format.chunking import DEFAULT_CHUNK_SIZE, CdcParams
from slurm_geo.ckpt.format.codec import (
    DEFAULT_LEVEL,
    Buffer,
    Compressors,
    Method,
    changed_fraction,
    encode_parts,
    encode_patch_parts,
    encode_xored_parts,
    xor_bytes,
)
from slurm_geo.ckpt.format.keys import SALT_SIZE, RandomBytes, RunKeys, chunk_id
from slurm_geo.ckpt.format.manifest import (
    CHUNK_SIZE_MULTIPLE,
    FORMAT_VERSION,
    MAX_CHUNK_SIZE,
    MAX_DELTA_DEPTH,
    WRITABLE_FORMATS,
    ChunkRef,
    packs_run,
)
from slurm_geo.ckpt.format.names import pack_name
from slurm_geo.ckpt.format.pack import (
    BLAKE3_VERSION,
    PATCH_VERSION,
    VERSION,
    Entry,
    PackWriter,
    pack_buffer,
    pack_id_of,
)
from slurm_geo.ckpt.repo.reader import default_workers, worker_pool
from slurm_geo.ckpt.stores.store import Bytes, Store

UPLOAD_WINDOW = 2  # finished packs waiting for the store, at most
# A delta under this fraction of its chunk is taken without also encoding the chunk on its
# own, which would cost as much again: float encodings (byte planes) of model weights and
# optimizer moments come to 0.65-0.8 of the chunk, so they beat no delta this small.
OWN_UNTRIED_BELOW = 0.6
# Up to this fraction of changed elements, a zstd patch is smaller than an xor delta (the
# unchanged runs between changes are long); past it the xor delta is. Measured on 4 MiB
# chunks of gaussian weights with values nudged by 1 %: for fp32 the patch is 0.52x the xor
# delta at 1 % changed, 1.08x at 50 %, 1.39x at 100 %; for bf16 (whose xor planes are half
# as many) 0.78x at 1 %, 1.0x at 10 %, 2.4x at 100 %.
PATCH_CHANGED_AT_MOST = {4: 0.4}
PATCH_CHANGED_AT_MOST_ELSE = 0.1
# Whether deltas pay in a checkpoint is decided on its first delta attempts, DELTA_PROBES
# chunks' worth: past them, deltas are tried only if those came to at most DELTA_PAYS_BELOW
# of the chunks' own encodings, in bytes. A delta costs the base's read and often a second
# encoding: on a dense fp32 + AdamW step (every value moved, lr 1e-3) that is 45 % more
# push time for deltas of the weights 0.90x their own encodings and of the moments 1.03x,
# while a bf16 step with 1 % of values changed stores its deltas in under 0.1x. The
# decision is taken DELTA_LAG chunks after the last probe was added, a fixed distance, so
# the bytes written still do not depend on the number of workers. Every chunk added before
# the decision is tried as a delta: DELTA_PROBES + DELTA_LAG of them. At 4 + 8, those 12
# attempts cost a dense 300 MB step 0.25 s of CPU (a third of its push, on two cores); at
# 2 + 4 half that, with the same answer on the dense, LoRA and bf16 series of
# bench/ckpt_series.py and both of bench/cli_vs_restic.py (dense steps store 0.7 % more:
# fewer of their chunks are tried, and a few of those came out smaller as deltas).
# The lag is the window of two workers' chunks in flight: with more workers, probing
# waits a little for the probes instead.
DELTA_PROBES = 2
DELTA_PAYS_BELOW = 0.8
DELTA_LAG = 4


def delta_kind(changed: float, element_size: int) -> Method:
    """The delta method for a chunk of which the fraction `changed` of elements changed."""
    limit = PATCH_CHANGED_AT_MOST.get(element_size, PATCH_CHANGED_AT_MOST_ELSE)
    return Method.ZSTD_PATCH if changed <= limit else Method.XOR_DELTA


@dataclass(frozen=True)
class WriteOptions:
    chunk_size: int = DEFAULT_CHUNK_SIZE
    pack_size: int = 16 * 1024 * 1024  # close a pack once it holds this much
    zstd_level: int = DEFAULT_LEVEL
    # Bounds how many chunks one read of a delta chunk needs. Past it, a delta is taken on
    # the root of the chain (holding the changes since the root). Over 10 saves that each
    # change as much, limits 1, 2, 3, 4 store 45, 29, 18, 21 saves' worth of changes in
    # deltas: 3 stores least and keeps reads short.
    max_delta_depth: int = 3
    cdc: CdcParams = CdcParams()
    workers: int = 0  # threads hashing and encoding chunks; 0: one per core, at most 4
    # The manifest format written (docs/format.md): the current one, or an older one a
    # test writes to check it still reads. Format 1 writes what its writers did: version 1
    # packs, so xor deltas only and no sparse planes.
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.chunk_size % CHUNK_SIZE_MULTIPLE or not 0 < self.chunk_size <= MAX_CHUNK_SIZE:
            raise ValueError(f"chunk_size must be a multiple of {CHUNK_SIZE_MULTIPLE} to 64 MiB")
        if not 0 <= self.max_delta_depth <= MAX_DELTA_DEPTH:
            raise ValueError(f"max_delta_depth must be 0 to {MAX_DELTA_DEPTH}")
        if self.workers < 0:
            raise ValueError("workers must be 0 (automatic) or more")
        if self.format_version not in WRITABLE_FORMATS:
            raise ValueError(f"format_version must be one of {WRITABLE_FORMATS}")

    @property
    def threads(self) -> int:
        return self.workers or default_workers()

    @property
    def pack_version(self) -> int:
        """The version of the packs this format's writers write."""
        return 1 if self.format_version == 1 else VERSION

    @property
    def window(self) -> int:
        """Chunks in flight at most: enough to keep every worker busy."""
        return 2 * self.threads


DEFAULT_OPTIONS = WriteOptions()


@dataclass(frozen=True)
class _Encoded:
    """A chunk after the parallel stage: its blob in parts, None if it is already stored."""

    id: str
    size: int
    blob: list[Buffer] | None
    base: ChunkRef | None
    # A delta tried: its length and the chunk's own encoding's (the chunk's length where
    # the delta was small enough to leave the own encoding untried); None: none tried.
    delta_tried: tuple[int, int] | None = None


class DeltaProbe:
    """Whether the checkpoint's deltas pay, from its first delta attempts (see DELTA_PROBES).

    Fed in submission order: `offer` says whether the chunk at `position` may take a delta,
    `probing` records the chunk's encoding when it was offered one and the answer is open.
    """

    def __init__(self, chunk_size: int) -> None:
        self._enough = DELTA_PROBES * chunk_size  # bytes of chunks tried
        self._pending: deque[tuple[int, Future[_Encoded]]] = deque()
        self._tried = self._deltas = self._own = 0
        self.deltas_pay: bool | None = None

    def offer(self, position: int) -> bool:
        while (self.deltas_pay is None and self._pending
               and self._pending[0][0] + DELTA_LAG <= position):
            encoded = self._pending.popleft()[1].result()
            if encoded.delta_tried is not None:
                self._tried += encoded.size
                self._deltas += encoded.delta_tried[0]
                self._own += encoded.delta_tried[1]
            if self._tried >= self._enough:
                self.deltas_pay = self._deltas <= DELTA_PAYS_BELOW * self._own
        return self.deltas_pay is not False

    def probing(self, position: int, encoded: Future[_Encoded]) -> None:
        if self.deltas_pay is None:
            self._pending.append((position, encoded))


@dataclass(frozen=True)
class _Stored:
    pack: int  # index of the pack in this writer
    entry: Entry
    size: int
    base: ChunkRef | None


class ChunkWriter:
    """Writes the new chunks of one checkpoint, in the order they are added.

    `add` returns a slot; once `close` has returned, `ref(slot)` locates that chunk.
    `known` holds refs already stored (the parent's), so those chunks are not stored again.
    `read_base` returns the plaintext of a stored chunk, for delta encoding; it is called
    from worker threads. Use as a context manager, so threads stop on errors.
    `pack_object` names the object of a pack id: a run's own packs by default
    (`run-packs/<run>/<id>`), a staged tree's elsewhere (slurm_geo.stage).
    """

    def __init__(
        self, store: Store, keys: RunKeys, options: WriteOptions, random_bytes: RandomBytes,
        known: dict[str, ChunkRef], read_base: Callable[[ChunkRef], Bytes], run: str,
        pack_object: Callable[[str], str] | None = None,
    ):
        self._store = store
        packs = packs_run(run, options.format_version)  # where this format puts packs
        self._pack_object = pack_object or (lambda pack_id: pack_name(pack_id, packs))
        self._keys = keys
        self._options = options
        self._random_bytes = random_bytes
        self._known = known
        self._read_base = read_base
        self._workers = worker_pool(options.threads, "slurm-geo-encode")
        self._uploader = worker_pool(1 if options.threads == 1 else 2, "slurm-geo-upload")
        self._local = threading.local()
        self._delta_probe = DeltaProbe(options.chunk_size)
        self._slots: list[str | None] = []
        self._in_flight: deque[tuple[int, Future[_Encoded]]] = deque()
        self._stored: dict[str, _Stored] = {}
        self._pack: PackWriter | None = None
        self._spare_buffers: list[mmap.mmap] = []  # of packs already stored, for reuse
        self._uploads: list[Future[str]] = []
        self._unfinished: deque[Future[str]] = deque()
        self._pack_ids: list[str] = []

    def __enter__(self) -> ChunkWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._shutdown()

    def add(self, data: memoryview, element_size: int, base: ChunkRef | None = None) -> int:
        """Queue `data` to be stored unless it already is; its slot."""
        slot = len(self._slots)
        self._slots.append(None)
        if base is not None and not self._delta_probe.offer(slot):
            base = None
        encoded = self._workers.submit(self._encode, data, element_size, base)
        if base is not None:
            self._delta_probe.probing(slot, encoded)
        self._in_flight.append((slot, encoded))
        while len(self._in_flight) > self._options.window:
            self._commit_next()
        return slot

    def reuse(self, ref: ChunkRef) -> int:
        """A slot for a chunk known unchanged: `ref`'s id, as if hashed (no read, no hash)."""
        if ref.id not in self._known:
            raise ValueError(f"chunk {ref.id} is not among the known chunks")
        self._slots.append(ref.id)
        return len(self._slots) - 1

    def close(self) -> None:
        """Store everything added; afterwards every slot has a ref."""
        while self._in_flight:
            self._commit_next()
        self._finish_pack()
        self._pack_ids = [upload.result() for upload in self._uploads]

    def ref(self, slot: int) -> ChunkRef:
        cid = self._slots[slot]
        if cid is None:
            raise RuntimeError("ref() before close()")
        if cid in self._known:
            return self._known[cid]
        stored = self._stored[cid]
        entry = stored.entry
        return ChunkRef(cid, self._pack_ids[stored.pack], entry.offset, entry.length,
                        stored.size, stored.base)

    # Worker threads.

    def _encode(self, data: memoryview, element_size: int, base: ChunkRef | None) -> _Encoded:
        cid = chunk_id(self._keys.id_key, data, self._options.format_version).hex()
        if cid in self._known or cid in self._stored:  # stored earlier in the order
            return _Encoded(cid, len(data), None, None)
        base = None if base is None else self._delta_base(base, len(data))
        if base is None:
            return _Encoded(cid, len(data), self._own_encoding(data, element_size), None)
        return self._encode_against(cid, data, element_size, base)

    def _encode_against(self, cid: str, data: memoryview, element_size: int,
                        base: ChunkRef) -> _Encoded:
        """A delta on `base` of the kind the changes call for (`delta_kind`), or the chunk
        on its own where that delta saves little and the chunk's own encoding is smaller."""
        base_data, base_id = self._read_base(base), bytes.fromhex(base.id)
        xored = xor_bytes(data, base_data)
        changed = changed_fraction(xored, element_size)
        if (delta_kind(changed, element_size) == Method.ZSTD_PATCH
                and self._options.pack_version >= PATCH_VERSION):
            delta = encode_patch_parts(data, base_data, base_id, level=self._options.zstd_level)
        else:
            delta = encode_xored_parts(xored, base_id, element_size=element_size,
                                       compressors=self._compressors())
        if _length(delta) <= OWN_UNTRIED_BELOW * len(data):
            return _Encoded(cid, len(data), delta, base, (_length(delta), len(data)))
        own = self._own_encoding(data, element_size)
        tried = (_length(delta), _length(own))
        if _length(own) < _length(delta):
            return _Encoded(cid, len(data), own, None, tried)
        return _Encoded(cid, len(data), delta, base, tried)

    def _own_encoding(self, data: memoryview, element_size: int) -> list[Buffer]:
        return encode_parts(data, element_size=element_size, compressors=self._compressors(),
                            sparse=self._options.pack_version >= BLAKE3_VERSION)

    def _delta_base(self, parent_chunk: ChunkRef, size: int) -> ChunkRef | None:
        """The parent's chunk, or the root of its delta chain when that is too long."""
        limit = self._options.max_delta_depth
        if parent_chunk.size != size or limit == 0:
            return None
        base = parent_chunk
        if base.depth >= limit:
            while base.base is not None:
                base = base.base
        return base

    def _compressors(self) -> Compressors:
        compressors: Compressors | None = getattr(self._local, "compressors", None)
        if compressors is None:
            compressors = self._local.compressors = Compressors(self._options.zstd_level)
        return compressors

    # The caller's thread, in submission order.

    def _commit_next(self) -> None:
        slot, future = self._in_flight.popleft()
        encoded = future.result()
        self._slots[slot] = encoded.id
        if encoded.id in self._known or encoded.id in self._stored:
            return  # an earlier chunk of this checkpoint had the same content
        assert encoded.blob is not None  # only known or stored chunks skip encoding
        if self._pack is None:
            buffer = self._spare_buffers.pop() if self._spare_buffers else self._new_buffer()
            self._pack = PackWriter(self._keys.data_key, self._random_bytes(SALT_SIZE), buffer,
                                    version=self._options.pack_version)
        entry = self._pack.add_parts(bytes.fromhex(encoded.id), encoded.blob)
        self._stored[encoded.id] = _Stored(len(self._uploads), entry, encoded.size,
                                           encoded.base)
        if self._pack.size >= self._options.pack_size:
            self._finish_pack()

    def _new_buffer(self) -> mmap.mmap:
        """Room for a whole pack: one that grew blob by blob would be copied again and
        again, each time into fresh pages (measured: a tenth of a push's CPU time)."""
        return pack_buffer(self._options.pack_size + 2 * self._options.chunk_size)

    def _finish_pack(self) -> None:
        """Hand the open pack to the uploader; wait while too many are on their way."""
        if self._pack is None:
            return
        data, buffer, self._pack = self._pack.release(), self._pack.buffer, None
        upload = self._uploader.submit(self._upload, data, buffer)
        self._uploads.append(upload)
        self._unfinished.append(upload)
        for finished in [u for u in self._unfinished if u.done()]:
            finished.result()  # a failed upload fails the save now, not at the end
            self._unfinished.remove(finished)
        while len(self._unfinished) > UPLOAD_WINDOW:
            self._unfinished.popleft().result()

    def _upload(self, data: memoryview, buffer: mmap.mmap) -> str:
        pack_id = pack_id_of(data)
        # On failure the buffer is not reused.
        self._store.put(self._pack_object(pack_id), data)
        try:
            data.release()
        except BufferError:
            return pack_id  # the store kept a view of it: leave the buffer alone
        self._spare_buffers.append(buffer)
        return pack_id

    def _shutdown(self) -> None:
        for _slot, future in self._in_flight:
            future.cancel()
        self._workers.shutdown(wait=True, cancel_futures=True)
        self._uploader.shutdown(wait=True, cancel_futures=True)


def _length(parts: list[Buffer]) -> int:
    return sum(len(p) for p in parts)
