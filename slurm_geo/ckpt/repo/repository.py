"""Checkpoints of runs in a store (docs/format.md §8): save, load, find the latest, verify.

A save writes the run's wrapped key (once), then packs, then the manifest, then the latest
pointer; a crash at any point leaves the previous checkpoint intact and still the latest.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import NamedTuple, Protocol

from slurm_geo.ckpt.errors import CkptError, CorruptObject, ImmutableCheckpoint, ObjectMissing
from slurm_geo.ckpt.format.chunking import content_defined_chunks, fixed_chunks
from slurm_geo.ckpt.format.keys import (
    SALT_SIZE,
    MasterKeys,
    RandomBytes,
    RunKeyRing,
    RunKeys,
    as_master_keys,
)
from slurm_geo.ckpt.format.manifest import (
    DTYPE_SIZES,
    PLANE_DTYPES,
    BlobEntry,
    ChunkRef,
    Manifest,
    Metadata,
    TensorEntry,
    check_metadata,
    latest_to_json,
    manifest_to_json,
    parse_latest,
    parse_manifest,
    tensor_nbytes,
)
from slurm_geo.ckpt.format.names import (
    fence_name,
    latest_name,
    manifest_name,
    manifest_prefix,
    promoted_name,
    run_of_manifest_name,
    step_of_manifest_name,
)
from slurm_geo.ckpt.format.seal import Kind, open_sealed, open_with_ring, seal, sealing_fingerprint
from slurm_geo.ckpt.repo.keyholder import KeyHolder, MasterKeyHolder
from slurm_geo.ckpt.repo.locks import Clock, push_lock
from slurm_geo.ckpt.repo.reader import (
    ChunkReader,
    fetch_pool,
    ordered_map,
    prefetched,
    worker_pool,
)
from slurm_geo.ckpt.repo.writer import DEFAULT_OPTIONS, ChunkWriter, WriteOptions
from slurm_geo.ckpt.stores.store import Bytes, Store


class ChunkedBytes(Protocol):
    """Bytes handed to the writer a chunk at a time (a region of a file, mapped as read)."""

    def __len__(self) -> int: ...
    def chunks(self, chunk_size: int) -> Iterator[memoryview]: ...


class Tensor(NamedTuple):
    """One state-dict entry: C-contiguous little-endian bytes of `dtype` and `shape`."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    data: Bytes


