"""A job's world staged ahead by the home job itself (issue 31 item 2): the daemon's key
reply grants the job's own roots only (federation.worldgrants), the home job stages them
as its owner into the home store and pins them in its run's world record
(slurm_geo.stage.home). The lease service is the real one (tests/test_federation_daemon's
Site: fake Slurm and MUNGE); staging as alice and bob runs in processes with their uids."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from slurm_geo.ckpt import LocalDirStore
from slurm_geo.ckpt.format.keys import RunKeyRing, as_master_keys
from slurm_geo.federation.act.worldgrants import grant_ids, shared_ids, tree_grants, world_roots
from slurm_geo.lease.protocol import KeyReply, TreeGrant
from slurm_geo.sandbox.users import ALICE as ALICE_USER
from slurm_geo.sandbox.users import BOB as BOB_USER
from slurm_geo.slurm import Owner
from slurm_geo.stage.home import HomeStager, for_key_reply, interval_from
from slurm_geo.stage.keys import GivenTreeKeys, MasterTreeKeys, NoTreeKey
from slurm_geo.stage.record import manifest_digest, read_world_record
from slurm_geo.stage.trees import Trees
from tests.helpers import as_uid, reachable_dir
from tests.kit.federation import ALICE, BOB, KEY, RUN, Site, directives
from tests.kit.federation import world_job as job

DATA = "/home/alice/data"
VENV = "/home/alice/venv"


@pytest.mark.parametrize(("world", "spec", "roots"), [
    ({}, {"submit_dir": "/home/alice/llm"}, ()),  # no world declared: nothing staged
    ({"geo-inputs": DATA}, {}, (("input", DATA),)),
    ({"geo-inputs": f"{DATA}/,/pfs/tok:restricted", "geo-env": VENV},
     {"submit_dir": "/home/alice/llm"},
     (("input", DATA), ("input", "/pfs/tok"), ("env", VENV), ("workdir", "/home/alice/llm"))),
    ({"geo-env": VENV}, {"working_dir": "/home/alice/x", "submit_dir": "/home/alice/y"},
     (("env", VENV), ("workdir", "/home/alice/x"))),
    ({"geo-inputs": DATA}, {"submit_dir": DATA}, (("input", DATA),)),  # each path once
    ({"geo-inputs": DATA}, {"working_dir": "rel/dir"}, (("input", DATA),)),  # not absolute
    ({"geo-outputs": "/home/alice/out"}, {"submit_dir": "/home/alice"}, ()),  # outputs: no
])
def test_the_roots_of_a_jobs_world(world, spec, roots):
    assert world_roots(job(world, spec)) == roots


def test_a_recorded_directive_that_no_longer_parses_stages_nothing():
    assert world_roots(job({"geo-inputs": "relative/path"})) == ()


def test_tree_ids_are_per_owner_and_root_and_hide_the_path():
    alice = grant_ids(KEY, ALICE.uid, [("input", DATA)])
    bob = grant_ids(KEY, BOB.uid, [("input", DATA)])
    assert alice == grant_ids(KEY, ALICE.uid, [("input", DATA)])  # stable: dedup per user
    assert alice[0][2] != bob[0][2]  # the same path, two users: two trees
    assert alice[0][2] != grant_ids(bytes(32), ALICE.uid, [("input", DATA)])[0][2]
    assert "alice" not in alice[0][2] and len(alice[0][2]) == 32


def test_grants_carry_the_domain_ring_made_at_home_and_only_copied_elsewhere(tmp_path):
    for name in ("home", "away"):
        (tmp_path / name).mkdir()
    home, away = LocalDirStore(tmp_path / "home"), LocalDirStore(tmp_path / "away")
    world = {"geo-inputs": DATA, "geo-env": VENV}
    assert tree_grants(job(world), away, KEY, create=False) == ()  # nothing copied there
    grants = tree_grants(job(world), home, KEY, create=True)
    # Each root twice: its owner's tree, then its shared one (used while all may read it).
    assert [(g.what, g.path, g.shared) for g in grants] == [
        ("input", DATA, False), ("env", VENV, False), ("input", DATA, True),
        ("env", VENV, True)]
    assert [g.tree for g in grants[2:]] == [t for _, _, t in shared_ids(
        KEY, [("input", DATA), ("env", VENV)], {})]
    rings = MasterTreeKeys(home, as_master_keys(KEY))
    for grant in grants:
        assert grant.domain == grant.tree
        assert grant.ring == rings.ring(grant.domain)  # the one in tree-keys/, made once
    assert tree_grants(job(world), home, KEY, create=True) == grants
    assert tree_grants(job(world, owner=None), home, KEY, create=True) == ()


# --- the key reply ----------------------------------------------------------------------------

def world_job(site: Site, owner: Owner, run: str, world: dict[str, str]) -> int:
    job_id = site.submit_home(owner=owner)
    site.submitted_directives[job_id] = {**directives(), **world}
    site.start_home(job_id)
    site.tick()
    user = None if owner is ALICE else owner.user
    assert site.lease("onprem", job_id, run=run, as_user=user)["verdict"] == "grant"
    return job_id


def test_a_key_reply_grants_exactly_the_jobs_own_roots(tmp_path):
    site = Site(tmp_path)
    alice_id = world_job(site, ALICE, RUN, {"geo-inputs": DATA, "geo-env": VENV})
    bob_id = world_job(site, BOB, "run-b", {"geo-inputs": DATA})  # the same dataset path
    plain_id = world_job(site, ALICE, "run-c", {})
    alice = KeyReply.from_json(site.key("onprem", alice_id).body)
    bob = KeyReply.from_json(site.key("onprem", bob_id, as_user="bob").body)
    plain = KeyReply.from_json(site.key("onprem", plain_id).body)
    assert [(g.what, g.path) for g in alice.trees][:2] == [("input", DATA), ("env", VENV)]
    assert {g.what for g in alice.trees} <= {"input", "env", "workdir"}
    assert [(g.what, g.path) for g in bob.trees][0] == ("input", DATA)
    # Their own trees share nothing; the dataset's shared tree is one, granted to both.
    own = [{g.domain for g in reply.trees if not g.shared} for reply in (alice, bob)]
    assert not own[0] & own[1]
    assert not {g.ring for g in alice.trees if not g.shared} & {g.ring for g in bob.trees}
    shared = [{(g.path, g.domain) for g in reply.trees if g.shared} for reply in (alice, bob)]
    assert shared[0] & shared[1] == {(DATA, next(g.domain for g in bob.trees if g.shared
                                                 and g.path == DATA))}
    assert plain.trees == ()  # no world declared, none granted
    again = KeyReply.from_json(site.key("onprem", alice_id).body)
    assert again.trees == alice.trees  # the same domains and keys at every start


def test_a_moved_incarnation_is_granted_the_trees_copied_to_its_store(tmp_path):
    """Away from home the rings come from the incarnation's cluster's store, where
    checkpoint-sync copies a domain's key with its snapshots; none is made there."""
    site = Site(tmp_path)
    home_id = world_job(site, ALICE, RUN, {"geo-inputs": DATA})
    at_home = KeyReply.from_json(site.key("onprem", home_id).body).trees
    moved = replace(site.job(), cluster="rented", generation=1, job_id=7)
    assert site.federation.leases._tree_grants(moved) == ()  # nothing copied there yet
    assert site.stores["away"].list("tree-keys/") == []
    for grant in at_home:
        name = f"tree-keys/{grant.domain}"
        site.stores["away"].put(name, site.stores["pfs"].get(name))
    assert site.federation.leases._tree_grants(moved) == at_home


