"""Push a torch.save or safetensors file into a store and pull one out, without torch.

Both stream: a push maps each tensor from the file only while the writer holds it; a pull
writes each chunk into the file as the reader verifies it, holding a few chunks and packs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

from slurm_geo.ckpt.manifest import Manifest, Metadata
from slurm_geo.ckpt.reader import fetch_pool, ordered_map, prefetched, worker_pool
from slurm_geo.ckpt.repository import Repository
from slurm_geo.ckpt.safetensors import (
    SUFFIX,
    is_safetensors_file,
    read_safetensors_file,
    write_safetensors_file,
)
from slurm_geo.ckpt.skeleton import parse_skeleton
from slurm_geo.ckpt.tensorfile import ChunkFeed, TensorFile
from slurm_geo.ckpt.torchfile import read_torch_file, write_torch_file


def parent_step(steps: Sequence[int], step: int) -> int | None:
    """The run's checkpoint a push of `step` builds on: the latest one before it."""
    earlier = [s for s in steps if s < step]
    return max(earlier) if earlier else None


def push_tensor_file(repository: Repository, path: Path, run: str, metadata: Metadata
                    ) -> tuple[Manifest, int]:
    """Save the file's state as `metadata.global_step` of `run`; the manifest and bytes.

    The run's previous step is the parent: unchanged chunks are stored once, and changed
    ones as deltas where the writer finds that deltas pay (`writer.DeltaProbe`)."""
    source = read_tensor_file(path)
    parent = parent_step(repository.steps(run), metadata.global_step)
    manifest = repository.write_checkpoint(run, source.tensors, source.extra_state, metadata,
                                           parent=parent, delta=parent is not None)
    return manifest, source.tensors.nbytes


def pull_tensor_file(repository: Repository, run: str, step: int, path: Path) -> None:
    """Write checkpoint `step` of `run` at `path` (via a temporary): a safetensors file if
    its name ends in .safetensors, else a torch.save file."""
    manifest = repository.manifest(run, step)
    state = parse_skeleton(repository.read_extra_state(run, step))
    partial = path.with_name(path.name + ".partial")
    try:
        with chunk_stream(repository, manifest) as chunks:
            write = write_safetensors_file if path.suffix == SUFFIX else write_torch_file
            write(partial, state, manifest.tensors, ChunkFeed(chunks))
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


def read_tensor_file(path: Path) -> TensorFile:
    """A safetensors file (by its header, or its suffix for the error), else torch.save."""
    if path.suffix == SUFFIX or is_safetensors_file(path):
        return read_safetensors_file(path)
    return read_torch_file(path)


class chunk_stream:  # noqa: N801 - a context manager read as a function
    """Every chunk of the manifest's tensors, in order, verified, a window at a time."""

    def __init__(self, repository: Repository, manifest: Manifest):
        self._repository, self._manifest = repository, manifest

    def __enter__(self) -> Iterator[bytearray]:
        options = self._repository.options
        reader = self._repository.chunk_reader(self._manifest)
        self._pool = worker_pool(options.threads, "slurm-geo-read")
        self._fetcher = fetch_pool(options.threads)
        refs = [ref for entry in self._manifest.tensors for ref in entry.chunks]
        jobs = prefetched(refs, lambda ref: ref, reader, self._fetcher, options.window)
        self._chunks = ordered_map(reader.read, jobs, self._pool, options.window)
        return self._chunks

    def __exit__(self, *exc_info: object) -> None:
        self._chunks.close()  # cancel the read-ahead before the pools wait for it
        self._pool.shutdown(wait=True)
        self._fetcher.shutdown(wait=True)