class StreamedTensor(NamedTuple):
    """A tensor to write whose bytes come a chunk at a time (`Tensor`'s, otherwise)."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    data: ChunkedBytes


TensorToWrite = Tensor | StreamedTensor


@dataclass(frozen=True)
class Checkpoint:
    manifest: Manifest
    tensors: list[Tensor]
    extra_state: bytes


class Repository:
    """The checkpoints of every run in one store, sealed under one site master key (or,
    during a rotation, under it or the key it replaces: docs/format.md §8.5)."""

    def __init__(self, store: Store, master_key: bytes | MasterKeys,
                 options: WriteOptions = DEFAULT_OPTIONS, random_bytes: RandomBytes = os.urandom,
                 clock: Clock = lambda: datetime.now(UTC), holder: KeyHolder | None = None):
        self._store = store
        self.master_keys = as_master_keys(master_key)
        self._options = options
        self._random_bytes = random_bytes
        self._clock = clock
        self._holder = holder or MasterKeyHolder(store, self.master_keys, random_bytes)

    def write_checkpoint(
        self, run: str, tensors: Sequence[TensorToWrite], extra_state: Bytes, metadata: Metadata,
        parent: int | None = None, delta: bool = False, unchanged: Collection[str] = (),
        before_commit: Callable[[], None] = lambda: None,
        on_bytes: Callable[[int, int], None] = lambda _d, _t: None,
        stamp: Callable[[Metadata], Metadata] = lambda m: m,
    ) -> Manifest:
        """Save a checkpoint at `metadata.global_step`; `parent` (a step) enables dedup/delta.

        `before_commit` runs after the packs are written, right before the manifest (the
        commit point); if it raises, nothing is committed. A job holding a training lease
        re-checks it there, so a process frozen during a save cannot commit when thawed.

        `unchanged` names tensors the caller knows equal the parent's (frozen parameters):
        their chunk refs are copied from the parent without reading or hashing `data`,
        which gives the manifest hashing would. A tensor the parent lacks, or holds with
        another dtype, shape or chunk size, is read and hashed as usual. The hint is
        trusted: a tensor named but changed is saved with the parent's content.

        `on_bytes(done, total)` follows the tensors' bytes handed to the writer; `stamp`
        gives the metadata its last word once the packs are written (its commit time).
        """
        name = manifest_name(run, metadata.global_step)
        check_metadata(name, metadata)
        check_tensors(tensors)
        if self.is_promoted(run, metadata.global_step):
            raise ImmutableCheckpoint(name)
        parent_manifest = None if parent is None else self.manifest(run, parent)
        with push_lock(self._store, self._random_bytes, self._clock):
            return self._write(run, name, tensors, extra_state, (metadata, stamp),
                               parent_manifest, delta, frozenset(unchanged), before_commit,
                               _Tally(sum(map(_nbytes, tensors)), on_bytes))

    def _write(self, run: str, name: str, tensors: Sequence[TensorToWrite], extra_state: Bytes,
               stamped: tuple[Metadata, Callable[[Metadata], Metadata]],
               parent_manifest: Manifest | None, delta: bool,
               unchanged: frozenset[str], before_commit: Callable[[], None],
               tally: _Tally) -> Manifest:
        parent = None if parent_manifest is None else parent_manifest.step
        chunk_size = self._options.chunk_size
        sharing = _sharing(parent_manifest, run, self._keys(run, create=True).current,
                           self._options.format_version)
        reusable = _reusable_chunks(sharing, chunk_size, unchanged)
        bases = _delta_bases(sharing, chunk_size) if delta else {}
        with self.chunk_writer(run, sharing) as writer:
            tensor_slots = [
                tally.all_of(t, [writer.reuse(r) for r in reusable[t.path].chunks])
                if _same_as(reusable, t)
                else add_tensor(writer, t, chunk_size, bases.get((t.path, t.dtype), ()),
                                tally.add)
                for t in tensors
            ]
            extra = _bytes_view(extra_state)
            extra_slots = [writer.add(c, 1)
                           for c in content_defined_chunks(extra, self._options.cdc)]
            writer.close()
            before_commit()  # the lease check, then the stamp: moments before the commit
            check_metadata(name, metadata := stamped[1](stamped[0]))
            manifest = Manifest(
                run=run, metadata=metadata, parent_step=parent, chunk_size=chunk_size,
                tensors=tuple(
                    TensorEntry(t.path, t.dtype, tuple(t.shape), tuple(map(writer.ref, slots)))
                    for t, slots in zip(tensors, tensor_slots, strict=True)
                ),
                extra_state=BlobEntry(len(extra), tuple(map(writer.ref, extra_slots))),
                format=self._options.format_version,
            )
        self.commit(manifest, lambda: None)
        return manifest

    @property
    def store(self) -> Store:
        return self._store

    def on(self, store: Store) -> Repository:
        """The same master keys over another store (where a copy goes), with the default
        write options."""
        return Repository(store, self.master_keys)

    @property
    def options(self) -> WriteOptions:
        return self._options

    def create_run_key(self, run: str) -> None:
        """Make sure `keys/<run>` exists, writing a new data key for a run's first save."""
        self._keys(run, create=True)

    def chunk_writer(self, run: str, parent: Manifest | None, create: bool = True
                     ) -> ChunkWriter:
        """A writer of `run`'s new chunks, referencing the ones `parent` already stores."""
        keys = self._keys(run, create=create).current
        return ChunkWriter(self._store, keys, self._options, self._random_bytes,
                           _known_refs(_sharing(parent, run, keys,
                                                      self._options.format_version)),
                           ChunkReader(self._store, keys, self._options.format_version,
                                       run).read, run)

    def run_keys(self, run: str) -> RunKeyRing:
        """The run's key ring, from its wrapped keys (raises if missing or damaged)."""
        return self._keys(run)

    def keys_of(self, manifest: Manifest) -> RunKeys:
        """The data key sealing `manifest` and its packs (§4.2); current for one being written."""
        ring = self._keys(manifest.run)
        if manifest.key is None:
            return ring.current
        return ring.sealed_under(manifest.key, manifest_name(manifest.run, manifest.step))

    def chunk_reader(self, manifest: Manifest) -> ChunkReader:
        """A reader of the chunks `manifest` names, each verified against its id."""
        return ChunkReader(self._store, self.keys_of(manifest), manifest.format,
                           manifest.run)

    def commit(self, manifest: Manifest, before_commit: Callable[[], None]) -> None:
        """Seal and put the manifest (the commit point, after `before_commit`), then the
        latest pointer, which only saves readers a listing."""
        before_commit()
        self._put_sealed(self.keys_of(manifest).data_key, Kind.MANIFEST,
                         manifest_name(manifest.run, manifest.step), manifest_to_json(manifest))
        self.point_latest(manifest.run, manifest.step)

    def read_tensors(self, manifest: Manifest) -> Iterator[Tensor]:
        """The manifest's tensors in order, each chunk verified (it may be cut down to some)."""
        return _tensors(manifest, self.chunk_reader(manifest), self._options)

    def point_latest(self, run: str, step: int) -> None:
        """Name `step` as the run's latest checkpoint (after its manifest is in place)."""
        self._put_sealed(self._keys(run).current.data_key, Kind.LATEST, latest_name(run),
                         latest_to_json(run, step))

    def read_checkpoint(self, run: str, step: int) -> Checkpoint:
        """Every tensor and the extra state of a checkpoint, each chunk verified."""
        manifest = self.manifest(run, step)
        reader = self.chunk_reader(manifest)
        options = self._options
        tensors = [t._replace(data=bytes(t.data)) for t in _tensors(manifest, reader, options)]
        return Checkpoint(manifest, tensors, bytes(_blob(manifest.extra_state, reader, options)))

    def iter_tensors(self, run: str, step: int) -> Iterator[Tensor]:
        """The checkpoint's tensors one at a time, in manifest order, each chunk verified.

        For streaming pulls: only the tensor being assembled (a bytearray the caller owns)
        and a few chunks and packs are in memory. The manifest is read before this returns.
        """
        return self.read_tensors(self.manifest(run, step))

    def read_extra_state(self, run: str, step: int) -> bytes:
        """The checkpoint's opaque non-tensor state, verified."""
        manifest = self.manifest(run, step)
        reader = self.chunk_reader(manifest)
        return bytes(_blob(manifest.extra_state, reader, self._options))

    def manifest(self, run: str, step: int) -> Manifest:
        return self.open_manifest(run, step, self._store.get(manifest_name(run, step)))

    def open_manifest(self, run: str, step: int, sealed: bytes) -> Manifest:
        name = manifest_name(run, step)  # from its sealed bytes, opened and validated
        keys = self._keys(run).opening(sealing_fingerprint(sealed))
        payload = open_sealed(keys.data_key, Kind.MANIFEST, sealed, name)
        return replace(parse_manifest(payload, name, run, step), key=keys.fingerprint)

    def latest(self, run: str) -> int | None:
        """The step saved last, or None if the run has no checkpoint."""
        pointed = self.pointer(run)
        if pointed is not None:
            return pointed
        steps = self.steps(run)  # pointer never written: a crash right after a commit
        return steps[-1] if steps else None

    def pointer(self, run: str) -> int | None:
        """The step `latest/<run>` names, or None when there is no pointer."""
        name = latest_name(run)
        try:
            sealed = self._store.get(name)
        except ObjectMissing:
            return None
        keys = self._keys(run).opening(sealing_fingerprint(sealed))
        payload = open_sealed(keys.data_key, Kind.LATEST, sealed, name)
        return parse_latest(payload, name, run)

    def steps(self, run: str) -> list[int]:
        """Steps of the run's committed checkpoints, ascending."""
        steps = (step_of_manifest_name(run, n) for n in self._store.list(manifest_prefix(run)))
        return sorted(s for s in steps if s is not None)

    def runs(self) -> list[str]:
        """Every run with at least one committed checkpoint, sorted."""
        return sorted({r for n in self._store.list("manifests/")
                       if (r := run_of_manifest_name(n)) is not None})

    def promote(self, run: str, step: int) -> None:
        """Tier 3: make a checkpoint immutable (never overwritten, deleted or collected).
        The marker is sealed under the promotion key (§8.1): the master key's holders only."""
        self.manifest(run, step)  # only a valid checkpoint can be promoted
        body = json.dumps({"run": run, "step": step, "promoted_at": self._clock().isoformat()})
        self._put_sealed(self._holder.promotion_keys()[0], Kind.PROMOTED, promoted_name(run, step),
                         body.encode())

    def is_promoted(self, run: str, step: int) -> bool:
        """Whether `promoted/<run>/<step>` opens under the promotion key and names that
        checkpoint. A marker that is there but does not (version 1, another key, altered)
        raises its error: it is neither trusted nor silently taken as absent."""
        name = promoted_name(run, step)
        try:
            sealed = self._store.get(name)
        except ObjectMissing:
            return False
        payload = open_with_ring(self._holder.promotion_keys(), Kind.PROMOTED, sealed, name)
        check_promotion(payload, name, run, step)
        return True

    def put_daemon_record(self, kind: Kind, name: str, payload: bytes) -> None:
        """Seal `payload` as `name` under the promotion key: a daemon's record (ckpt.verified)."""
        self._put_sealed(self._holder.promotion_keys()[0], kind, name, payload)

    def daemon_record(self, kind: Kind, name: str) -> bytes | None:
        """The opened record `name`, or None when there is none; one not opening raises."""
        try:
            sealed = self._store.get(name)
        except ObjectMissing:
            return None
        return open_with_ring(self._holder.promotion_keys(), kind, sealed, name)

    def put_fence(self, run: str, payload: bytes) -> None:
        """Write the run's fence (§8.3); slurm_geo.ckpt.repo.fence decides what it says."""
        self._put_sealed(self._holder.fence_keys()[0], Kind.FENCE, fence_name(run), payload)

    def fence_payload(self, run: str) -> bytes | None:
        """The opened payload of the run's fence, or None when the run is not fenced."""
        name = fence_name(run)
        try:
            sealed = self._store.get(name)
        except ObjectMissing:
            return None
        return open_with_ring(self._holder.fence_keys(), Kind.FENCE, sealed, name)

    def delete_checkpoint(self, run: str, step: int) -> None:
        """Drop a checkpoint's manifest; its packs go at the next gc unless shared."""
        name = manifest_name(run, step)
        if self.is_promoted(run, step):
            raise ImmutableCheckpoint(name)
        if self.latest(run) == step:
            self._store.delete(latest_name(run))  # readers fall back to listing manifests
        self._store.delete(name)

    def verify(self, run: str, step: int,
               on_bytes: Callable[[int, int], None] = lambda _d, _t: None) -> list[CkptError]:
        """Read every chunk of a checkpoint: a fault per damaged or missing object (on_bytes)."""
        try:
            manifest = self.manifest(run, step)
        except CkptError as exc:
            return [exc]
        reader = ChunkReader(self._store, self.keys_of(manifest), manifest.format, run,
                             hash_packs=True)
        return _faults(manifest, reader, self._options, on_bytes)

    def _keys(self, run: str, create: bool = False) -> RunKeyRing:
        return self._holder.ring(run, create)

    def put_run_keys(self, run: str, ring: RunKeyRing) -> None:
        """Write `keys/<run>` holding `ring`, sealed under the master key (§4.2); what this
        repository reads of the run from now on is under that ring."""
        self._holder.put_ring(run, ring)

    def _put_sealed(self, key: bytes, kind: Kind, name: str, payload: bytes) -> None:
        self._store.put(name, seal(key, kind, self._random_bytes(SALT_SIZE), payload, name))


