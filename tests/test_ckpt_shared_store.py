"""A store shared by users who do not trust each other (mode 1777, as the sandbox's pfs):
what a co-tenant, bob, can try against alice's and root's objects, and that each attempt
fails and changes nothing. bob and alice are forked children that set their uid (the
sandbox's uids; no account is needed), so these need root, not the sandbox."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from helpers import as_uid, reachable_dir

from slurm_geo.ckpt.errors import UnsafeObjectName, UnsafeStoreDirectory
from slurm_geo.ckpt.ops.gc import collect_garbage
from slurm_geo.ckpt.repo.repository import Repository
from slurm_geo.ckpt.stores.store import LocalDirStore, directory_fault
from slurm_geo.sandbox.users import ALICE, BOB

pytestmark = pytest.mark.root(reason="runs users as root does")


@pytest.fixture
def pfs() -> Iterator[Path]:
    """A 1777 directory every uid can reach (pytest's tmp_path is root's alone)."""
    with reachable_dir("pfs") as top:
        root = top / "ckpt"
        root.mkdir()
        root.chmod(0o1777)
        yield root


def snapshot(root: Path) -> dict[str, tuple[int, bytes]]:
    return {str(p.relative_to(root)): (p.lstat().st_uid, p.read_bytes() if p.is_file() else b"")
            for p in sorted(root.rglob("*"))}


def test_a_run_directory_bob_made_first_is_never_written_into(pfs):
    """The finding: bob pre-created manifests/<run>/, so he owned it, and deleted root's
    manifest in it. Now root refuses it, in one line naming the directory, bob and the fix."""
    assert as_uid(BOB.uid, lambda: (pfs / "manifests" / "llm").mkdir(parents=True)) == "ok"
    store = LocalDirStore(pfs)
    with pytest.raises(UnsafeStoreDirectory) as info:
        store.put("manifests/llm/00000000000000000100", b"root's manifest")
    message = str(info.value)
    assert "'manifests'" in message and "belongs to" in message and f"uid {BOB.uid}" in message
    assert "\n" not in message and "an admin removes it" in message
    assert info.value.exit_code == 24
    assert not (pfs / "manifests" / "llm" / "00000000000000000100").exists()


def test_a_pack_directory_bob_made_first_is_never_written_into(pfs):
    """packs/xx/ is shared by every run: one bob owns would let him remove anyone's packs."""
    bobs = pfs / "packs" / "ab"
    assert as_uid(BOB.uid, lambda: bobs.mkdir(parents=True)) == "ok"
    with pytest.raises(UnsafeStoreDirectory, match="directory 'packs' belongs to bob|uid 2002"):
        LocalDirStore(pfs).put("packs/ab/" + "ab" * 32, b"pack")
    assert list(bobs.iterdir()) == []


def test_root_makes_the_shared_directories_and_a_user_never_does(pfs):
    def bob_puts_first() -> None:
        LocalDirStore(pfs).put("packs/cd/" + "cd" * 32, b"pack")

    answer = as_uid(BOB.uid, bob_puts_first)
    assert answer.startswith("UnsafeStoreDirectory") and "only root" in answer
    assert list(pfs.iterdir()) == []  # bob made nothing
    LocalDirStore(pfs)  # root opens it: every shared directory, root's and sticky
    for directory in (pfs / "packs", pfs / "packs" / "cd", pfs / "manifests", pfs / "locks"):
        info = directory.stat()
        assert info.st_uid == 0 and stat.S_IMODE(info.st_mode) == 0o1777
    assert as_uid(BOB.uid, bob_puts_first) == "ok"


def test_bob_can_neither_remove_nor_replace_alices_or_roots_objects(pfs):
    LocalDirStore(pfs)  # the shared directories, as a root daemon opening it makes them
    pack = "packs/ab/" + "ab" * 32

    def alice_saves() -> None:
        store = LocalDirStore(pfs)
        store.put("keys/alices-run", b"wrapped key")
        store.put(pack, b"alice's pack")
        store.put("manifests/alices-run/00000000000000000100", b"alice's manifest")
        store.put("latest/alices-run", b"pointer")

    assert as_uid(ALICE.uid, alice_saves) == "ok"
    LocalDirStore(pfs).put("fences/alices-run", b"root's fence")
    before = snapshot(pfs)
    for name in ("keys/alices-run", pack, "manifests/alices-run/00000000000000000100",
                 "latest/alices-run", "fences/alices-run"):
        assert as_uid(BOB.uid, lambda n=name: LocalDirStore(pfs).delete(n)) \
            .startswith("StoreUnavailable")
        assert as_uid(BOB.uid, lambda n=name: LocalDirStore(pfs).put(n, b"bob's")) != "ok"
    assert as_uid(BOB.uid, lambda: LocalDirStore(pfs).put(
        "manifests/alices-run/00000000000000000200", b"bob's")) != "ok"  # alice's alone
    assert snapshot(pfs) == before


def test_a_name_bob_made_before_alice_writes_it_is_not_taken_for_hers(pfs):
    """bob pre-creates the pointer alice writes next: her put fails, saying whose it is,
    rather than leave his file standing for hers; root's put takes the name back."""
    LocalDirStore(pfs)
    assert as_uid(BOB.uid, lambda: (pfs / "latest" / "alices-run").write_bytes(b"bob")) == "ok"
    answer = as_uid(ALICE.uid, lambda: LocalDirStore(pfs).put("latest/alices-run", b"hers"))
    assert answer.startswith("UnsafeStoreDirectory") and "belongs to" in answer
    assert (pfs / "latest" / "alices-run").read_bytes() == b"bob"
    LocalDirStore(pfs).put("latest/alices-run", b"root's")
    assert (pfs / "latest" / "alices-run").stat().st_uid == 0
    assert as_uid(BOB.uid, lambda: LocalDirStore(pfs).delete("latest/alices-run")) != "ok"


