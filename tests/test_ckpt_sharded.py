"""A multi-rank checkpoint (docs/format.md §7.5) downstream of its save: listing,
verification, promotion, retention, garbage collection, replication (the library's copy
and checkpoint-sync's attempt) and the reseal of markers treat it like any other.

The checkpoints are made as slurm_geo.torch.distributed makes them, without torch: the
coordinator's run key and push lock, each of two ranks' shards in its own packs
(`write_shards`), one commit (`commit_sharded`)."""

from __future__ import annotations

import os
import random
import struct
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
from test_sync_promotion import attempt_on

from slurm_geo.ckpt import LocalDirStore, Manifest, Metadata, Repository, Tensor, WriteOptions
from slurm_geo.ckpt.layout import Item, Layout, Shard
from slurm_geo.ckpt.locks import push_lock
from slurm_geo.ckpt.manifest import with_bases
from slurm_geo.ckpt.names import manifest_name, pack_name
from slurm_geo.ckpt.sharded import commit_sharded, read_stored, write_shards
from slurm_geo.sync.worker import Outcome

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
                      before_commit=lambda: None) -> Manifest:
    repository.create_run_key(RUN)
    with push_lock(repository.store, os.urandom, lambda: NOW):
        rank0 = write_shards(repository, RUN, [
            Tensor("w@0,0", "float32", (ROWS, COLUMNS), half(0, step, zeros))], parent)
        rank1 = write_shards(repository, RUN, [
            Tensor(f"w@{ROWS},0", "float32", (ROWS, COLUMNS), half(1, step, zeros)),
            Tensor("extra", "uint8", (len(EXTRA),), EXTRA)], parent)
        metadata = Metadata(step, step, 0, 0.5, "2026-11-29T12:00:00Z", cluster, "7")
        return commit_sharded(repository, RUN, rank0 + rank1, LAYOUT, metadata, parent,
                              before_commit)


def stored(repository: Repository, step: int) -> dict[str, bytes]:
    manifest = repository.manifest(RUN, step)
    return {t.path: bytes(t.data) for t in read_stored(repository, manifest,
                                                       {t.path for t in manifest.tensors})}


def expected(step: int, zeros: bool = False) -> dict[str, bytes]:
    return {"w@0,0": half(0, step, zeros), f"w@{ROWS},0": half(1, step, zeros),
            "extra": EXTRA}


def repo(tmp_path: Path, name: str = "store") -> tuple[LocalDirStore, Repository]:
    (tmp_path / name).mkdir(exist_ok=True)
    store = LocalDirStore(tmp_path / name)
    return store, Repository(store, KEY, OPTIONS, clock=lambda: NOW)


def packs_of(manifest: Manifest) -> set[str]:
    return {pack_name(r.pack) for r in with_bases(manifest.refs())}


def flip_a_bit(path: Path) -> bytes:
    original = path.read_bytes()
    damaged = bytearray(original)
    damaged[len(damaged) - 20] ^= 0x04  # inside the last entry's ciphertext
    path.write_bytes(bytes(damaged))
    return original


def slurm_geo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slurm_geo", *args], capture_output=True,
                          text=True, timeout=120, check=False, env=dict(os.environ))


@pytest.fixture
def key_file(tmp_path) -> Path:
    path = tmp_path / "master.key"
    path.write_bytes(KEY)
    path.chmod(0o600)
    return path


@pytest.mark.parametrize("zeros", [False, True])
def test_a_flipped_bit_in_any_ranks_pack_is_reported_naming_it(tmp_path, zeros):
    store, repository = repo(tmp_path)
    save_on_two_ranks(repository, 10, zeros=zeros)
    assert repository.verify(RUN, 10) == []

    for name in store.list("packs/"):
        original = flip_a_bit(tmp_path / "store" / name)
        assert [fault.name for fault in repository.verify(RUN, 10)] == [name]
        (tmp_path / "store" / name).write_bytes(original)


@pytest.mark.parametrize("rank", [0, 1])
def test_checkpoint_sync_finds_a_damaged_pack_of_either_rank(tmp_path, rank):
    home_store, home = repo(tmp_path, "home")
    away_store, _ = repo(tmp_path, "away")
    manifest = save_on_two_ranks(home, 10, zeros=True)
    damaged = pack_name(manifest.tensors[rank].chunks[0].pack)
    flip_a_bit(tmp_path / "home" / damaged)
    attempt, replica = attempt_on(tmp_path, home_store, away_store)

    result = attempt.run(replica)

    assert result.outcome is Outcome.CORRUPTED and damaged in result.detail
    assert not away_store.exists(manifest_name(RUN, 10))
