"""Staged trees (issue 31; docs/format.md §11): the format and library, on small temp trees.

Round trips byte for byte with modes and links; what a second snapshot, a changed file and
a second stager store (counted at the store); corrupted packs and manifests refused by
name; links never followed at snapshot or materialise; one tree's key opens that tree only.
"""

from __future__ import annotations

import io
import json
import os
import stat
from pathlib import Path

import pytest

from slurm_geo.ckpt.errors import CorruptObject, ObjectMissing, UnsafeObjectName, WrongKey
from slurm_geo.ckpt.format.chunking import CdcParams, content_defined_chunks
from slurm_geo.ckpt.format.keys import KeyFile
from slurm_geo.ckpt.format.seal import Kind, seal
from slurm_geo.ckpt.stores.store import LocalDirStore
from slurm_geo.stage.cdc import stream_chunks
from slurm_geo.stage.keys import GivenTreeKeys, MasterTreeKeys, NoTreeKey
from slurm_geo.stage.manifest import parse_tree
from slurm_geo.stage.materialise import StageTargetError
from slurm_geo.stage.names import (
    snapshot_name,
    tree_id,
    tree_key_name,
    tree_latest_name,
    tree_naming_key,
)
from slurm_geo.stage.trees import Trees
from slurm_geo.stage.walk import LocalOpener, StageSourceError
from tests.helpers import as_uid, reachable_dir
from tests.kit.trees import MASTER, OPTIONS, SMALL, CountingStore, listing, write_tree


@pytest.fixture
def store(tmp_path: Path) -> CountingStore:
    (tmp_path / "store").mkdir()
    return CountingStore(tmp_path / "store")


def trees_of(store: LocalDirStore) -> Trees:
    return Trees(store, MasterTreeKeys(store, KeyFile(MASTER)), OPTIONS)


# --- content-defined cuts ---------------------------------------------------------------

@pytest.mark.parametrize("params", [SMALL, CdcParams(min_size=256, mask_bits=8, max_size=2048),
                                    CdcParams(min_size=64, mask_bits=1, max_size=64)])
@pytest.mark.parametrize("length", [0, 1, 63, 5000, 70000, 300001])
def test_vectorised_cuts_are_the_specified_ones(params, length):
    data = os.urandom(length)
    expected = [bytes(c) for c in content_defined_chunks(memoryview(data), params)]
    assert list(stream_chunks(io.BytesIO(data).read, params)) == expected


# --- round trips ------------------------------------------------------------------------

ROUND_TRIPS = {
    "files, modes, links, empty": (
        {"a.txt": b"hello", "empty": b"", "bin/run": b"#!/bin/sh\necho hi\n",
         "deep/er/still/x.bin": os.urandom(200_000), "emptydir/": b"",
         "rel": "->deep/er", "abs": "->/etc/passwd", "dangling": "->nowhere/at/all",
         "ro/": b"", "ro/f": b"read only"},
        {"a.txt": 0o640, "bin/run": 0o755, "deep": 0o750, "ro/f": 0o444, "ro": 0o555}),
    "setuid and setgid dropped, sticky kept": (
        {"suid": b"x", "sgid/": b"", "sticky/": b""},
        {"suid": 0o4755, "sgid": 0o2775, "sticky": 0o1777}),
    "names that are not UTF-8": ({os.fsdecode(b"caf\xe9.txt"): b"latin-1 name"}, {}),
}


@pytest.mark.parametrize("case", ROUND_TRIPS)
def test_a_tree_comes_back_byte_identical(store, tmp_path, case):
    files, modes = ROUND_TRIPS[case]
    source = write_tree(tmp_path / "src", files, modes)
    trees = trees_of(store)
    staged = trees.stage("t", LocalOpener(source), f"home:{source}")
    assert staged.new and staged.manifest.snapshot == 1 and trees.latest("t") == 1
    result = trees.materialise("t", 1, tmp_path / "out")
    expected = listing(source)
    for path, info in expected.items():
        if info[0] != "link":  # setuid and setgid are never stored
            expected[path] = (info[0], info[1] & 0o1777, *info[2:])
    assert listing(tmp_path / "out") == expected
    out = os.stat(tmp_path / "out")
    assert stat.S_IMODE(out.st_mode) == stat.S_IMODE(os.stat(source).st_mode)
    assert result.files == sum(1 for i in expected.values() if i[0] == "file")
    assert trees.verify("t", 1).chunks == len({r.id for r in staged.manifest.refs()})


