"""Copying a staged tree's snapshot to another store (slurm_geo.stage.replicate; issue 31,
item 2: a job's world crosses to each eligible site's store as ciphertext, then verifies
there): byte-identical once materialised at the destination, nothing sent twice, an
incremental snapshot sends its new packs only, and a copy cut short commits nothing."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from slurm_geo.ckpt.errors import ObjectMissing
from slurm_geo.ckpt.format.keys import KeyFile
from slurm_geo.ckpt.stores.store import LocalDirStore
from slurm_geo.stage.keys import MasterTreeKeys
from slurm_geo.stage.names import snapshot_name, tree_latest_name
from slurm_geo.stage.replicate import copy_snapshot
from slurm_geo.stage.trees import Trees
from slurm_geo.stage.walk import LocalOpener
from tests.kit.trees import MASTER, OPTIONS, CountingStore, listing, write_tree


def stores(tmp_path: Path) -> tuple[CountingStore, CountingStore]:
    for name in ("home", "away"):
        (tmp_path / name).mkdir()
    return CountingStore(tmp_path / "home"), CountingStore(tmp_path / "away")


def trees(store: LocalDirStore) -> Trees:
    return Trees(store, MasterTreeKeys(store, KeyFile(MASTER)), OPTIONS)


def dataset(root: Path, seed: int = 0) -> Path:
    files = {f"shard-{i}.bin": random.Random(seed + i).randbytes(200_000) for i in range(3)}
    return write_tree(root, {**files, "meta/info.txt": b"tokens\n", "latest": "->shard-0.bin"})


def copy(home: CountingStore, away: CountingStore, tree: str, snapshot: int):
    return copy_snapshot(trees(home), home, away, MasterTreeKeys(away, KeyFile(MASTER)),
                         tree, snapshot)


def test_a_copied_snapshot_materialises_byte_identical_at_the_destination(tmp_path):
    home, away = stores(tmp_path)
    source = dataset(tmp_path / "data")
    staged = trees(home).stage("ds", LocalOpener(source), f"home:{source}")
    report = copy(home, away, "ds", staged.manifest.snapshot)
    assert report.packs_copied >= 1 and report.packs_present == 0 and report.latest_moved
    there = trees(away)
    assert there.latest("ds") == staged.manifest.snapshot
    there.verify("ds", staged.manifest.snapshot)
    there.materialise("ds", staged.manifest.snapshot, tmp_path / "out")
    assert {k: v[:3] for k, v in listing(tmp_path / "out").items()} == \
        {k: v[:3] for k, v in listing(source).items()}


def test_a_second_copy_sends_nothing_and_a_changed_file_sends_its_new_packs_only(tmp_path):
    home, away = stores(tmp_path)
    source = dataset(tmp_path / "data")
    first = trees(home).stage("ds", LocalOpener(source), f"home:{source}").manifest.snapshot
    copy(home, away, "ds", first)
    away.counted()
    again = copy(home, away, "ds", first)
    assert (again.packs_copied, again.bytes_copied, again.latest_moved) == (0, 0, False)
    assert away.counted() == 0
    with open(source / "shard-1.bin", "r+b") as handle:  # 1 KB changed in place
        handle.seek(50_000)
        handle.write(b"\xff" * 1024)
    home.counted()
    second = trees(home).stage("ds", LocalOpener(source), f"home:{source}").manifest.snapshot
    stored_at_home = home.counted()
    report = copy(home, away, "ds", second)
    assert report.packs_present >= 1 and report.latest_moved
    assert report.bytes_copied <= stored_at_home  # what staging stored, not the tree again
    trees(away).verify("ds", second)


def test_packs_a_listing_showed_at_the_destination_are_not_asked_for_again(tmp_path):
    home, away = stores(tmp_path)
    source = dataset(tmp_path / "data")
    first = trees(home).stage("ds", LocalOpener(source), f"home:{source}").manifest.snapshot
    copy(home, away, "ds", first)
    there = set(away.list("tree-packs/"))
    asked: list[str] = []
    original = away.exists

    def exists(name: str) -> bool:
        asked.append(name)
        return original(name)
    away.exists = exists  # type: ignore[method-assign]
    report = copy_snapshot(trees(home), home, away, MasterTreeKeys(away, KeyFile(MASTER)),
                           "ds", first, present=there)
    assert (report.packs_copied, report.packs_present) == (0, len(there))
    assert not [n for n in asked if n.startswith("tree-packs/")]


def test_a_copy_cut_before_its_manifest_commits_no_snapshot(tmp_path, monkeypatch):
    home, away = stores(tmp_path)
    source = dataset(tmp_path / "data")
    snapshot = trees(home).stage("ds", LocalOpener(source), f"home:{source}").manifest.snapshot

    class Cut(Exception):
        pass
    real_put = away.put

    def put(name, data):
        if name == snapshot_name("ds", snapshot):
            raise Cut(name)
        real_put(name, data)
    monkeypatch.setattr(away, "put", put)
    with pytest.raises(Cut):
        copy(home, away, "ds", snapshot)
    assert trees(away).snapshots("ds") == [] and trees(away).latest("ds") is None
    monkeypatch.setattr(away, "put", real_put)
    finished = copy(home, away, "ds", snapshot)
    assert finished.packs_copied == 0 and finished.packs_present >= 1  # resumed, not resent
    trees(away).verify("ds", snapshot)


def test_an_older_snapshot_copied_after_a_newer_leaves_the_latest_pointer(tmp_path):
    home, away = stores(tmp_path)
    source = dataset(tmp_path / "data")
    first = trees(home).stage("ds", LocalOpener(source), f"home:{source}").manifest.snapshot
    (source / "meta" / "info.txt").write_bytes(b"tokens, v2\n")
    second = trees(home).stage("ds", LocalOpener(source), f"home:{source}").manifest.snapshot
    copy(home, away, "ds", second)
    older = copy(home, away, "ds", first)
    assert not older.latest_moved and trees(away).latest("ds") == second


def test_a_snapshot_that_does_not_open_is_never_copied(tmp_path):
    home, away = stores(tmp_path)
    with pytest.raises(ObjectMissing):
        copy(home, away, "ds", 1)
    assert not away.exists(tree_latest_name("ds"))