# --- staging at home, as the owner --------------------------------------------------------

@pytest.fixture
def top() -> Iterator[Path]:
    """A directory every uid can reach (pytest's tmp_path is root's alone)."""
    with reachable_dir("world") as made:
        yield made


def world_store(top: Path) -> Path:
    """A store shared as the sandbox's pfs is (1777), opened once by root: its shared
    directories, those of staged trees with them, are root's."""
    root = top / "pfs"
    root.mkdir()
    root.chmod(0o1777)
    LocalDirStore(root)
    return root


def dataset(root: Path, files: int = 4, size: int = 300_000) -> Path:
    root.mkdir(parents=True)
    for n in range(files):
        (root / f"part-{n}.bin").write_bytes(os.urandom(size))
    (root / "meta").mkdir()
    (root / "meta" / "README").write_text("tokens\n")
    return root


def owned_by(path: Path, uid: int, mode: int = 0o700) -> None:
    for found in [path, *path.rglob("*")]:
        os.lchown(found, uid, uid)
    path.chmod(mode)
    path.parent.chmod(0o755)


def grants_for(pfs: Path, owner: Owner, roots: list[tuple[str, str]]) -> tuple[TreeGrant, ...]:
    rings = MasterTreeKeys(LocalDirStore(pfs), as_master_keys(KEY))  # the daemon's part
    return tuple(TreeGrant(what, path, tree, tree, rings.ring(tree, create=True))
                 for what, path, tree in grant_ids(KEY, owner.uid, roots))


def stage_as(uid: int, pfs: Path, ring: RunKeyRing, grants, run: str = RUN,
             results: Path | None = None) -> str:
    def action() -> None:
        done = HomeStager(LocalDirStore(pfs), run, ring, grants).stage_once()
        if done.failed:
            raise RuntimeError("; ".join(str(r.error) for r in done.failed))
        if results is not None:
            results.write_text(" ".join(str(r.staged.stored_bytes) for r in done.roots
                                        if r.staged is not None))
    return as_uid(uid, action)