def test_a_symbolic_link_bob_plants_is_never_followed(pfs):
    LocalDirStore(pfs)
    elsewhere = pfs.parent / "bobs"
    elsewhere.mkdir()
    os.chown(elsewhere, BOB.uid, BOB.uid)
    assert as_uid(BOB.uid, lambda: (pfs / "manifests" / "run").symlink_to(elsewhere)) == "ok"
    assert as_uid(BOB.uid, lambda: (pfs / "latest" / "run").symlink_to(elsewhere / "p")) == "ok"
    store = LocalDirStore(pfs)
    with pytest.raises(UnsafeObjectName, match="symbolic link"):
        store.put("manifests/run/00000000000000000001", b"x")
    with pytest.raises(UnsafeObjectName, match="symbolic link"):
        store.get("latest/run")
    assert list(elsewhere.iterdir()) == []


def test_a_directory_others_may_write_without_the_sticky_bit_is_refused(pfs):
    LocalDirStore(pfs)
    (pfs / "packs" / "ef").chmod(0o777)
    with pytest.raises(UnsafeStoreDirectory, match="without the sticky bit.*chmod \\+t"):
        LocalDirStore(pfs).put("packs/ef/" + "ef" * 32, b"x")


@pytest.mark.parametrize("uid, mode, fault", [
    (0, 0o1777, None),            # root's, sticky: the shared directories
    (0, 0o755, None),
    (1000, 0o755, None),          # the writer's own
    (2001, 0o1777, "belongs to"),  # another user's: they may remove anything in it
    (2001, 0o700, "belongs to"),
    (0, 0o777, "without the sticky bit"),
    (0, 0o775, "without the sticky bit"),
    (0, 0o3770, None),            # a group's store, sticky
])
def test_which_directories_a_store_writes_into(uid, mode, fault):
    info = os.stat_result((stat.S_IFDIR | mode, 0, 0, 2, uid, 0, 0, 0, 0, 0))
    found = directory_fault(info, frozenset({0, 1000}))
    assert (found is not None and fault in found.reason) if fault else found is None


def test_locks_bob_plants_never_hold_gc_off(pfs):
    """Garbage, or a time far ahead, in a lock bob put: gc removes it and goes on."""
    LocalDirStore(pfs)

    def bob_plants() -> None:
        store = LocalDirStore(pfs)
        store.put("locks/" + "ab" * 16, b"\x00 not a lock")
        store.put("locks/" + "cd" * 16, b'{"created_at": "9999-01-01T00:00:00+00:00"}')

    assert as_uid(BOB.uid, bob_plants) == "ok"
    store = LocalDirStore(pfs)
    report = collect_garbage(store, Repository(store, bytes(32)), datetime.now(UTC))
    assert sorted(report.stale_locks_removed) == ["locks/" + "ab" * 16, "locks/" + "cd" * 16]
    assert all("no push wrote it" in note for note in report.notes)
    assert store.list("locks/") == []


def test_a_copy_root_makes_leaves_the_runs_latest_pointer_to_its_owner(pfs, tmp_path):
    """The failback finding: the daemons copied a run's checkpoints back into the shared
    pfs before its job had ever saved there, and made `latest/<run>`, theirs; the sticky
    `latest/` then refused the owner's every save. Root's copy makes no pointer there (a
    reader lists the steps; a resume is told its step); alice's next save makes hers."""
    from slurm_geo.ckpt.ops.replicate import copy_checkpoint
    from tests.kit.ckpt import KEY, OPTIONS, metadata, repo, tensors

    source_store, source = repo(tmp_path, "rented")
    for step in (1, 2):
        source.write_checkpoint("r", tensors(step), b"", metadata(step))
    report = copy_checkpoint(source, source_store, LocalDirStore(pfs), "r", 2)
    assert report.latest_left
    assert not (pfs / "latest" / "r").exists()
    assert Repository(LocalDirStore(pfs), KEY).latest("r") == 2  # from the listing

    def alice_saves_on() -> None:
        Repository(LocalDirStore(pfs), KEY, OPTIONS).write_checkpoint(
            "r", tensors(3), b"", metadata(3), parent=2)

    assert as_uid(ALICE.uid, alice_saves_on) == "ok"
    assert (pfs / "latest" / "r").stat().st_uid == ALICE.uid
    assert Repository(LocalDirStore(pfs), KEY).pointer("r") == 3
    # A later copy by root neither replaces her pointer nor fails on it.
    source.write_checkpoint("r", tensors(4), b"", metadata(4))
    assert copy_checkpoint(source, source_store, LocalDirStore(pfs), "r", 4).latest_left
    assert (pfs / "latest" / "r").stat().st_uid == ALICE.uid


def test_a_copy_into_a_private_store_still_writes_the_pointer(tmp_path):
    from slurm_geo.ckpt.ops.replicate import copy_checkpoint
    from slurm_geo.ckpt.stores.retry import RetryingStore
    from tests.kit.ckpt import KEY, metadata, repo, tensors

    source_store, source = repo(tmp_path, "rented")
    source.write_checkpoint("r", tensors(1), b"", metadata(1))
    destination = RetryingStore(repo(tmp_path, "private")[0])
    assert not copy_checkpoint(source, source_store, destination, "r", 1).latest_left
    assert Repository(destination, KEY).pointer("r") == 1