def test_one_file_is_a_tree_too(store, tmp_path):
    image = tmp_path / "image.sqsh"
    image.write_bytes(os.urandom(300_000))
    os.chmod(image, 0o600)
    trees = trees_of(store)
    trees.stage("img", LocalOpener(image), f"home:{image}")
    trees.materialise("img", 1, tmp_path / "copy.sqsh")
    assert (tmp_path / "copy.sqsh").read_bytes() == image.read_bytes()
    assert stat.S_IMODE(os.stat(tmp_path / "copy.sqsh").st_mode) == 0o600


def test_materialise_never_replaces_a_target(store, tmp_path):
    source = write_tree(tmp_path / "src", {"a": b"1"})
    trees = trees_of(store)
    trees.stage("t", LocalOpener(source), "home:src")
    (tmp_path / "taken").mkdir()
    os.symlink(tmp_path / "taken", tmp_path / "link")
    for target in ("taken", "link"):
        with pytest.raises(StageTargetError, match="exists"):
            trees.materialise("t", 1, tmp_path / target)
    assert list((tmp_path / "taken").iterdir()) == []


# --- what is stored ---------------------------------------------------------------------

def test_an_unchanged_tree_stores_nothing_and_reads_nothing(store, tmp_path):
    source = write_tree(tmp_path / "src", {f"d{i}/f{j}": os.urandom(10_000)
                                            for i in range(3) for j in range(4)})
    trees = trees_of(store)
    first = trees.stage("t", LocalOpener(source), "home:src")
    assert store.counted() > 120_000
    again = trees.stage("t", LocalOpener(source), "home:src")
    assert (again.new, again.stored_bytes, store.counted()) == (False, 0, 0)
    assert (again.files_read, again.files_reused) == (0, 12)
    assert again.manifest == first.manifest and trees.snapshots("t") == [1]


def test_one_changed_file_stores_about_its_changed_chunks(store, tmp_path):
    big = os.urandom(4_000_000)
    source = write_tree(tmp_path / "src", {"big.bin": big, **{f"small{i}": os.urandom(50_000)
                                                               for i in range(20)}})
    trees = trees_of(store)
    trees.stage("t", LocalOpener(source), "home:src")
    whole = store.counted()
    changed = bytearray(big)
    changed[2_000_000:2_000_100] = os.urandom(100)  # in place: the other cuts stay
    (source / "big.bin").write_bytes(changed)
    staged = trees.stage("t", LocalOpener(source), "home:src")
    stored = store.counted()
    assert staged.new and staged.manifest.snapshot == 2 and staged.manifest.parent == 1
    assert (staged.files_read, staged.files_reused) == (1, 20)
    # At most the two chunks around the change (64 KiB each at most), the manifest, pointer.
    assert stored < 2 * SMALL.max_size + 20_000 < whole / 30
    trees.materialise("t", 2, tmp_path / "v2")
    trees.materialise("t", 1, tmp_path / "v1")
    assert (tmp_path / "v2/big.bin").read_bytes() == bytes(changed)
    assert (tmp_path / "v1/big.bin").read_bytes() == big  # snapshot 1 is as it was


def test_the_same_content_under_new_inodes_stores_no_chunk(store, tmp_path):
    files = {f"f{i}": os.urandom(30_000) for i in range(5)}
    source = write_tree(tmp_path / "src", files)
    trees = trees_of(store)
    trees.stage("t", LocalOpener(source), "home:src")
    store.counted()
    for name in files:  # rewritten: new inode, new times, same bytes
        path = source / name
        path.unlink()
        path.write_bytes(files[name])
    staged = trees.stage("t", LocalOpener(source), "home:src")
    assert staged.files_read == 5 and staged.new
    assert not [n for n in store.puts if n.startswith("tree-packs/")]
    assert set(store.puts) == {snapshot_name("t", 2), tree_latest_name("t")}


@pytest.fixture
def shared_tmp():
    """A directory every user may reach (pytest's tmp_path is root's alone)."""
    with reachable_dir("stage") as path:
        yield path


