"""Multi-rank checkpoints (docs/format.md §7.5): every rank stores its own shards, the
coordinator commits one manifest for all of them.

Many ranks call `write_shards` on one store at once (packs have random names); what they
write is no checkpoint until `commit_sharded` seals the format 3 manifest naming every
rank's chunks and their layout. The run's key object must exist before the ranks write
(`Repository.create_run_key` on the coordinator), and the coordinator holds the push lock
that keeps gc off their packs until the commit (slurm_geo.torch.distributed does both).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import replace

from slurm_geo.ckpt.errors import CorruptObject, ImmutableCheckpoint
from slurm_geo.ckpt.layout import Layout
from slurm_geo.ckpt.manifest import (
    SHARDED_FORMAT,
    BlobEntry,
    Manifest,
    Metadata,
    TensorEntry,
    check_metadata,
    manifest_to_json,
    parse_manifest,
)
from slurm_geo.ckpt.names import manifest_name
from slurm_geo.ckpt.repository import Repository, Tensor, add_tensor, check_tensors


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


def read_stored(repository: Repository, manifest: Manifest,
                paths: Collection[str]) -> Iterator[Tensor]:
    """The manifest's stored tensors named in `paths`, in manifest order, every chunk
    verified: what one rank of a load needs, and nothing else."""
    wanted = tuple(t for t in manifest.tensors if t.path in paths)
    return repository.read_tensors(replace(manifest, tensors=wanted))
