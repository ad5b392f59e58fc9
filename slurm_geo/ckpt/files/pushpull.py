"""Push a torch.save or safetensors file into a store and pull one out, without torch.

Both stream: a push maps each chunk from the file only while the writer holds it; a pull
writes each chunk into its place in the file as a worker verifies it, holding a few
chunks and packs.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from slurm_geo.ckpt.files.safetensors import (
    SUFFIX,
    held_part,
    is_safetensors_file,
    read_safetensors_file,
    write_safetensors_file,
)
from slurm_geo.ckpt.files.skeleton import parse_skeleton, tensor_paths
from slurm_geo.ckpt.files.tensorfile import TensorFile
from slurm_geo.ckpt.files.torchfile import read_torch_file, write_torch_file
from slurm_geo.ckpt.files.ziparchive import crc32_combine
from slurm_geo.ckpt.format.manifest import ChunkRef, Manifest, Metadata
from slurm_geo.ckpt.repo.reader import fetch_pool, ordered_map, prefetched, worker_pool
from slurm_geo.ckpt.repo.repository import Repository


def parent_step(steps: Sequence[int], step: int) -> int | None:
    """The run's checkpoint a push of `step` builds on: the latest one before it."""
    earlier = [s for s in steps if s < step]
    return max(earlier) if earlier else None


OnBytes = Callable[[int, int], None]  # (done, total)


def push_tensor_file(repository: Repository, path: Path, run: str, metadata: Metadata,
                     on_bytes: OnBytes = lambda _d, _t: None) -> tuple[Manifest, int]:
    """Save the file's state as `metadata.global_step` of `run`; the manifest and bytes.
    `on_bytes` follows the tensors' bytes read from the file.

    The run's previous step is the parent: unchanged chunks are stored once, and changed
    ones as deltas where the writer finds that deltas pay (`writer.DeltaProbe`)."""
    source = read_tensor_file(path)
    parent = parent_step(repository.steps(run), metadata.global_step)
    manifest = repository.write_checkpoint(run, source.tensors, source.extra_state, metadata,
                                           parent=parent, delta=parent is not None,
                                           on_bytes=on_bytes)
    return manifest, source.tensors.nbytes


def pull_tensor_file(repository: Repository, run: str, step: int, path: Path,
                     on_bytes: OnBytes = lambda _d, _t: None) -> list[str]:
    """Write checkpoint `step` of `run` at `path` (via a temporary): a safetensors file if
    its name ends in .safetensors, else a torch.save file. `on_bytes` follows the tensors'
    bytes written. The top-level entries of the state left out of the file (a safetensors
    file of a Checkpointer's state holds its model's weights only; `held_part`)."""
    manifest = repository.manifest(run, step)
    state = parse_skeleton(repository.read_extra_state(run, step))
    left_out: list[str] = []
    write = write_torch_file
    if path.suffix == SUFFIX:
        write = write_safetensors_file
        state, left_out = held_part(state)
        if left_out:
            held = set(tensor_paths(state))
            manifest = replace(manifest, tensors=tuple(t for t in manifest.tensors
                                                       if t.path in held))
    partial = path.with_name(path.name + ".partial")
    partial.unlink(missing_ok=True)  # a killed pull's; the writers create it anew
    try:
        write(partial, state, manifest.tensors, PlacedChunks(repository, manifest, on_bytes))
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)
    return left_out


def read_tensor_file(path: Path) -> TensorFile:
    """A safetensors file (by its header, or its suffix for the error), else torch.save."""
    if path.suffix == SUFFIX or is_safetensors_file(path):
        return read_safetensors_file(path)
    return read_torch_file(path)


class PlacedChunks:
    """Fills a file's tensors with a manifest's chunks: read, verified and written in place
    (`os.pwrite`) by worker threads, a window of chunks at a time; each tensor's CRC-32,
    combined from its chunks' (`ziparchive.Fill`)."""

    def __init__(self, repository: Repository, manifest: Manifest, on_bytes: OnBytes):
        self._repository, self._manifest, self._on_bytes = repository, manifest, on_bytes

    def __call__(self, fd: int, starts: Sequence[int]) -> list[int]:
        options = self._repository.options
        reader = self._repository.chunk_reader(self._manifest)
        jobs = [(ref, start + position, index)
                for index, (entry, start) in enumerate(zip(self._manifest.tensors, starts,
                                                           strict=True))
                for ref, position in _positions(entry.chunks)]

        def place(job: tuple[ChunkRef, int, int]) -> tuple[int, int, int]:
            ref, offset, index = job
            data = reader.read(ref)
            os.pwrite(fd, data, offset)
            return index, zlib.crc32(data), len(data)

        crcs: list[int | None] = [None] * len(starts)
        pool, fetcher = worker_pool(options.threads, "slurm-geo-read"), fetch_pool(options.threads)
        placed = ordered_map(place, prefetched(jobs, lambda job: job[0], reader, fetcher,
                                               options.window), pool, options.window)
        total, done = sum(ref.size for ref, _offset, _index in jobs), 0
        try:
            for index, crc, length in placed:
                done += length
                self._on_bytes(done, total)
                before = crcs[index]
                crcs[index] = crc if before is None else crc32_combine(before, crc, length)
        finally:
            placed.close()  # cancel the read-ahead before the pools wait for it
            pool.shutdown(wait=True)
            fetcher.shutdown(wait=True)
        return [0 if crc is None else crc for crc in crcs]  # None: an empty tensor


def _positions(chunks: Sequence[ChunkRef]) -> list[tuple[ChunkRef, int]]:
    position, placed = 0, []
    for ref in chunks:
        placed.append((ref, position))
        position += ref.size
    return placed
