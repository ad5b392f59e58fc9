"""A checkpoint store with a few checkpoints of small weights, as the check and progress
tests read it."""

from __future__ import annotations

import random
from pathlib import Path

from slurm_geo.ckpt import LocalDirStore, Metadata, Repository, Tensor, WriteOptions
from tests.kit.sharded import save_on_two_ranks

KEY = bytes(range(32))
OPTIONS = WriteOptions(chunk_size=4096, pack_size=16 * 1024)
RUNS = ("alpha", "beta", "gamma")


def weights(seed: int, changed: int) -> list[Tensor]:
    """Two float32 tensors of three chunks; `changed` of the first's elements differ
    from seed 0's, so a series deduplicates and deltas."""
    rng = random.Random(0)
    base = bytearray(rng.randbytes(3 * 4096))
    for i in random.Random(seed).sample(range(0, len(base), 4), changed):
        base[i] ^= 0x5A
    return [Tensor("w", "float32", (3 * 1024,), bytes(base)),
            Tensor("frozen", "float32", (1024,), random.Random(99).randbytes(4096))]


def metadata(step: int) -> Metadata:
    return Metadata(step, step, 0, 0.5, "2026-12-04T12:00:00Z", "onprem", "7")


def site_store(root: Path) -> tuple[LocalDirStore, Repository]:
    """Three runs of three steps (dedup and deltas between steps) and a multi-rank run
    whose ranks each store an equal chunk."""
    root.mkdir()
    store = LocalDirStore(root)
    repository = Repository(store, KEY, OPTIONS)
    for r, run in enumerate(RUNS):
        for step in (1, 2, 3):
            repository.write_checkpoint(run, weights(step + 10 * r, 8 * step), b"{}",
                                        metadata(step), parent=step - 1 or None,
                                        delta=True, unchanged={"frozen"})
    save_on_two_ranks(repository, 5, zeros=True)
    return store, repository
