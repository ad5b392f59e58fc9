"""Promotion (tier 3), garbage collection beside a concurrent push, and replication."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

from slurm_geo.ckpt import LocalDirStore, Repository, Tensor
from slurm_geo.ckpt.errors import ImmutableCheckpoint, StoreBusy
from slurm_geo.ckpt.ops.gc import collect_garbage
from slurm_geo.ckpt.ops.replicate import copy_checkpoint
from slurm_geo.ckpt.repo.locks import is_fresh, parse_lock, why_stale
from tests.helpers import stored_packs
from tests.kit.ckpt import KEY, NOW, OPTIONS, metadata, repo, tensors


def test_promoted_checkpoint_is_neither_overwritten_nor_deleted(tmp_path):
    _, repository = repo(tmp_path)
    repository.write_checkpoint("r", tensors(1), b"", metadata(10))
    repository.promote("r", 10)

    with pytest.raises(ImmutableCheckpoint, match="manifests/r/0*10"):
        repository.write_checkpoint("r", tensors(2), b"", metadata(10))
    with pytest.raises(ImmutableCheckpoint):
        repository.delete_checkpoint("r", 10)
    assert repository.read_checkpoint("r", 10).tensors == tensors(1)


def test_gc_drops_only_packs_of_deleted_checkpoints(tmp_path):
    store, repository = repo(tmp_path)
    for step in (1, 2, 3):
        repository.write_checkpoint("r", tensors(step), b"", metadata(step))
    repository.promote("r", 1)
    before = set(stored_packs(store))

    repository.delete_checkpoint("r", 2)
    report = collect_garbage(store, repository, NOW)

    assert report.deleted_packs and set(report.deleted_packs) < before
    assert set(stored_packs(store)) == before - set(report.deleted_packs)
    for step in (1, 3):
        assert repository.verify("r", step) == []
        assert repository.read_checkpoint("r", step).tensors == tensors(step)
    assert repository.latest("r") == 3


def test_gc_dry_run_deletes_nothing(tmp_path):
    store, repository = repo(tmp_path)
    repository.write_checkpoint("r", tensors(1), b"", metadata(1))
    repository.write_checkpoint("r", tensors(2), b"", metadata(2))
    repository.delete_checkpoint("r", 1)
    before = stored_packs(store)

    report = collect_garbage(store, repository, NOW, dry_run=True)

    assert report.deleted_packs
    assert stored_packs(store) == before


class PausingStore(LocalDirStore):
    """Blocks the first manifest put until released: a push caught mid-way."""

    def __init__(self, root):
        super().__init__(root)
        self.packs_written = threading.Event()
        self.release = threading.Event()

    def put(self, name, data):
        if name.startswith("manifests/") and not self.release.is_set():
            self.packs_written.set()
            self.release.wait(10)
        super().put(name, data)


def test_gc_refuses_while_a_push_is_in_flight_and_the_push_survives(tmp_path):
    (tmp_path / "s").mkdir()
    store = PausingStore(tmp_path / "s")
    repository = Repository(store, KEY, OPTIONS, clock=lambda: NOW)
    push = threading.Thread(
        target=repository.write_checkpoint, args=("r", tensors(1), b"", metadata(1)))
    push.start()
    assert store.packs_written.wait(10)

    with pytest.raises(StoreBusy, match="locks/"):
        collect_garbage(store, repository, NOW)

    store.release.set()
    push.join(10)
    assert repository.verify("r", 1) == []
    assert store.list("locks/") == []


def test_gc_removes_a_crashed_writers_stale_lock(tmp_path):
    store, repository = repo(tmp_path, clock=lambda: NOW - timedelta(days=2))
    store.put("locks/" + "ab" * 16, b'{"created_at": "2026-11-27T12:00:00+00:00"}')
    repository.write_checkpoint("r", tensors(1), b"", metadata(1))

    report = collect_garbage(store, repository, NOW)

    assert report.stale_locks_removed == ["locks/" + "ab" * 16]
    assert store.list("locks/") == []


LOCK = "locks/" + "cd" * 16


@pytest.mark.parametrize("body, fresh, said", [
    (b'{"created_at": "2026-11-29T11:00:00+00:00"}', True, None),        # a push an hour old
    (b'{"created_at": "2026-11-29T05:00:00+00:00"}', False, "did not finish"),  # 7 h: stale
    (b'{"created_at": "2026-11-29T12:00:30+00:00"}', True, None),        # a clock 30 s ahead
    (b'{"created_at": "9999-12-31T00:00:00+00:00"}', False, "ahead of this clock"),
    (b"\x00garbage", False, "not a push lock's"),
    (b"[1, 2]", False, "not a push lock's"),
    (b'{"created_at": 12}', False, "not a push lock's"),
    (b'{"created_at": "yesterday"}', False, "not a push lock's"),
    (b'{"host": "n1"}', False, "not a push lock's"),
    (b'{"created_at": "2026-11-29T11:00:00"}', False, "no time zone"),  # naive: no compare
])
def test_which_locks_gc_waits_for(body, fresh, said):
    lock = parse_lock(LOCK, body)
    assert is_fresh(lock, NOW) is fresh
    if said is not None:
        line = why_stale(lock, NOW)
        assert said in line and LOCK in line and "\n" not in line


def test_a_garbage_lock_never_blocks_gc_and_is_said_in_one_line(tmp_path):
    store, repository = repo(tmp_path)
    repository.write_checkpoint("r", tensors(1), b"", metadata(1))
    store.put(LOCK, b"\xff\xfe not json")
    store.put("packs/ee/" + "ee" * 32, b"unreferenced")

    report = collect_garbage(store, repository, NOW)

    assert report.stale_locks_removed == [LOCK]
    assert report.deleted_packs == ["packs/ee/" + "ee" * 32]
    assert len(report.notes) == 1 and "no push wrote it" in report.notes[0]
    assert store.list("locks/") == []


def test_a_fresh_lock_says_when_it_goes_stale(tmp_path):
    store, repository = repo(tmp_path)
    store.put(LOCK, b'{"created_at": "2026-11-29T11:00:00+00:00"}')
    with pytest.raises(StoreBusy, match=r"stale \(2026-11-29T17:00:00\+00:00\)"):
        collect_garbage(store, repository, NOW)


def test_copy_uploads_only_missing_packs_and_keeps_order(tmp_path):
    source_store, source = repo(tmp_path, "src")
    destination = repo(tmp_path, "dst")[0]
    source.write_checkpoint("r", tensors(1), b"", metadata(1))
    source.write_checkpoint("r", tensors(1) + [Tensor("b", "int64", (1,), b"\1" * 8)], b"",
                            metadata(2), parent=1)

    first = copy_checkpoint(source, source_store, destination, "r", 1)
    second = copy_checkpoint(source, source_store, destination, "r", 2)
    again = copy_checkpoint(source, source_store, destination, "r", 2)

    assert first.packs_copied >= 1 and first.packs_present == 0
    assert second.packs_present >= 1  # step 2 shares step 1's weights
    assert again.packs_copied == 0 and again.bytes_copied == 0
    replica = Repository(destination, KEY)
    assert replica.pointer("r") == 2  # written, not only inferred from the listing
    assert replica.verify("r", 2) == []
    assert replica.read_checkpoint("r", 2).tensors == source.read_checkpoint("r", 2).tensors


def test_copying_an_older_step_does_not_move_latest_back(tmp_path):
    source_store, source = repo(tmp_path, "src")
    destination = repo(tmp_path, "dst")[0]
    for step in (1, 2):
        source.write_checkpoint("r", tensors(step), b"", metadata(step))

    copy_checkpoint(source, source_store, destination, "r", 2)
    copy_checkpoint(source, source_store, destination, "r", 1)

    assert Repository(destination, KEY).latest("r") == 2


def test_runs_lists_every_run(tmp_path):
    _, repository = repo(tmp_path)
    for run in ("b", "a"):
        repository.write_checkpoint(run, tensors(1), b"", metadata(1))
    assert repository.runs() == ["a", "b"]