@pytest.mark.root(reason="runs as other users or in namespaces (failed as nobody)")
def test_a_second_user_staging_the_same_root_stores_nothing(shared_tmp):
    """As a second job (bob's) on alice's dataset: the same label, so the same tree id and
    key; the stager opens the store anew in another process, running as bob."""
    tmp_path = shared_tmp
    (tmp_path / "store").mkdir()
    os.chmod(tmp_path / "store", 0o1777)  # shared: objects readable, bob may add his own
    data = write_tree(tmp_path / "alice-data", {f"shard{i}.bin": os.urandom(60_000)
                                                for i in range(4)})
    os.system(f"chmod -R a+rX {data}")
    label = f"home:{data}"
    tree = tree_id(tree_naming_key(MASTER), label)
    first = trees_of(CountingStore(tmp_path / "store")).stage(tree, LocalOpener(data), label)
    assert first.stored_bytes > 240_000

    def as_bob() -> None:
        store = CountingStore(tmp_path / "store")
        tree_again = tree_id(tree_naming_key(MASTER), label)
        staged = trees_of(store).stage(tree_again, LocalOpener(data), label)
        assert (tree_again, staged.new, staged.stored_bytes, store.puts) == (tree, False, 0, {})
        trees_of(store).verify(tree_again, 1)

    assert as_uid(2002, as_bob) == "ok"


def test_snapshots_are_numbered_and_never_rewritten(store, tmp_path):
    source = write_tree(tmp_path / "src", {"a": b"1"})
    trees = trees_of(store)
    for content in (b"2", b"3"):
        trees.stage("t", LocalOpener(source), "home:src")
        (source / "a").write_bytes(content)
    trees.stage("t", LocalOpener(source), "home:src")
    assert trees.snapshots("t") == [1, 2, 3] and trees.latest("t") == 3
    assert [trees.manifest("t", n).parent for n in (1, 2, 3)] == [None, 1, 2]


# --- damage is refused, by name ---------------------------------------------------------

def flip(store: LocalDirStore, name: str, at: int = -20) -> None:
    path = store.root / name
    data = bytearray(path.read_bytes())
    data[at] ^= 1
    path.write_bytes(data)


@pytest.mark.parametrize(("damaged", "operation"), [
    ("pack", "materialise"), ("pack", "verify"), ("manifest", "materialise"),
    ("manifest", "verify"), ("latest", "latest")])
def test_a_corrupted_object_is_refused_by_name(store, tmp_path, damaged, operation):
    source = write_tree(tmp_path / "src", {"x.bin": os.urandom(100_000), "y": b"why"})
    trees = trees_of(store)
    trees.stage("t", LocalOpener(source), "home:src")
    name = {"pack": store.list("tree-packs/")[0], "manifest": snapshot_name("t", 1),
            "latest": tree_latest_name("t")}[damaged]
    flip(store, name)
    with pytest.raises(CorruptObject) as caught:
        if operation == "latest":
            trees.latest("t")
        elif operation == "materialise":
            trees.materialise("t", 1, tmp_path / "out")
        else:
            trees.verify("t", 1)
    assert caught.value.name == name
    assert not os.path.lexists(tmp_path / "out")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


FORGED = {
    "a file under a link": [{"path": ".", "type": "dir", "mode": 493, "mtime_ns": 0},
                            {"path": "l", "type": "symlink", "target": "/etc", "mtime_ns": 0},
                            {"path": "l/passwd", "type": "file", "mode": 420, "mtime_ns": 0,
                             "size": 0, "ino": 0, "ctime_ns": 0, "chunks": []}],
    "a path leaving the tree": [{"path": ".", "type": "dir", "mode": 493, "mtime_ns": 0},
                                {"path": "../x", "type": "dir", "mode": 493, "mtime_ns": 0}],
    "setuid": [{"path": ".", "type": "file", "mode": 0o4755, "mtime_ns": 0, "size": 0,
                "ino": 0, "ctime_ns": 0, "chunks": []}],
    "a root that is a link": [{"path": ".", "type": "symlink", "target": "/", "mtime_ns": 0}],
    "a size its chunks do not make": [{"path": ".", "type": "file", "mode": 420, "mtime_ns": 0,
                                       "size": 5, "ino": 0, "ctime_ns": 0, "chunks": []}],
}


