"""Staged trees deduplicated across users (issue 31 item 2): a root every user may read at
home is staged in one shared domain whose key every job that declares it is given, so
bob's job on alice's world-readable dataset stores no new chunk; anything else stays in
its owner's domain; and bob, who holds the shared key and may write the domain, cannot
make alice's staging or her moved job use his bytes (slurm_geo.stage.public, .sharing;
docs/format.md §11.2, docs/security.md). alice and bob are forked children with their
uids (tests/helpers.as_uid), so the staging tests need root, not the sandbox."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from slurm_geo.ckpt import LocalDirStore
from slurm_geo.ckpt.format.codec import encode_parts
from slurm_geo.ckpt.format.keys import SALT_SIZE, RunKeyRing, as_master_keys
from slurm_geo.ckpt.format.manifest import ChunkRef
from slurm_geo.ckpt.format.seal import Kind, seal
from slurm_geo.federation.act.worldgrants import shared_label, tree_grants
from slurm_geo.lease.protocol import TreeGrant
from slurm_geo.sandbox.users import ALICE as ALICE_USER
from slurm_geo.sandbox.users import BOB as BOB_USER
from slurm_geo.stage.home import HomeStager
from slurm_geo.stage.keys import GivenTreeKeys, MasterTreeKeys
from slurm_geo.stage.manifest import DIR, FILE, SYMLINK, tree_to_payload
from slurm_geo.stage.names import snapshot_name, tree_pack_name, tree_packs_prefix
from slurm_geo.stage.public import ancestors_private, entry_private, has_acl
from slurm_geo.stage.record import read_world_record
from slurm_geo.stage.trees import Trees
from tests.helpers import as_uid, reachable_dir
from tests.kit.federation import ALICE, BOB, KEY
from tests.kit.federation import world_job as job

# --- the rule, table-driven ---------------------------------------------------------------


@pytest.mark.parametrize(("kind", "mode", "acl", "private"), [
    (FILE, 0o100644, False, None),
    (FILE, 0o100444, False, None),
    (FILE, 0o100755, False, None),
    (FILE, 0o100640, False, "lacks 0004"),      # others cannot read
    (FILE, 0o100604, False, "lacks 0040"),      # the group's members cannot (group bits rule)
    (FILE, 0o100600, False, "lacks 0044"),
    (FILE, 0o100044, False, "lacks 0400"),      # not even its owner
    (FILE, 0o100644, True, "ACL"),              # an ACL may deny a named user
    (DIR, 0o040755, False, None),
    (DIR, 0o041777, False, None),               # sticky, world-writable: still readable
    (DIR, 0o040751, False, "lacks 0004"),       # others may pass but not list
    (DIR, 0o040744, False, "lacks 0011"),       # only its owner may enter
    (DIR, 0o040700, False, "lacks 0055"),
    (DIR, 0o040755, True, "ACL"),
    (SYMLINK, 0o120777, False, None),           # its text only, never followed
    (SYMLINK, 0o120777, True, None),
    ("other", 0o010600, False, None),           # a FIFO: never staged
])
def test_which_entries_every_user_may_read(kind, mode, acl, private):
    why = entry_private(kind, mode, acl)
    assert (why is None) == (private is None)
    if private is not None:
        assert private in why


@pytest.mark.parametrize(("ancestors", "private"), [
    ([], None),                                               # a root at '/'
    ([("/", 0o040755, False), ("/pfs", 0o040755, False)], None),
    ([("/", 0o040755, False), ("/tmp", 0o041777, False)], None),
    ([("/", 0o040755, False), ("/pfs", 0o040711, False)], None),  # search is enough above
    ([("/", 0o040755, False), ("/home", 0o040755, False), ("/home/alice", 0o040700, False)],
     "/home/alice (mode 0700)"),
    ([("/", 0o040755, False), ("/pfs", 0o040750, False)], "/pfs (mode 0750)"),
    ([("/", 0o040755, False), ("/pfs", 0o040755, True)], "/pfs has an ACL"),
    ([("/", 0o040755, False), ("/data", 0o120777, False)], "/data is not a directory"),
])
def test_which_roots_every_user_may_reach(ancestors, private):
    why = ancestors_private(ancestors)
    assert why == private or (private is not None and why is not None and private in why)


def test_an_acl_is_found_by_its_extended_attribute_and_none_without_them():
    assert has_acl(3, lambda _fd: ["user.x", "system.posix_acl_access"])
    assert has_acl("/x", lambda _p, follow_symlinks: ["system.nfs4_acl"])
    assert not has_acl(3, lambda _fd: ["user.x", "security.selinux"])

    def unsupported(_fd: int) -> list[str]:
        raise OSError(95, "Operation not supported")
    assert not has_acl(3, unsupported)


def test_a_shared_label_names_the_class_and_regions_so_a_narrower_grant_is_another_domain():
    assert shared_label("/pfs/x", "open", ("us", "eu")) == "shared:open:eu,us:/pfs/x"
    assert shared_label("/pfs/x", "restricted", ()) != shared_label("/pfs/x", "open", ())


# --- alice and bob, as themselves ---------------------------------------------------------

needs_root = pytest.mark.root(reason="runs users as root does")


@pytest.fixture
def top() -> Iterator[Path]:
    """A directory every uid can reach (pytest's tmp_path is root's alone)."""
    with reachable_dir("shared") as made:
        for name in ("out", "pfs"):
            (made / name).mkdir()
            (made / name).chmod(0o1777)
        LocalDirStore(made / "pfs")
        yield made


def public_dataset(root: Path, owner: int = 0, files: int = 3, size: int = 600_000) -> Path:
    """A dataset every user may read: 0755 directories, 0644 files, owned by `owner`."""
    root.mkdir(parents=True)
    for n in range(files):
        (root / f"part-{n}.bin").write_bytes(os.urandom(size))
    (root / "meta").mkdir()
    (root / "meta" / "README").write_text("tokens\n")
    for found in [root, *root.rglob("*")]:
        os.lchown(found, owner, owner)
        found.chmod(0o755 if found.is_dir() else 0o644)
    return root


def grants(top: Path, owner, data: Path) -> tuple[TreeGrant, ...]:
    """What the daemon grants the job of `owner` that declares `data` (made at home)."""
    return tree_grants(job({"geo-inputs": str(data)}, owner=owner), LocalDirStore(top / "pfs"),
                       KEY, create=True)


def own(found: tuple[TreeGrant, ...]) -> TreeGrant:
    return next(g for g in found if not g.shared)


def shared(found: tuple[TreeGrant, ...]) -> TreeGrant:
    return next(g for g in found if g.shared)


def stage(uid: int, top: Path, ring: RunKeyRing, granted, run: str, passes=(None,)) -> list:
    """Stage as `uid` once per entry of `passes` (each a callable run first, or None), in
    one stager; what each pass did, as JSON written by the child."""
    out = top / "out" / f"{run}-{uid}.json"

    def action() -> None:
        stager = HomeStager(LocalDirStore(top / "pfs"), run, ring, granted)
        done = []
        for before in passes:
            if before is not None:
                before()
            result = stager.stage_once()
            done.append([{"tree": r.grant.tree, "shared": r.grant.shared, "error": r.error,
                          **({} if r.staged is None else {
                              "stored": r.staged.stored_bytes, "new": r.staged.new,
                              "read_back": r.staged.read_back, "refused": r.staged.refused,
                              "reused": r.staged.files_reused, "public": r.staged.public})}
                         for r in result.roots])
        out.write_text(json.dumps(done))
    answer = as_uid(uid, action)
    assert answer == "ok", answer
    return json.loads(out.read_text())


def pack_bytes(top: Path, domain: str) -> int:
    return sum(LocalDirStore(top / "pfs").sizes(tree_packs_prefix(domain)).values())


def moved_job_reads(top: Path, ring: RunKeyRing, run: str, granted, at: Path) -> Path:
    """What the run's moved job would present: its pinned snapshot, under its own keys."""
    store = LocalDirStore(top / "pfs")
    (pin,) = read_world_record(store, ring, run).trees
    Trees(store, GivenTreeKeys({g.domain: g.ring for g in granted})).materialise(
        pin.tree, pin.snapshot, at, pin.domain)
    return at


