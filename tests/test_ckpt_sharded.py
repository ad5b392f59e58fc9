"""A multi-rank checkpoint (docs/format.md §7.5) downstream of its save: listing,
verification, promotion, retention, garbage collection, replication (the library's copy
and checkpoint-sync's attempt) and the reseal of markers treat it like any other.

The checkpoints are made as slurm_geo.torch.distributed makes them, without torch: the
coordinator's run key and push lock, each of two ranks' shards in its own packs
(`write_shards`), one commit (`commit_sharded`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_geo.ckpt import Manifest, Repository
from slurm_geo.ckpt.errors import ImmutableCheckpoint, StoreBusy
from slurm_geo.ckpt.format.manifest import SHARDED_FORMAT, with_bases
from slurm_geo.ckpt.format.names import manifest_name
from slurm_geo.ckpt.format.seal import Kind
from slurm_geo.ckpt.ops.gc import collect_garbage
from slurm_geo.ckpt.ops.prune import prune_run
from slurm_geo.ckpt.ops.replicate import copy_checkpoint
from slurm_geo.ckpt.ops.reseal import reseal
from slurm_geo.ckpt.repo.runkey import unwrap_run_key
from slurm_geo.policy.retention import RetentionPolicy
from slurm_geo.sync.worker import Outcome
from tests.helpers import stored_packs
from tests.kit.fence import legacy_seal
from tests.kit.sharded import (
    EXTRA,
    KEY,
    LAYOUT,
    NOW,
    ROWS,
    RUN,
    half,
    repo,
    save_on_two_ranks,
)
from tests.kit.sync import attempt_on


def stored(repository: Repository, step: int) -> dict[str, bytes]:
    return {t.path: bytes(t.data)
            for t in repository.read_tensors(repository.manifest(RUN, step))}


def expected(step: int, zeros: bool = False) -> dict[str, bytes]:
    return {"w@0,0": half(0, step, zeros), f"w@{ROWS},0": half(1, step, zeros),
            "extra": EXTRA}


def packs_of(manifest: Manifest) -> set[str]:
    return {manifest.pack_object(r.pack) for r in with_bases(manifest.refs())}


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


def test_each_rank_stores_its_own_packs_and_one_manifest_names_them_all(tmp_path):
    store, repository = repo(tmp_path)
    manifest = save_on_two_ranks(repository, 10)

    assert len(stored_packs(store)) == 2 and packs_of(manifest) == set(stored_packs(store))
    assert store.list("locks/") == []
    read = repository.manifest(RUN, 10)
    assert read.format == SHARDED_FORMAT and read.sharded == LAYOUT
    assert stored(repository, 10) == expected(10)
    assert repository.latest(RUN) == 10


@pytest.mark.parametrize("zeros", [False, True])
def test_a_flipped_bit_in_any_ranks_pack_is_reported_naming_it(tmp_path, zeros):
    store, repository = repo(tmp_path)
    save_on_two_ranks(repository, 10, zeros=zeros)
    assert repository.verify(RUN, 10) == []

    for name in stored_packs(store):
        original = flip_a_bit(tmp_path / "store" / name)
        assert [fault.name for fault in repository.verify(RUN, 10)] == [name]
        (tmp_path / "store" / name).write_bytes(original)


def test_ls_and_verify_through_the_cli(tmp_path, key_file):
    store, repository = repo(tmp_path)
    save_on_two_ranks(repository, 10)
    save_on_two_ranks(repository, 20, parent=10)
    url, key = f"file://{tmp_path / 'store'}", ("--key-file", str(key_file))

    listed = slurm_geo("ckpt", "ls", "--store", url, "--json", *key)
    assert listed.returncode == 0, listed.stderr
    assert [(r["run"], r["step"], r["latest"], r["cluster"]) for r in json.loads(listed.stdout)] \
        == [(RUN, 10, False, "onprem"), (RUN, 20, True, "onprem")]
    verified = slurm_geo("ckpt", "verify", RUN, "--store", url, *key)
    assert verified.returncode == 0, verified.stderr
    assert f"{RUN}@20: ok" in verified.stdout

    rank1_pack = next(iter(packs_of(repository.manifest(RUN, 20)) - packs_of(
        repository.manifest(RUN, 10))))
    flip_a_bit(tmp_path / "store" / rank1_pack)
    damaged = slurm_geo("ckpt", "verify", f"{RUN}@20", "--store", url, *key)
    assert damaged.returncode == 1
    assert rank1_pack in damaged.stderr and "Traceback" not in damaged.stderr


def test_a_promoted_multi_rank_checkpoint_is_neither_resaved_nor_deleted(tmp_path, key_file):
    _, repository = repo(tmp_path)
    save_on_two_ranks(repository, 10)
    promoted = slurm_geo("ckpt", "promote", f"{RUN}@10", "--store",
                         f"file://{tmp_path / 'store'}", "--key-file", str(key_file))
    assert promoted.returncode == 0, promoted.stderr

    assert repository.is_promoted(RUN, 10)
    with pytest.raises(ImmutableCheckpoint, match=manifest_name(RUN, 10)):
        save_on_two_ranks(repository, 10, zeros=True)
    with pytest.raises(ImmutableCheckpoint):
        repository.delete_checkpoint(RUN, 10)
    assert stored(repository, 10) == expected(10)


def test_retention_then_gc_keep_every_rank_of_what_they_keep(tmp_path):
    local_store, local = repo(tmp_path, "local")
    offsite_store, offsite = repo(tmp_path, "offsite")
    parent = None
    for step in (1, 2, 3, 4):
        save_on_two_ranks(local, step, parent)
        copy_checkpoint(local, local_store, offsite_store, RUN, step)
        parent = step

    report = prune_run(RUN, local, offsite, RetentionPolicy(keep_local=2), NOW)
    collected = collect_garbage(local_store, local, NOW)

    assert report.local_deleted == [2, 1] and local.steps(RUN) == [3, 4]
    kept = packs_of(local.manifest(RUN, 3)) | packs_of(local.manifest(RUN, 4))
    assert set(stored_packs(local_store)) == kept and collected.kept_packs == len(kept)
    assert collected.deleted_packs  # steps 1 and 2 held packs of their own
    for step in (3, 4):
        assert local.verify(RUN, step) == [] and stored(local, step) == expected(step)
    assert offsite.steps(RUN) == [1, 2, 3, 4]


def test_gc_waits_for_the_coordinators_push_lock_and_then_keeps_both_ranks(tmp_path):
    store, repository = repo(tmp_path)
    save_on_two_ranks(repository, 10)
    refused = []

    def collect_mid_save() -> None:  # both ranks have written; the manifest is not yet
        with pytest.raises(StoreBusy, match="locks/") as busy:
            collect_garbage(store, repository, NOW)
        refused.append(busy.value)

    repository.delete_checkpoint(RUN, 10)  # its packs are garbage now, step 20's are not
    save_on_two_ranks(repository, 20, before_commit=collect_mid_save)
    report = collect_garbage(store, repository, NOW)

    assert refused and store.list("locks/") == []
    assert set(stored_packs(store)) == packs_of(repository.manifest(RUN, 20))
    assert len(report.deleted_packs) == 2
    assert stored(repository, 20) == expected(20)


def test_a_copy_carries_every_ranks_packs_and_the_layout(tmp_path):
    source_store, source = repo(tmp_path, "src")
    destination_store, destination = repo(tmp_path, "dst")
    save_on_two_ranks(source, 10)
    save_on_two_ranks(source, 20, parent=10)

    first = copy_checkpoint(source, source_store, destination_store, RUN, 10)
    second = copy_checkpoint(source, source_store, destination_store, RUN, 20)

    assert first.packs_copied == 2 and second.packs_copied == 2
    assert destination.manifest(RUN, 20) == source.manifest(RUN, 20)
    assert destination.verify(RUN, 20) == [] and stored(destination, 20) == expected(20)
    assert destination.latest(RUN) == 20


def test_checkpoint_sync_replicates_and_verifies_it(tmp_path):
    home_store, home = repo(tmp_path, "home")
    away_store, away = repo(tmp_path, "away")
    save_on_two_ranks(home, 10)
    home.promote(RUN, 10)
    attempt, replica = attempt_on(tmp_path, home_store, away_store)

    assert attempt.run(replica).outcome is Outcome.VERIFIED
    assert away.manifest(RUN, 10).sharded == LAYOUT and away.is_promoted(RUN, 10)
    assert stored(away, 10) == expected(10)


@pytest.mark.parametrize("rank", [0, 1])
def test_checkpoint_sync_finds_a_damaged_pack_of_either_rank(tmp_path, rank):
    home_store, home = repo(tmp_path, "home")
    away_store, _ = repo(tmp_path, "away")
    manifest = save_on_two_ranks(home, 10, zeros=True)
    damaged = manifest.pack_object(manifest.tensors[rank].chunks[0].pack)
    flip_a_bit(tmp_path / "home" / damaged)
    attempt, replica = attempt_on(tmp_path, home_store, away_store)

    result = attempt.run(replica)

    assert result.outcome is Outcome.CORRUPTED and damaged in result.detail
    assert not away_store.exists(manifest_name(RUN, 10))


def test_reseal_carries_a_marker_and_leaves_the_manifest_and_its_layout(tmp_path):
    store, repository = repo(tmp_path)
    save_on_two_ranks(repository, 10)
    marker = "promoted/run/00000000000000000010"
    body = json.dumps({"run": RUN, "step": 10, "promoted_at": "2026-11-29T12:00:00+00:00"})
    data_key = unwrap_run_key(store, KEY, RUN)
    store.put(marker, legacy_seal(data_key, Kind.PROMOTED, body.encode(), marker))
    sealed_manifest = store.get(manifest_name(RUN, 10))

    report = reseal(store, KEY)

    assert report.resealed == [marker] and report.refused == {}
    assert repository.is_promoted(RUN, 10)
    assert store.get(manifest_name(RUN, 10)) == sealed_manifest
    assert repository.manifest(RUN, 10).sharded == LAYOUT
