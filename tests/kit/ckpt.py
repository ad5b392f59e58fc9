"""A repository with a few small checkpoints, as the gc, replicate and shared-store tests
write them."""

from __future__ import annotations

import random
import struct
from datetime import UTC, datetime

from slurm_geo.ckpt import LocalDirStore, Metadata, Repository, Tensor, WriteOptions

KEY = bytes(range(32))
OPTIONS = WriteOptions(chunk_size=4096, pack_size=16 * 1024)
NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def metadata(step: int) -> Metadata:
    return Metadata(step, step, 0, 1.0, "2026-11-29T12:00:00Z", "onprem", "1")


def tensors(seed: int) -> list[Tensor]:
    rng = random.Random(seed)
    data = struct.pack("<2048f", *(rng.gauss(0, 1) for _ in range(2048)))
    return [Tensor("w", "float32", (2048,), data)]


def repo(tmp_path, name="store", clock=lambda: NOW):
    root = tmp_path / name
    root.mkdir(exist_ok=True)
    store = LocalDirStore(root)
    return store, Repository(store, KEY, OPTIONS, clock=clock)