def same_tree(a: Path, b: Path) -> bool:
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    return files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file()) and all(
        (a / f).read_bytes() == (b / f).read_bytes() for f in files)


@needs_root
def test_a_second_users_job_on_a_world_readable_dataset_stores_no_new_chunk(top):
    data = public_dataset(top / "datasets" / "x")
    alice_grants, bob_grants = grants(top, ALICE, data), grants(top, BOB, data)
    assert shared(alice_grants).domain == shared(bob_grants).domain  # one, for both
    assert own(alice_grants).domain != own(bob_grants).domain
    alice_ring, bob_ring = RunKeyRing.of(os.urandom(32)), RunKeyRing.of(os.urandom(32))

    (first,) = stage(ALICE_USER.uid, top, alice_ring, alice_grants, "run-a")
    assert first[0]["shared"] and first[0]["stored"] > 3 * 600_000  # random: stored whole
    stored = pack_bytes(top, shared(alice_grants).domain)

    (second,) = stage(BOB_USER.uid, top, bob_ring, bob_grants, "run-b")
    assert second[0]["shared"] and second[0]["stored"] == 0  # no chunk, no manifest
    assert second[0]["read_back"] > 0 and second[0]["refused"] == 0
    assert pack_bytes(top, shared(alice_grants).domain) == stored
    assert pack_bytes(top, own(bob_grants).domain) == 0
    store = LocalDirStore(top / "pfs")
    alice_pin = read_world_record(store, alice_ring, "run-a").trees[0]
    bob_pin = read_world_record(store, bob_ring, "run-b").trees[0]
    assert (bob_pin.tree, bob_pin.snapshot) == (alice_pin.tree, alice_pin.snapshot)
    assert same_tree(data, moved_job_reads(top, bob_ring, "run-b", bob_grants, top / "b"))


