"""Push a torch.save file into a store and pull a checkpoint out as one, without torch.

Both stream: a push maps each tensor from the file only while the writer holds it; a pull
writes each chunk into the file as the reader verifies it, holding a few chunks and packs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from slurm_geo.ckpt.manifest import Manifest, Metadata
from slurm_geo.ckpt.reader import fetch_pool, ordered_map, prefetched, worker_pool
from slurm_geo.ckpt.repository import Repository
from slurm_geo.ckpt.skeleton import parse_skeleton
from slurm_geo.ckpt.tensorfile import ChunkFeed
from slurm_geo.ckpt.torchfile import read_torch_file, write_torch_file


def parent_step(steps: Sequence[int], step: int) -> int | None:
    """The run's checkpoint a push of `step` builds on: the latest one before it."""
    earlier = [s for s in steps if s < step]
    return max(earlier) if earlier else None


def push_torch_file(repository: Repository, path: Path, run: str, metadata: Metadata,
                    delta: bool = False,
                    on_bytes: Callable[[int, int], None] = lambda _d, _t: None,
                    ) -> tuple[Manifest, int]:
    """Save the file's state as `metadata.global_step` of `run`; the manifest and bytes.
    `on_bytes(done, total)` follows the tensors' bytes read from the file."""
    source = read_torch_file(path)
    parent = parent_step(repository.steps(run), metadata.global_step)
    manifest = repository.write_checkpoint(run, source.tensors, source.extra_state, metadata,
                                           parent=parent, delta=delta and parent is not None,
                                           on_bytes=on_bytes)
    return manifest, source.tensors.nbytes


def pull_torch_file(repository: Repository, run: str, step: int, path: Path,
                    on_bytes: Callable[[int, int], None] = lambda _d, _t: None) -> None:
    """Write checkpoint `step` of `run` as a torch.save file at `path` (via a temporary).
    `on_bytes(done, total)` follows the tensors' bytes written."""
    manifest = repository.manifest(run, step)
    state = parse_skeleton(repository.read_extra_state(run, step))
    partial = path.with_name(path.name + ".partial")
    try:
        with chunk_stream(repository, manifest) as chunks:
            write_torch_file(partial, state, manifest.tensors,
                             ChunkFeed(_counted(chunks, manifest, on_bytes)))
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


def _counted(chunks: Iterator[bytearray], manifest: Manifest,
             on_bytes: Callable[[int, int], None]) -> Iterator[bytearray]:
    """The chunks, each counted as it is handed to the file."""
    total, done = sum(ref.size for entry in manifest.tensors for ref in entry.chunks), 0
    for chunk in chunks:
        done += len(chunk)
        on_bytes(done, total)
        yield chunk


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