@pytest.mark.parametrize("case", FORGED)
def test_a_manifest_breaking_a_rule_is_corrupt(case):
    import zstandard
    document = {"format": 1, "tree": "t", "domain": "t", "snapshot": 1, "parent": None,
                "created_at": "2026-01-01T00:00:00+00:00", "source": "x",
                "chunking": {"min_size": 4096, "mask_bits": 13, "max_size": 65536},
                "packs": [], "entries": FORGED[case]}
    payload = zstandard.ZstdCompressor().compress(json.dumps(document).encode())
    with pytest.raises(CorruptObject, match="trees/t/1"):
        parse_tree(payload, "trees/t/1", "t", 1)


# --- links are never followed -----------------------------------------------------------

def test_a_link_out_of_the_root_is_stored_as_a_link(store, tmp_path):
    secret = write_tree(tmp_path / "outside", {"secret": b"not part of the tree"})
    source = write_tree(tmp_path / "src", {"to-dir": f"->{secret}",
                                            "to-file": f"->{secret}/secret", "ok": b"fine"})
    trees = trees_of(store)
    staged = trees.stage("t", LocalOpener(source), "home:src")
    assert {e.path: (e.type, e.target) for e in staged.manifest.entries} == {
        ".": ("dir", None), "ok": ("file", None),
        "to-dir": ("symlink", str(secret)), "to-file": ("symlink", f"{secret}/secret")}
    assert staged.bytes_read == 4  # "fine": nothing of outside/ was read
    trees.materialise("t", 1, tmp_path / "out")
    assert os.readlink(tmp_path / "out/to-dir") == str(secret)
    assert (secret / "secret").read_bytes() == b"not part of the tree"
    with pytest.raises(StageSourceError, match="symbolic link"):
        trees.stage("u", LocalOpener(tmp_path / "out/to-dir"), "home:link")