@needs_root
def test_a_root_not_every_user_may_read_stays_in_its_owners_domain(top):
    data = public_dataset(top / "alice" / "data", owner=ALICE_USER.uid)
    os.chown(top / "alice", ALICE_USER.uid, ALICE_USER.uid)
    secret = data / "part-2.bin"  # one private file, walked after two public ones
    secret.write_bytes(os.urandom(3 << 20))
    secret.chmod(0o600)
    granted = grants(top, ALICE, data)
    ring = RunKeyRing.of(os.urandom(32))
    (done,) = stage(ALICE_USER.uid, top, ring, granted, "run-a")
    assert not done[0]["shared"] and done[0]["public"] is False
    assert done[0]["tree"] == own(granted).tree
    daemons = Trees(LocalDirStore(top / "pfs"), MasterTreeKeys(LocalDirStore(top / "pfs"),
                                                               as_master_keys(KEY)))
    assert daemons.snapshots(shared(granted).tree) == []
    # What may have reached the shared domain's packs before the walk met the private
    # file is what every user may read: never the private file (judged before it is read).
    assert pack_bytes(top, shared(granted).domain) < 2 * 600_000 + 100_000
    assert same_tree(data, moved_job_reads(top, ring, "run-a", granted, top / "moved"))

    # A private directory above the root: the same.
    (top / "alice").chmod(0o700)
    secret.chmod(0o644)
    (again,) = stage(ALICE_USER.uid, top, RunKeyRing.of(os.urandom(32)), granted, "run-c")
    assert not again[0]["shared"] and again[0]["public"] is True  # below it, all readable
    assert daemons.snapshots(shared(granted).tree) == []


