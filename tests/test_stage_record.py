"""A run's world record (format.md §11.8): sealed under the run key, pinned snapshots."""

from __future__ import annotations

import os

import pytest

from slurm_geo.ckpt.errors import CorruptObject, WrongKey
from slurm_geo.ckpt.format.keys import RunKeyRing
from slurm_geo.ckpt.stores.store import LocalDirStore
from slurm_geo.stage.record import (
    PinnedTree,
    WorldRecord,
    read_world_record,
    world_record_name,
    write_world_record,
)

PIN = PinnedTree("input", "/home/alice/data", "a" * 32, "a" * 32, 3, "0" * 64)


def test_a_record_reads_back_under_the_run_key_and_names_each_root(tmp_path):
    store, ring = LocalDirStore(tmp_path), RunKeyRing.of(os.urandom(32))
    record = WorldRecord("run-1", (PIN,), 12.5)
    write_world_record(store, ring, record, os.urandom)
    assert read_world_record(store, ring, "run-1") == record
    assert read_world_record(store, ring, "run-2") is None
    assert record.pinned("/home/alice/data") == PIN and record.pinned("/x") is None


def test_another_runs_key_cannot_read_it_and_a_moved_record_is_refused(tmp_path):
    store, ring = LocalDirStore(tmp_path), RunKeyRing.of(os.urandom(32))
    write_world_record(store, ring, WorldRecord("run-1", (PIN,)), os.urandom)
    with pytest.raises(WrongKey):
        read_world_record(store, RunKeyRing.of(os.urandom(32)), "run-1")
    store.put(world_record_name("run-2"), store.get(world_record_name("run-1")))
    with pytest.raises(CorruptObject):  # the name is sealed in: no record moves runs
        read_world_record(store, ring, "run-2")


@pytest.mark.parametrize("bad", [
    PinnedTree("input", "relative/path", "a" * 32, "a" * 32, 1, "0" * 64),
    PinnedTree("input", "/p", "../x", "a" * 32, 1, "0" * 64),
    PinnedTree("input", "/p", "a" * 32, "a" * 32, 0, "0" * 64),
    PinnedTree("input", "/p", "a" * 32, "a" * 32, 1, "00"),
])
def test_a_record_with_a_bad_pin_reads_as_corrupt(tmp_path, bad):
    store, ring = LocalDirStore(tmp_path), RunKeyRing.of(os.urandom(32))
    write_world_record(store, ring, WorldRecord("run-1", (bad,)), os.urandom)
    with pytest.raises(CorruptObject):
        read_world_record(store, ring, "run-1")