@pytest.mark.root(reason="runs users as root does")
def test_the_home_job_stages_its_world_as_its_owner_and_pins_it(top):
    tmp_path = top
    pfs = world_store(tmp_path)
    data = dataset(tmp_path / "alice" / "data", files=2, size=8 << 20)
    owned_by(tmp_path / "alice", ALICE_USER.uid)
    ring = RunKeyRing.of(os.urandom(32))
    grants = grants_for(pfs, ALICE, [("input", str(data))])
    out = tmp_path / "out"
    out.touch()
    out.chmod(0o666)
    assert stage_as(ALICE_USER.uid, pfs, ring, grants, results=out) == "ok"
    first = int(out.read_text())
    assert first > 2 * 8 << 20  # random data: stored whole
    store = LocalDirStore(pfs)
    (grant,) = grants
    record = read_world_record(store, ring, RUN)
    assert record is not None and len(record.trees) == 1
    pin = record.trees[0]
    assert (pin.what, pin.path, pin.tree, pin.snapshot) == ("input", str(data), grant.tree, 1)
    assert pin.manifest_sha256 == manifest_digest(store, grant.tree, 1)
    target = tmp_path / "materialised"
    daemons = MasterTreeKeys(store, as_master_keys(KEY))
    Trees(store, daemons).materialise(grant.tree, 1, target, grant.domain)
    assert (target / "part-1.bin").read_bytes() == (data / "part-1.bin").read_bytes()
    # Bob's process cannot stage alice's data (he cannot read it), nor open her tree.
    bob_grants = grants_for(pfs, BOB, [("input", str(data))])
    assert "cannot stage" in stage_as(BOB_USER.uid, pfs, RunKeyRing.of(os.urandom(32)),
                                      bob_grants, run="run-b")
    with pytest.raises(NoTreeKey):
        Trees(store, GivenTreeKeys({g.domain: g.ring for g in bob_grants})).latest(
            grant.tree, grant.domain)

    # A second job of hers on the same dataset stages 0 new bytes, the pin stands.
    second_ring = RunKeyRing.of(os.urandom(32))
    assert stage_as(ALICE_USER.uid, pfs, second_ring, grants, run="run-2",
                    results=out) == "ok"
    assert int(out.read_text()) == 0
    assert read_world_record(store, second_ring, "run-2").trees == record.trees

    # A changed input is staged again incrementally: a new snapshot, its new chunks only.
    def change() -> None:
        with open(data / "part-1.bin", "r+b") as handle:
            handle.seek(4 << 20)
            handle.write(b"changed")
    assert as_uid(ALICE_USER.uid, change) == "ok"
    assert stage_as(ALICE_USER.uid, pfs, ring, grants, results=out) == "ok"
    assert 0 < int(out.read_text()) < first / 3  # the chunks around the change
    pin = read_world_record(store, ring, RUN).trees[0]
    assert pin.snapshot == 2 and pin.manifest_sha256 == manifest_digest(store, grant.tree, 2)


@pytest.mark.root(reason="runs users as root does")
def test_a_domains_directories_come_with_its_key_so_no_other_user_can_take_them(top):
    """In a shared store the daemon makes a domain's tree-packs/ and trees/ directories
    with its key (as a run's with its key), root's and sticky: alice's job writes in them,
    bob can neither make them first nor remove what she staged."""
    pfs = world_store(top)
    data = dataset(top / "alice" / "data", files=1)
    owned_by(top / "alice", ALICE_USER.uid)
    (grant,) = grants_for(pfs, ALICE, [("input", str(data))])
    for prefix in ("tree-packs", "trees"):
        info = (pfs / prefix / grant.domain).stat()
        assert info.st_uid == 0 and info.st_mode & 0o1777 == 0o1777
    assert stage_as(ALICE_USER.uid, pfs, RunKeyRing.of(os.urandom(32)), (grant,)) == "ok"
    staged = [*(pfs / "tree-packs" / grant.domain).iterdir(),
              *(pfs / "trees" / grant.tree).iterdir(), pfs / "tree-latest" / grant.tree]
    assert staged and all(p.stat().st_uid == ALICE_USER.uid for p in staged)
    for found in staged:
        assert "PermissionError" in as_uid(BOB_USER.uid, found.unlink)