@needs_root
def test_a_root_that_stops_being_world_readable_is_staged_for_its_owner_from_then_on(top):
    data = public_dataset(top / "alice" / "data", owner=ALICE_USER.uid)
    granted = grants(top, ALICE, data)
    ring = RunKeyRing.of(os.urandom(32))
    secret = data / "part-1.bin"
    passes = stage(ALICE_USER.uid, top, ring, granted, "run-a", passes=(
        None,
        lambda: secret.chmod(0o600),   # no longer every user's
        None,                          # still private: its owner's tree, checked again
        lambda: secret.chmod(0o644),   # readable by all again: noted ...
        None))                         # ... and shared again at the next pass
    assert [p[0]["shared"] for p in passes] == [True, False, False, False, True]
    assert [p[0].get("public") for p in passes] == [True, False, False, True, True]
    assert [p[0]["tree"] for p in passes[1:4]] == 3 * [own(granted).tree]
    # Shared again: its pin was its own tree's, so no stat is trusted there: every file is
    # read, and its chunks are the shared snapshot 1's, read back (no new chunk).
    assert passes[4][0]["reused"] == 0 and passes[4][0]["read_back"] > 0
    assert passes[4][0]["stored"] < 10_000  # a manifest (part-1's ctime changed)
    daemons = Trees(LocalDirStore(top / "pfs"), MasterTreeKeys(LocalDirStore(top / "pfs"),
                                                               as_master_keys(KEY)))
    assert daemons.snapshots(shared(granted).tree) == [1, 2]  # none while it was private
    pin = read_world_record(LocalDirStore(top / "pfs"), ring, "run-a").trees[0]
    assert (pin.tree, pin.snapshot) == (shared(granted).tree, 2)


def forge(top: Path, grant: TreeGrant, remove_newest_packs: bool = False) -> None:
    """bob, holding the shared key: a new snapshot of the shared tree claiming every file
    of the newest one, with its stat, has chunks he chose (each under the id of the true
    content, his random bytes inside); optionally he removes the newest one's packs (his
    own, which a sticky directory lets him remove)."""
    store = LocalDirStore(top / "pfs")
    trees = Trees(store, GivenTreeKeys({grant.domain: grant.ring}))
    newest = trees.snapshots(grant.tree)[-1]
    base = trees.manifest(grant.tree, newest, grant.domain)
    keys = grant.ring.current
    from slurm_geo.ckpt.format.pack import PackWriter, pack_id_of
    writer = PackWriter(keys.data_key, os.urandom(SALT_SIZE))
    planted = {ref.id: writer.add_parts(bytes.fromhex(ref.id),
                                        encode_parts(os.urandom(ref.size)))
               for ref in base.refs()}
    data = bytes(writer.release())
    pack = pack_id_of(data)
    store.put(tree_pack_name(grant.domain, pack), data)
    entries = tuple(replace(e, chunks=tuple(
        ChunkRef(c.id, pack, planted[c.id].offset, planted[c.id].length, c.size)
        for c in e.chunks)) if e.type == FILE else e for e in base.entries)
    name = snapshot_name(grant.tree, newest + 1)
    forged = replace(base, snapshot=newest + 1, parent=newest, entries=entries)
    store.put(name, seal(keys.data_key, Kind.MANIFEST, os.urandom(SALT_SIZE),
                         tree_to_payload(forged), name))
    if remove_newest_packs:
        for ref in {r.pack for r in base.refs()}:
            store.delete(tree_pack_name(grant.domain, ref))


