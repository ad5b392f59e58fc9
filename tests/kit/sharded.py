"""Sharded checkpoints made as slurm_geo.torch.distributed makes them, without torch: two
ranks each writing its half (the sharded, check, DCP-pull and safetensors tests use them)."""

from __future__ import annotations

import os
import random
import struct
from datetime import UTC, datetime
from pathlib import Path

from slurm_geo.ckpt import LocalDirStore, Manifest, Metadata, Repository, Tensor, WriteOptions
from slurm_geo.ckpt.format.layout import Item, Layout, Shard
from slurm_geo.ckpt.repo.locks import push_lock
from slurm_geo.ckpt.repo.sharded import commit_sharded, write_shards

KEY = bytes(range(32))
OPTIONS = WriteOptions(chunk_size=4096, pack_size=16 * 1024)
NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
RUN = "run"
ROWS, COLUMNS = 64, 32  # one rank's half of "w": 8 KiB, two chunks
EXTRA = b"pickled non-tensor state"
LAYOUT = Layout(
    items=(Item("w", "tensor", "float32", (2 * ROWS, COLUMNS), False,
                (Shard((0, 0), (ROWS, COLUMNS), "w@0,0"),
                 Shard((ROWS, 0), (ROWS, COLUMNS), f"w@{ROWS},0"))),
           Item("extra", "bytes", tensor="extra")),
    planner_data={"w": ["w"], "extra": ["extra"]}, dcp_version="1.0.0", ranks=2)


def half(rank: int, step: int, zeros: bool) -> bytes:
    if zeros:  # as optimizer moments start: both ranks store an equal chunk, each its own
        return bytes(ROWS * COLUMNS * 4)
    rng = random.Random(step * 10 + rank)
    return struct.pack(f"<{ROWS * COLUMNS}f", *(rng.gauss(0, 1) for _ in range(ROWS * COLUMNS)))


def save_on_two_ranks(repository: Repository, step: int, parent: int | None = None,
                      zeros: bool = False, cluster: str = "onprem",
                      before_commit=lambda: None, extra: bytes = EXTRA) -> Manifest:
    repository.create_run_key(RUN)
    with push_lock(repository.store, os.urandom, lambda: NOW):
        rank0 = write_shards(repository, RUN, [
            Tensor("w@0,0", "float32", (ROWS, COLUMNS), half(0, step, zeros))], parent)
        rank1 = write_shards(repository, RUN, [
            Tensor(f"w@{ROWS},0", "float32", (ROWS, COLUMNS), half(1, step, zeros)),
            Tensor("extra", "uint8", (len(extra),), extra)], parent)
        metadata = Metadata(step, step, 0, 0.5, "2026-11-29T12:00:00Z", cluster, "7")
        return commit_sharded(repository, RUN, rank0 + rank1, LAYOUT, metadata, parent,
                              before_commit)


def repo(tmp_path: Path, name: str = "store") -> tuple[LocalDirStore, Repository]:
    (tmp_path / name).mkdir(exist_ok=True)
    store = LocalDirStore(tmp_path / name)
    return store, Repository(store, KEY, OPTIONS, clock=lambda: NOW)
