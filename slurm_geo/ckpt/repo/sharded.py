"""Multi-rank checkpoints (docs/format.md §7.5): every rank stores its own shards, the
coordinator commits one manifest for all of them.

Many ranks call `write_shards` on one store at once (packs have random names); what they
write is no checkpoint until `commit_sharded` seals the format 3 manifest naming every
rank's chunks and their layout. The run's key object must exist before the ranks write
(`Repository.create_run_key` on the coordinator), and the coordinator holds the push lock
that keeps gc off their packs until the commit (slurm_geo.torch.distributed does both).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial

from slurm_geo.ckpt.errors import CorruptObject, ImmutableCheckpoint
from slurm_geo.ckpt.format.layout import Layout
from slurm_geo.ckpt.format.manifest import (
    SHARDED_FORMAT,
    BlobEntry,
    ChunkRef,
    Manifest,
    Metadata,
    TensorEntry,
    check_metadata,
    manifest_to_json,
    parse_manifest,
    tensor_nbytes,
)
from slurm_geo.ckpt.format.names import manifest_name
from slurm_geo.ckpt.repo.reader import ChunkReader, fetch_pool, ordered_map, prefetched, worker_pool
from slurm_geo.ckpt.repo.repository import Repository, Tensor, add_tensor, check_tensors


def write_shards(repository: Repository, run: str, tensors: Sequence[Tensor],
                 parent: int | None) -> list[TensorEntry]:
    """One rank's part of a checkpoint: the chunks of its `tensors` stored (those the
    parent checkpoint holds only referenced) and their manifest entries."""
    check_tensors(tensors)
    parent_manifest = None if parent is None else repository.manifest(run, parent)
    chunk_size = repository.options.chunk_size
    with repository.chunk_writer(run, parent_manifest, create=False) as writer:
        slots = [add_tensor(writer, t, chunk_size) for t in tensors]
        writer.close()
        return [TensorEntry(t.path, t.dtype, tuple(t.shape), tuple(map(writer.ref, s)))
                for t, s in zip(tensors, slots, strict=True)]


def commit_sharded(repository: Repository, run: str, entries: Sequence[TensorEntry],
                   layout: Layout, metadata: Metadata, parent: int | None,
                   before_commit: Callable[[], None] = lambda: None) -> Manifest:
    """Commit every rank's `entries` as one checkpoint, checked first as a reader will
    check it: a layout that does not match its tensors is refused, nothing committed."""
    name = manifest_name(run, metadata.global_step)
    check_metadata(name, metadata)
    if repository.is_promoted(run, metadata.global_step):
        raise ImmutableCheckpoint(name)
    manifest = Manifest(run=run, metadata=metadata, parent_step=parent,
                        chunk_size=repository.options.chunk_size, tensors=tuple(entries),
                        extra_state=BlobEntry(0, ()), format=SHARDED_FORMAT, sharded=layout)
    try:
        parse_manifest(manifest_to_json(manifest), name, run, metadata.global_step)
    except CorruptObject as exc:
        raise ValueError(f"checkpoint '{name}' would not read back: {exc.detail}") from None
    repository.commit(manifest, before_commit)
    return manifest


@dataclass(frozen=True)
class Fill:
    """Bytes [start, start + len(out)) of the stored tensor `path`, to be decoded into
    `out`: a writable byte view, such as the memory of the tensor a load restores."""

    path: str
    start: int
    out: memoryview


class StoredReader:
    """Reads byte ranges of a manifest's stored tensors straight into caller buffers, every
    chunk they touch verified against its id: a chunk wholly inside a fill is decoded and
    checked in place, one across a fill's edge apart, and only its part copied.

    Chunks are read in manifest order on the repository's threads, each pack fetched ahead
    of the decoding threads; the last few packs stay for the next `fill`, so the small
    items a load reads one by one do not fetch and check their pack again each time. Use
    as a context manager: its threads stop on leaving it.
    """

    def __init__(self, repository: Repository, manifest: Manifest):
        self._entries = {t.path: t for t in manifest.tensors}
        self._order = {t.path: i for i, t in enumerate(manifest.tensors)}
        self._reader = repository.chunk_reader(manifest)
        threads, self._window = repository.options.threads, repository.options.window
        self._pool = worker_pool(threads, "slurm-geo-read")
        self._fetcher = fetch_pool(threads)

    def __enter__(self) -> StoredReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._fetcher.shutdown(wait=True, cancel_futures=True)

    def fill(self, fills: Sequence[Fill]) -> None:
        """Decode the bytes each fill names into its `out`; on an error they hold garbage."""
        for fill in fills:
            entry = self._entries[fill.path]
            end = fill.start + len(fill.out)
            if fill.start < 0 or end > tensor_nbytes(entry.dtype, entry.shape):
                raise ValueError(f"{len(fill.out)} bytes at {fill.start} lie outside stored "
                                 f"tensor {fill.path!r}")
        ordered = sorted(fills, key=lambda f: (self._order[f.path], f.start))
        jobs = prefetched(_chunk_jobs(self._entries, ordered), _ref_of_job, self._reader,
                          self._fetcher, self._window)
        for _done in ordered_map(partial(_fill_chunk, self._reader), jobs, self._pool,
                                 self._window):
            pass


_Job = tuple[ChunkRef, memoryview, int]  # a chunk, a fill's buffer, where the chunk begins there


def _chunk_jobs(entries: dict[str, TensorEntry], fills: Sequence[Fill]) -> Iterator[_Job]:
    """Each chunk a fill overlaps, with its position relative to the fill (negative, or
    ending past the fill, where it crosses an edge)."""
    for fill in fills:
        end = fill.start + len(fill.out)
        position = 0
        for ref in entries[fill.path].chunks:
            if position < end and position + ref.size > fill.start:
                yield ref, fill.out, position - fill.start
            position += ref.size


def _ref_of_job(job: _Job) -> ChunkRef:
    return job[0]


def _fill_chunk(reader: ChunkReader, job: _Job) -> None:
    ref, out, at = job
    if at >= 0 and at + ref.size <= len(out):
        reader.read_into(ref, out, at)
        return
    chunk = reader.read(ref)
    low, high = max(at, 0), min(at + ref.size, len(out))
    out[low:high] = chunk[low - at:high - at]