def check_promotion(payload: bytes, name: str, run: str, step: int) -> None:
    """A marker's payload must name the checkpoint its object name does (§8.1)."""
    try:
        fields = json.loads(payload)
        named = (fields["run"], fields["step"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptObject(name, f"promotion marker does not parse: {exc}") from None
    if named != (run, step) or type(fields["step"]) is not int:
        raise CorruptObject(name, f"promotion marker names {named[0]!r}@{named[1]!r}, "
                            f"not {run}@{step}")


def add_tensor(writer: ChunkWriter, tensor: TensorToWrite, chunk_size: int,
               bases: tuple[ChunkRef, ...] = (),
               on_chunk: Callable[[int], None] = lambda _n: None) -> list[int]:
    """The tensor's chunk slots; chunk i may be a delta against the parent's chunk i.
    `on_chunk(n)` after each chunk of n bytes is handed to the writer."""
    element_size = PLANE_DTYPES.get(tensor.dtype, 1)
    data = tensor.data
    chunks = (fixed_chunks(_bytes_view(data), chunk_size)
              if isinstance(data, bytes | bytearray | memoryview) else data.chunks(chunk_size))
    slots = []
    for i, chunk in enumerate(chunks):
        slots.append(writer.add(chunk, element_size, bases[i] if i < len(bases) else None))
        on_chunk(len(chunk))
    return slots


def _tensors(manifest: Manifest, reader: ChunkReader, options: WriteOptions
             ) -> Iterator[Tensor]:
    """Chunks are decoded straight into each tensor's buffer, `window` at a time,
    reading ahead across tensor boundaries."""

    def fill(job: tuple[ChunkRef, bytearray, int]) -> bytearray:
        ref, data, offset = job
        reader.read_into(ref, data, offset)
        return data

    threads, window = options.threads, options.window
    with worker_pool(threads, "slurm-geo-read") as pool, fetch_pool(threads) as fetcher:
        jobs = prefetched(_fill_jobs(manifest.tensors), _ref_of_job, reader, fetcher, window)
        filled = ordered_map(fill, jobs, pool, window)
        try:
            for entry in manifest.tensors:
                data = bytearray()
                for _ref in entry.chunks:
                    data = next(filled)
                yield Tensor(entry.path, entry.dtype, entry.shape, data)
        finally:
            filled.close()  # cancel the read-ahead before the pool waits for it


def _blob(blob: BlobEntry, reader: ChunkReader, options: WriteOptions) -> bytearray:
    with worker_pool(options.threads, "slurm-geo-read") as pool:
        data = bytearray()
        for chunk in ordered_map(reader.read, blob.chunks, pool, options.window):
            data += chunk
        return data


def _faults(manifest: Manifest, reader: ChunkReader, options: WriteOptions,
            on_bytes: Callable[[int, int], None]) -> list[CkptError]:
    """Every chunk of `manifest` read through `reader`: one fault per damaged object."""
    def fault_of(ref: ChunkRef) -> CkptError | None:
        try:
            reader.read(ref)
        except CkptError as exc:
            return exc
        return None

    faults: dict[str, CkptError] = {}
    # One read per stored copy, not per id: ranks of a multi-rank save each store the
    # chunks they hold (equal ones too, zeros say) in their own packs (§7.5).
    unique = dict.fromkeys(manifest.refs())
    tally = _Tally(sum(ref.size for ref in unique), on_bytes)
    with worker_pool(options.threads, "slurm-geo-verify") as pool:
        for ref, fault in zip(unique, ordered_map(fault_of, unique, pool, options.window),
                              strict=True):
            tally.add(ref.size)
            if fault is not None:
                faults.setdefault(fault.name, fault)
    return list(faults.values())


class _Tally:
    """Bytes done out of a known total, reported as `on_bytes(done, total)`."""

    def __init__(self, total: int, on_bytes: Callable[[int, int], None]):
        self._done, self._total, self._on_bytes = 0, total, on_bytes

    def add(self, count: int) -> None:
        self._done += count
        self._on_bytes(self._done, self._total)

    def all_of(self, tensor: TensorToWrite, slots: list[int]) -> list[int]:
        """A tensor taken whole from the parent: all its bytes at once; its slots."""
        self.add(_nbytes(tensor))
        return slots


def _nbytes(tensor: TensorToWrite) -> int:
    return tensor_nbytes(tensor.dtype, tuple(tensor.shape))


def _bytes_view(data: Bytes) -> memoryview:
    return memoryview(data).cast("B")


def check_tensors(tensors: Sequence[TensorToWrite]) -> None:
    """Refuse bad input before anything is written."""
    paths = set()
    for path, dtype, shape, data in tensors:
        if path in paths:
            raise ValueError(f"tensor {path!r} is given twice")
        paths.add(path)
        if dtype not in DTYPE_SIZES:
            raise ValueError(f"tensor {path!r}: unknown dtype {dtype!r}")
        if not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(f"tensor {path!r}: shape {shape!r} is not a sequence of sizes")
        nbytes = (len(_bytes_view(data)) if isinstance(data, bytes | bytearray | memoryview)
                  else len(data))
        if nbytes != tensor_nbytes(dtype, tuple(shape)):
            raise ValueError(f"tensor {path!r}: {nbytes} bytes do not hold "
                             f"{dtype}{list(shape)}")


def _sharing(parent: Manifest | None, run: str, keys: RunKeys,
             written_as: int) -> Manifest | None:
    """The parent, when it is of the same run and written as ours are (format 4 and 5),
    under the key ours are sealed with: a parent of version 1 names its chunks another way,
    one of version 2 or 3 keeps its packs where any run's key may write, and one under a key
    the run has rotated away from (§4.2) is readable by whoever held that key, so none of
    these is shared (the first save after an upgrade or a rotation is stored in full)."""
    if parent is None or parent.run != run or parent.format < written_as:
        return None
    if parent.key is not None and parent.key != keys.fingerprint:
        return None
    return parent


def _known_refs(parent: Manifest | None) -> dict[str, ChunkRef]:
    return {} if parent is None else {r.id: r for r in parent.refs()}


def _fill_jobs(tensors: Sequence[TensorEntry]) -> Iterator[tuple[ChunkRef, bytearray, int]]:
    """(chunk, its tensor's buffer, its offset there), allocating each buffer when reached."""
    for entry in tensors:
        data = bytearray(tensor_nbytes(entry.dtype, entry.shape))
        offset = 0
        for ref in entry.chunks:
            yield ref, data, offset
            offset += ref.size


def _ref_of_job(job: tuple[ChunkRef, bytearray, int]) -> ChunkRef:
    return job[0]


def _reusable_chunks(parent: Manifest | None, chunk_size: int,
                     unchanged: frozenset[str]) -> dict[str, TensorEntry]:
    """The parent's entries of tensors named unchanged, if cut with the same chunk size."""
    if parent is None or parent.chunk_size != chunk_size:
        return {}
    return {t.path: t for t in parent.tensors if t.path in unchanged}


def _same_as(reusable: dict[str, TensorEntry], tensor: TensorToWrite) -> bool:
    entry = reusable.get(tensor.path)
    return entry is not None and (entry.dtype, entry.shape) == (tensor.dtype, tuple(tensor.shape))


def _delta_bases(
    parent: Manifest | None, chunk_size: int
) -> dict[tuple[str, str], tuple[ChunkRef, ...]]:
    """Per (path, dtype), the parent's chunks a delta may be taken against."""
    if parent is None or parent.chunk_size != chunk_size:
        return {}
    return {(t.path, t.dtype): t.chunks for t in parent.tensors}
