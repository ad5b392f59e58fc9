"""Store conformance: every store passes the same tests; then LocalDirStore's own."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slurm_geo.ckpt.errors import ObjectMissing, StoreUnavailable, UnsafeObjectName
from slurm_geo.ckpt.stores.open_store import paced
from slurm_geo.ckpt.stores.retry import RetryingStore, is_permanent
from slurm_geo.ckpt.stores.store import LocalDirStore, Store

# The sandbox's S3 fixtures; each S3 test gets a fresh key prefix.


@pytest.fixture(params=[
    "local",
    pytest.param("s3", marks=pytest.mark.sandbox),
    pytest.param("s3-retrying", marks=pytest.mark.sandbox),  # what open_store gives for s3://
])
def store(request, tmp_path) -> Store:
    if request.param == "s3":
        return request.getfixturevalue("s3_store")
    if request.param == "s3-retrying":
        return RetryingStore(request.getfixturevalue("s3_store"))
    return LocalDirStore(tmp_path)


def test_put_get_replace_and_exists(store):
    assert not store.exists("keys/r")
    store.put("keys/r", b"one")
    assert store.get("keys/r") == b"one" and store.exists("keys/r")
    store.put("keys/r", memoryview(b"two"))
    assert store.get("keys/r") == b"two"
    store.put("empty", b"")
    assert store.get("empty") == b""


def test_getting_a_missing_object_says_so_by_name(store):
    with pytest.raises(ObjectMissing) as info:
        store.get("packs/ab/cd")
    assert info.value.name == "packs/ab/cd"


def test_a_local_store_reads_a_range_of_an_object(tmp_path):
    store = LocalDirStore(tmp_path)
    store.put("packs/ab/cd", bytes(range(100)))
    assert store.get_range("packs/ab/cd", 10, 5) == bytes(range(10, 15))
    assert store.get_range("packs/ab/cd", 95, 10) == bytes(range(95, 100))  # short at the end
    assert store.get_range("packs/ab/cd", 200, 10) == b""
    assert store.get_range("packs/ab/cd", 90, 1 << 50) == bytes(range(90, 100))  # no 1 PiB
    with pytest.raises(ObjectMissing) as info:
        store.get_range("packs/ab/ef", 0, 10)
    assert info.value.name == "packs/ab/ef"
    with pytest.raises(UnsafeObjectName):
        store.get_range("../outside", 0, 10)


def test_delete_is_idempotent(store):
    store.put("a/b", b"x")
    store.delete("a/b")
    store.delete("a/b")
    store.delete("never/was")
    assert not store.exists("a/b")


def test_list_returns_sorted_names_under_a_prefix(store):
    for name in ["manifests/r/2", "manifests/r/10", "manifests/r2/1", "latest/r", "keys/r"]:
        store.put(name, b"x")
    assert store.list("manifests/r/") == ["manifests/r/10", "manifests/r/2"]
    assert store.list("manifests/r") == ["manifests/r/10", "manifests/r/2", "manifests/r2/1"]
    assert store.list("") == sorted(["manifests/r/2", "manifests/r/10", "manifests/r2/1",
                                     "latest/r", "keys/r"])
    assert store.list("nothing/here/") == []


def test_sizes_come_with_the_names_under_a_prefix(store):
    store.put("packs/ab/ab1", b"x" * 7)
    store.put("packs/cd/cd2", b"")
    store.put("keys/r", b"key")
    assert store.sizes("packs/") == {"packs/ab/ab1": 7, "packs/cd/cd2": 0}
    assert store.sizes("nothing/") == {}


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a/../../x", ".hidden", "a//b", "a b"])
@pytest.mark.parametrize("operation", ["put", "get", "delete", "exists"])
def test_names_that_could_escape_are_refused(store, name, operation):
    args = (name, b"x") if operation == "put" else (name,)
    with pytest.raises(UnsafeObjectName):
        getattr(store, operation)(*args)


def test_listing_outside_the_store_is_refused(store):
    with pytest.raises(UnsafeObjectName):
        store.list("../")


def test_a_symlink_out_of_the_root_is_refused(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "packs").symlink_to(outside)
    store = LocalDirStore(root)
    with pytest.raises(UnsafeObjectName, match="symbolic link"):
        store.put("packs/x", b"x")
    assert list(outside.iterdir()) == []


def test_a_missing_root_is_unavailable(tmp_path):
    with pytest.raises(StoreUnavailable):
        LocalDirStore(tmp_path / "absent")


def test_io_failure_is_unavailable(tmp_path):
    store = LocalDirStore(tmp_path)
    store.put("a", b"file, not a directory")
    with pytest.raises(StoreUnavailable) as info:
        store.put("a/b", b"x")
    assert info.value.name == "a/b"


def test_a_crash_before_rename_keeps_the_old_object_and_hides_the_temp_file(tmp_path, monkeypatch):
    store = LocalDirStore(tmp_path)
    store.put("manifests/r/1", b"old")

    def crash(_src, _dst, **_dirs):
        raise KeyboardInterrupt  # stands for the process dying between write and rename

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        store.put("manifests/r/1", b"new")
    monkeypatch.undo()
    assert store.get("manifests/r/1") == b"old"
    Path(tmp_path, "manifests/r/.1.leftover.tmp").write_bytes(b"half")
    assert store.list("manifests/") == ["manifests/r/1"]


def test_objects_are_plain_files_under_the_root(tmp_path):
    LocalDirStore(tmp_path).put("packs/ab/cd", b"bytes")
    assert (tmp_path / "packs" / "ab" / "cd").read_bytes() == b"bytes"


@pytest.mark.parametrize("root_mode, expected", [
    (0o1777, 0o1777),  # a site filesystem every user's jobs write into
    (0o2770, 0o3770),  # shared with one group (sticky: no member removes another's)
    (0o755, None),     # one writer's own store: the umask decides, as always
])
def test_a_shared_stores_new_directories_take_the_roots_permissions(tmp_path, root_mode,
                                                                    expected):
    """Else the first user to checkpoint under packs/ab/ would lock every other user's
    job out of that prefix."""
    root = tmp_path / "pfs"
    root.mkdir()
    root.chmod(root_mode)
    old = os.umask(0o077)
    try:
        LocalDirStore(root).put("packs/ab/abcdef", b"x")
    finally:
        os.umask(old)
    for created in (root / "packs", root / "packs" / "ab"):
        mode = created.stat().st_mode & 0o7777
        assert mode == (expected if expected is not None else 0o700)
    # Objects are readable by those the store is shared with (the daemons copy a run back
    # for its owner's job), never writable by them.
    obj = (root / "packs" / "ab" / "abcdef").stat().st_mode & 0o777
    assert obj == ({0o1777: 0o644, 0o2770: 0o640}.get(root_mode, 0o600))


@pytest.mark.parametrize("kwargs, permanent, side", [
    ({}, False, None),
    ({"permanent": True}, True, None),
    ({"side": "source"}, False, "source"),
])
def test_an_unavailable_store_says_whether_retrying_helps_and_which_side_is_out(
        kwargs, permanent, side):
    exc = StoreUnavailable("packs/ab", "down", **kwargs)
    assert (exc.permanent, exc.side, is_permanent(exc)) == (permanent, side, permanent)


def test_a_paced_store_tags_a_failure_with_its_side(tmp_path):
    store = paced(LocalDirStore(tmp_path), "destination")
    store.put("a", b"file, not a directory")
    with pytest.raises(StoreUnavailable) as info:
        store.put("a/b", b"x")
    assert info.value.side == "destination" and not info.value.permanent