def test_a_root_that_cannot_be_staged_keeps_its_earlier_pin(tmp_path):
    (tmp_path / "pfs").mkdir()
    store = LocalDirStore(tmp_path / "pfs")
    data = dataset(tmp_path / "data")
    env = dataset(tmp_path / "venv", files=1)
    ring = RunKeyRing.of(os.urandom(32))
    grants = grants_for(store.root, ALICE, [("input", str(data)), ("env", str(env))])
    clock = iter([100.0, 200.0, 300.0]).__next__
    stager = HomeStager(store, RUN, ring, grants, clock=clock)
    assert not stager.stage_once().failed
    first = read_world_record(store, ring, RUN)
    assert first is not None and first.staged_at == 100.0
    shutil.rmtree(env)  # the environment is gone
    (data / "new.bin").write_bytes(b"x" * 1000)
    done = stager.stage_once()
    assert [r.grant.what for r in done.failed] == ["env"]
    record = read_world_record(store, ring, RUN)
    assert record.pinned(str(data)).snapshot == 2
    assert record.pinned(str(env)) == first.pinned(str(env))  # the earlier snapshot stands
    assert record.staged_at == 200.0
    # Nothing changed: no new snapshot, the record is not rewritten.
    assert HomeStager(store, RUN, ring, grants, clock=clock).stage_once().record == record


def test_only_the_home_job_stages_what_its_key_reply_grants(tmp_path):
    (tmp_path / "pfs").mkdir()
    store = LocalDirStore(tmp_path / "pfs")
    data = dataset(tmp_path / "data", files=1)
    ring = RunKeyRing.of(os.urandom(32))
    reply = KeyReply(RUN, ring, {}, grants_for(store.root, ALICE, [("input", str(data))]))
    url = f"file://{store.root}"
    once = {"SLURM_GEO_STAGE_INTERVAL_S": "0"}
    assert for_key_reply(reply, 1, url, env=once) is None  # a moved incarnation
    assert for_key_reply(KeyReply(RUN, ring), 0, url, env=once) is None  # nothing granted
    assert read_world_record(store, ring, RUN) is None
    stager = for_key_reply(reply, 0, url, env=once)
    assert stager is not None and stager._thread is not None
    stager._thread.join(60)  # one pass in the background, then it ends
    record = read_world_record(store, ring, RUN)
    assert record is not None and record.pinned(str(data)).snapshot == 1
    assert stager.last is not None and not stager.last.failed


def test_a_home_federated_run_starts_staging_with_its_key_reply(tmp_path, monkeypatch):
    from slurm_geo.lease.client import FederatedRun, Placement
    from slurm_geo.stage.homestart import stage_home_world

    (tmp_path / "pfs").mkdir()
    store = LocalDirStore(tmp_path / "pfs")
    data = dataset(tmp_path / "data", files=1)
    ring = RunKeyRing.of(os.urandom(32))
    reply = KeyReply(RUN, ring, {}, grants_for(store.root, ALICE, [("input", str(data))]))
    monkeypatch.setenv("SLURM_GEO_STAGE_INTERVAL_S", "0")
    runs = {}
    for generation in (0, 1):
        placement = Placement(RUN, "onprem", 5, 0, generation, None, "http://127.0.0.1:9",
                              f"file://{store.root}", "")
        federated = FederatedRun(placement, signer=object(), env={},  # type: ignore[arg-type]
                                 stage_world=stage_home_world)
        monkeypatch.setattr(federated, "_call",  # the daemon's answer, as it sends it
                            lambda path, body, election_wait_s=0.0: (200, reply.to_json()))
        assert federated.run_key() == (RUN, ring)
        runs[generation] = federated
    assert runs[1].stager is None  # a moved incarnation stages nothing
    stager = runs[0].stager
    assert stager is not None
    stager._thread.join(60)
    assert read_world_record(store, ring, RUN).pinned(str(data)).snapshot == 1
    runs[0].key_reply()
    assert runs[0].stager is stager  # asked again: still the one stager


def test_a_grant_of_nothing_the_stager_knows_is_left_out(tmp_path):
    ring = RunKeyRing.of(os.urandom(32))
    grant = TreeGrant("output", "/home/alice/out", "a" * 32, "a" * 32, ring)
    relative = TreeGrant("input", "data", "b" * 32, "b" * 32, ring)
    assert HomeStager(LocalDirStore(tmp_path), RUN, ring, [grant, relative]).grants == ()


@pytest.mark.parametrize(("env", "seconds"), [
    ({}, 1800.0), ({"SLURM_GEO_STAGE_INTERVAL_S": "0"}, 0.0),
    ({"SLURM_GEO_STAGE_INTERVAL_S": "60"}, 60.0), ({"SLURM_GEO_STAGE_INTERVAL_S": "-5"}, 0.0),
    ({"SLURM_GEO_STAGE_INTERVAL_S": "soon"}, 1800.0)])
def test_the_restaging_interval(env, seconds):
    assert interval_from(env) == seconds
