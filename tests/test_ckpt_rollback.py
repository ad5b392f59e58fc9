"""Rollback detection (docs/format.md §8.6): whoever controls a store deletes or replaces
a run's newest checkpoints; a reader that knows the run's high-water mark says so instead
of resuming from older data. The decision table, then the attack against a directory
store and the sandbox's S3 store, as the provider would make it."""

from __future__ import annotations

import struct

import pytest

from slurm_geo.ckpt import LocalDirStore, Metadata, Repository, Tensor, WriteOptions
from slurm_geo.ckpt.format.names import latest_name, manifest_name
from slurm_geo.ckpt.format.rollback import RolledBack, high_water, rollback

KEY = bytes(range(32))
OPTIONS = WriteOptions(chunk_size=4096, pack_size=16 * 1024)


@pytest.mark.parametrize("steps, mark, newest", [
    ([10, 20, 40], 40, None),      # the store holds the mark: no rollback
    ([10, 20, 40, 60], 40, None),  # and newer: saved since the mark was taken
    ([10, 20], 40, 20),            # the newest two deleted: rolled back to 20
    ([], 40, -1),                  # every checkpoint gone: rolled back to nothing
    ([10, 20], None, None),        # no mark known: nothing to compare with
    ([], None, None),
])
def test_when_a_store_has_rolled_a_run_back(steps, mark, newest):
    found = rollback("r", "offsite", steps, mark)
    if newest is None:
        assert found is None
        return
    assert isinstance(found, RolledBack) and found.high_water == mark
    assert found.newest == (None if newest == -1 else newest)
    assert found.exit_code == 35 and "\n" not in str(found)
    assert "rolled back" in str(found) and f"step {mark} was saved" in str(found)


@pytest.mark.parametrize("marks, expected", [
    ([None, None], None), ([40, None], 40), ([None, 60], 60), ([40, 60, 20], 60), ([], None),
])
def test_the_high_water_mark_is_the_newest_known(marks, expected):
    assert high_water(marks) == expected


def save(repository: Repository, step: int) -> None:
    data = struct.pack("<256f", *([float(step)] * 256))
    repository.write_checkpoint("r", [Tensor("w", "float32", (256,), data)], b"",
                                Metadata(step, step, 0, 1.0, "2026-12-01T00:00:00Z", "c", "1"),
                                parent=None)


def roll_back(store) -> int | None:
    """The store's controller: the newest manifest deleted, an older pointer put back."""
    old_pointer = store.get(latest_name("r"))  # as it stood after step 20
    repository = Repository(store, KEY, OPTIONS)
    save(repository, 40)
    mark = repository.latest("r")  # what the trusted side recorded: verified step 40
    store.delete(manifest_name("r", 40))
    store.put(latest_name("r"), old_pointer)
    return mark


def rollback_is_seen(store) -> None:
    repository = Repository(store, KEY, OPTIONS)
    save(repository, 10)
    save(repository, 20)
    mark = roll_back(store)
    before = {name: store.get(name) for name in store.list("")}
    assert repository.latest("r") == 20  # every object left opens: the store alone can't tell
    found = rollback("r", "offsite", repository.steps("r"), mark)
    assert found is not None and (found.newest, found.high_water) == (20, 40)
    assert {name: store.get(name) for name in store.list("")} == before  # nothing changed


def test_a_rolled_back_directory_store_is_seen(tmp_path):
    rollback_is_seen(LocalDirStore(tmp_path))


@pytest.mark.sandbox
def test_a_rolled_back_s3_store_is_seen(s3_store):
    rollback_is_seen(s3_store)