@needs_root
def test_bobs_planted_chunks_and_forged_snapshots_never_reach_alices_job(top):
    data = public_dataset(top / "datasets" / "x")
    alice_grants, bob_grants = grants(top, ALICE, data), grants(top, BOB, data)
    sharing = shared(bob_grants)
    # bob stages first, then plants: a snapshot whose chunks carry the true ids and his
    # bytes, and he removes the sound packs he wrote.
    stage(BOB_USER.uid, top, RunKeyRing.of(os.urandom(32)), bob_grants, "run-b")
    assert as_uid(BOB_USER.uid, lambda: forge(top, sharing, remove_newest_packs=True)) == "ok"

    # alice's job reads every file, refuses every planted chunk, stores her own copy.
    ring = RunKeyRing.of(os.urandom(32))
    (first,) = stage(ALICE_USER.uid, top, ring, alice_grants, "run-a")
    assert first[0]["shared"] and first[0]["refused"] > 0 and first[0]["read_back"] == 0
    assert first[0]["stored"] > 3 * 600_000
    assert same_tree(data, moved_job_reads(top, ring, "run-a", alice_grants, top / "a1"))

    # bob forges again, now over alice's snapshot: her stat, his chunks.
    assert as_uid(BOB_USER.uid, lambda: forge(top, sharing)) == "ok"
    # Her run's next pass trusts only the snapshot it pinned: unchanged, nothing stored.
    (again,) = stage(ALICE_USER.uid, top, ring, alice_grants, "run-a")
    assert again[0]["stored"] == 0 and again[0]["reused"] == 4
    assert same_tree(data, moved_job_reads(top, ring, "run-a", alice_grants, top / "a2"))
    # Her second job has no pin: it reads every file, takes no stat from bob's snapshot,
    # refuses his chunks and references her own, read back: no new chunk stored.
    other = RunKeyRing.of(os.urandom(32))
    before = pack_bytes(top, sharing.domain)
    (second,) = stage(ALICE_USER.uid, top, other, alice_grants, "run-c")
    assert second[0]["reused"] == 0 and second[0]["refused"] > 0 and second[0]["read_back"] > 0
    assert pack_bytes(top, sharing.domain) == before
    assert same_tree(data, moved_job_reads(top, other, "run-c", alice_grants, top / "a3"))


def test_a_tree_grant_says_shared_only_when_it_is():
    ring = RunKeyRing.of(os.urandom(32))
    plain = TreeGrant("input", "/pfs/x", "a" * 32, "a" * 32, ring)
    assert "shared" not in plain.to_json()
    assert TreeGrant.from_json(plain.to_json()) == plain
    both = replace(plain, shared=True)
    assert TreeGrant.from_json(both.to_json()) == both
    with pytest.raises(ValueError):
        TreeGrant.from_json({**both.to_json(), "shared": "yes"})


class Swapping:
    """A store whose object `name` turns into `then` after its first read: a grantee who
    replaces a snapshot object he wrote right after another's stager read it."""

    def __init__(self, store: LocalDirStore, name: str, then: bytes):
        self._store, self._name, self._then, self._read = store, name, then, False

    def get(self, name: str) -> bytes:
        if name == self._name and self._read:
            return self._then
        self._read = self._read or name == self._name
        return self._store.get(name)

    def __getattr__(self, attr: str):
        return getattr(self._store, attr)


@pytest.mark.root(reason="runs as other users or in namespaces (failed as nobody)")
def test_a_pin_binds_the_snapshot_as_staging_read_it_not_as_it_lies_later(top):
    """bob's snapshot stands for alice's unchanged tree; he swaps its object right after
    her stager read it: her pin keeps the digest of what she checked, so her moved job
    refuses the swapped object instead of reading it."""
    data = public_dataset(top / "datasets" / "x", files=1)
    alice_grants, bob_grants = grants(top, ALICE, data), grants(top, BOB, data)
    store = LocalDirStore(top / "pfs")
    HomeStager(store, "run-b", RunKeyRing.of(os.urandom(32)), bob_grants).stage_once()
    name = snapshot_name(shared(bob_grants).tree, 1)
    sound = store.get(name)
    ring = RunKeyRing.of(os.urandom(32))
    done = HomeStager(Swapping(store, name, b"bob's other manifest"), "run-a", ring,
                      alice_grants).stage_once()  # type: ignore[arg-type]
    assert done.roots[0].staged is not None and not done.roots[0].staged.new
    (pin,) = read_world_record(store, ring, "run-a").trees
    assert (pin.tree, pin.snapshot) == (shared(alice_grants).tree, 1)
    assert pin.manifest_sha256 == hashlib.sha256(sound).hexdigest()