class SwappingOpener(LocalOpener):
    """Replaces `victim` by a link to `outside` right after it was listed and lstat'ed
    as a directory: the race a walker that opened by path would lose."""

    def __init__(self, root: Path, victim: str, outside: Path):
        super().__init__(root)
        self.victim, self.outside = victim, outside

    def open_at(self, dir_fd: int, name: str) -> int:
        if name == self.victim:
            os.rename(name, name + ".moved", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            os.symlink(self.outside, name, dir_fd=dir_fd)
        return super().open_at(dir_fd, name)


def test_a_directory_swapped_for_a_link_mid_walk_is_not_followed(store, tmp_path):
    outside = write_tree(tmp_path / "outside", {"secret": b"s3cret"})
    source = write_tree(tmp_path / "src", {"data/a": b"a"})
    staged = trees_of(store).stage("t", SwappingOpener(source, "data", outside), "home:src")
    entries = {e.path: (e.type, e.target) for e in staged.manifest.entries}
    assert entries["data"] == ("symlink", str(outside))
    assert not any("secret" in path for path in entries)


class DenyingOpener(LocalOpener):
    def open_at(self, dir_fd: int, name: str) -> int:
        if name == "locked":
            raise PermissionError(13, "Permission denied")
        return super().open_at(dir_fd, name)


def test_an_unreadable_entry_stops_staging_with_its_path(store, tmp_path):
    source = write_tree(tmp_path / "src", {"locked": b"x", "fifo/": b""})
    with pytest.raises(StageSourceError, match="src/locked': Permission denied"):
        trees_of(store).stage("t", DenyingOpener(source), str(source))
    assert not store.exists(snapshot_name("t", 1))


def test_devices_and_fifos_are_skipped_unread(store, tmp_path):
    source = write_tree(tmp_path / "src", {"a": b"a"})
    os.mkfifo(source / "pipe")  # opening it to read would block: never opened
    staged = trees_of(store).stage("t", LocalOpener(source), "home:src")
    assert staged.skipped == ("pipe",)
    assert [e.path for e in staged.manifest.entries] == [".", "a"]


# --- keys -------------------------------------------------------------------------------

def test_a_tree_key_opens_its_own_tree_and_no_other(store, tmp_path):
    for tree in ("t1", "t2"):
        source = write_tree(tmp_path / tree, {"f": tree.encode() * 1000})
        trees_of(store).stage(tree, LocalOpener(source), f"home:{tree}")
    master = MasterTreeKeys(store, KeyFile(MASTER))
    job = Trees(store, GivenTreeKeys({"t1": master.ring("t1")}))
    job.materialise("t1", 1, tmp_path / "out1")
    assert (tmp_path / "out1/f").read_bytes() == b"t1" * 1000
    with pytest.raises(NoTreeKey, match="'t2'"):
        job.materialise("t2", 1, tmp_path / "out2")
    forged = Trees(store, GivenTreeKeys({"t2": master.ring("t1")}))  # t1's key named t2's
    with pytest.raises(WrongKey):
        forged.manifest("t2", 1)
    with pytest.raises(WrongKey):
        forged.latest("t2")
    assert not os.path.lexists(tmp_path / "out2")


def test_a_tree_key_is_sealed_under_the_master_key_only(store, tmp_path):
    source = write_tree(tmp_path / "src", {"f": b"x"})
    trees_of(store).stage("t", LocalOpener(source), "home:src")
    with pytest.raises(WrongKey):
        MasterTreeKeys(store, KeyFile(bytes(32))).ring("t")
    # A run's sealed key put under a tree key's name does not open there: names are bound.
    store.put(tree_key_name("u"), store.get(tree_key_name("t")))
    with pytest.raises(CorruptObject):
        MasterTreeKeys(store, KeyFile(MASTER)).ring("u")
    store.put("keys/r", seal(MASTER, Kind.DATA_KEY, bytes(16), bytes(32), "keys/r"))
    with pytest.raises(ObjectMissing):
        MasterTreeKeys(store, KeyFile(MASTER)).ring("r")


def test_tree_ids_depend_on_the_label_and_the_master_key():
    naming = tree_naming_key(MASTER)
    ids = {tree_id(naming, "home:/data/a"), tree_id(naming, "home:/data/b"),
           tree_id(tree_naming_key(bytes(32)), "home:/data/a")}
    assert len(ids) == 3 and all(len(i) == 32 for i in ids)
    assert tree_id(naming, "home:/data/a") == tree_id(naming, "home:/data/a")
    with pytest.raises(UnsafeObjectName):
        trees_of(LocalDirStore(Path("/tmp"))).stage("../x", LocalOpener("/tmp"), "x")


def test_a_master_key_rotation_seals_tree_keys_again(store, tmp_path):
    from slurm_geo.ckpt.ops.rotate import rewrap_store

    source = write_tree(tmp_path / "src", {"f": b"x" * 5000})
    trees_of(store).stage("t", LocalOpener(source), "home:src")
    new = bytes(range(32, 64))
    done = rewrap_store(store, KeyFile(new, MASTER, ("home",)))
    assert tree_key_name("t") in done.rewrapped
    after = Trees(store, MasterTreeKeys(store, KeyFile(new)), OPTIONS)
    after.materialise("t", 1, tmp_path / "out")
    assert (tmp_path / "out/f").read_bytes() == b"x" * 5000
    with pytest.raises(WrongKey):
        MasterTreeKeys(store, KeyFile(MASTER)).ring("t")


def test_trees_of_one_domain_share_chunks_when_named(store, tmp_path):
    """Two environments of one user in one domain: the second stores its difference only
    when it names the first; in a domain of its own it stores everything again."""
    common = {f"lib/pkg{i}/mod.py": os.urandom(20_000) for i in range(10)}
    env_a = write_tree(tmp_path / "env-a", common)
    env_b = write_tree(tmp_path / "env-b", {**common, "lib/extra/new.py": os.urandom(20_000)})
    trees = trees_of(store)
    trees.stage("env-a", LocalOpener(env_a), "home:env-a", domain="envs-alice")
    store.counted()
    alone = trees.stage("env-b-alone", LocalOpener(env_b), "home:env-b")
    assert store.counted() > 200_000 and alone.stored_bytes > 200_000
    shared = trees.stage("env-b", LocalOpener(env_b), "home:env-b", domain="envs-alice",
                         shares_with=["env-a"])
    assert 20_000 < store.counted() == shared.stored_bytes < 30_000
    trees.materialise("env-b", 1, tmp_path / "out", domain="envs-alice")
    assert listing(tmp_path / "out") == listing(env_b)
    job = Trees(store, GivenTreeKeys({"envs-alice": MasterTreeKeys(
        store, KeyFile(MASTER)).ring("envs-alice")}))
    assert job.verify("env-a", 1, domain="envs-alice").bytes == 200_000  # its key reads both
    with pytest.raises(NoTreeKey):
        job.manifest("env-b-alone", 1)
