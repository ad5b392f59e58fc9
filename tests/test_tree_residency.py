"""Residency per input, enforced where bytes move (issue 31 item 5; docs/format.md §11.10):
the federation daemon seals where each granted domain may reside under the master key,
checkpoint-sync reads it before it copies a world off-site and copies nothing of a world
one of whose domains may not go there. Tested as the attacker: alice's job writes the
world record (she may pin what she likes), she forges, moves or deletes the residency
object; none of it brings a restricted input to a store it may not reside in."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from slurm_geo.ckpt.format.keys import KeyFile, as_master_keys
from slurm_geo.ckpt.stores.store import LocalDirStore
from slurm_geo.federation.act.worldgrants import root_residency, tree_grants
from slurm_geo.stage.residency import (
    TreeResidency,
    checker,
    decide,
    narrowed,
    read_residency,
    residency_name,
    write_residency,
)
from slurm_geo.sync.metrics import Live, SyncCollector
from slurm_geo.sync.runtime import load_runtime
from slurm_geo.sync.state import StateDB
from slurm_geo.sync.worker import Guard
from slurm_geo.sync.worldpass import PassGuard, run_pass
from slurm_geo.sync.worlds import WorldCopy
from slurm_geo.sync.worldstate import WorldRow, world_rows
from tests.kit.sync import site_config
from tests.kit.worlds import RULES, alice_stages, dataset, granted, job, stores

ANYWHERE = ("home", "remote")


# --- pure ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("residency", "region", "policy", "refused"), [
    (TreeResidency("d", ("internal",), ANYWHERE), "remote", {}, None),
    (TreeResidency("d", ("restricted",), ("home",)), "remote", {},
     "data class restricted may not reside in region 'remote' (allowed: home)"),
    (TreeResidency("d", ("restricted",), ()), "home", {},
     "data class restricted may not reside in region 'home' (allowed: none)"),
    # the reader's own policy narrows the record further, never widens it
    (TreeResidency("d", ("pii",), ANYWHERE), "remote", {"pii": ("home",)},
     "data class pii may not reside in region 'remote' (allowed: home)"),
    (TreeResidency("d", ("restricted",), ("home",)), "remote", {"restricted": ANYWHERE},
     "data class restricted may not reside in region 'remote' (allowed: home)"),
    (None, "remote", {}, "no residency record from the federation daemon"),
])
def test_what_may_go_where(residency, region, policy, refused):
    assert decide(residency, None, region, policy) == refused


@pytest.mark.parametrize(("old", "new", "now"), [
    (None, TreeResidency("d", ("internal",), ANYWHERE),
     TreeResidency("d", ("internal",), ANYWHERE)),
    # a second job declaring the same root without its class does not widen it
    (TreeResidency("d", ("restricted",), ("home",)), TreeResidency("d", ("internal",), ANYWHERE),
     TreeResidency("d", ("internal", "restricted"), ("home",))),
    (TreeResidency("d", ("internal",), ANYWHERE), TreeResidency("d", ("restricted",), ("home",)),
     TreeResidency("d", ("internal", "restricted"), ("home",))),
])
def test_a_domains_residency_only_narrows(old, new, now):
    assert narrowed(old, new) == now


@pytest.mark.parametrize(("directives", "expected"), [
    ({"geo-inputs": "/pfs/tok:restricted,/home/alice/code"},
     {"/pfs/tok": ("restricted", ("home",)), "/home/alice/code": ("internal", ANYWHERE),
      "/home/alice/llm": ("internal", ANYWHERE)}),
    # the job's own class and residency hold for every root without a class of its own
    ({"geo-inputs": "/pfs/tok", "geo-data-class": "restricted"},
     {"/pfs/tok": ("restricted", ("home",)), "/home/alice/llm": ("restricted", ("home",))}),
    ({"geo-inputs": "/pfs/tok:public", "geo-residency": "home"},
     {"/pfs/tok": ("public", ("home",)), "/home/alice/llm": ("internal", ("home",))}),
])
def test_the_residency_of_each_root(directives, expected):
    assert root_residency(job(directives, {"submit_dir": "/home/alice/llm"}), RULES) == expected


# --- the daemon writes it, checkpoint-sync reads it ---------------------------------------


def copy(home, away, key, region: str) -> WorldRow:
    why_not = checker(home, as_master_keys(key), region, RULES.policy.data_classes)
    return WorldCopy(home, away, KeyFile(key), why_not=why_not).copy(
        WorldRow("pfs", "run-a", "offsite"), lambda _row: None)


def nothing_of_it(away: LocalDirStore) -> list[str]:
    return [n for prefix in ("tree-packs/", "trees/", "tree-keys/", "worlds/", "keys/")
            for n in away.list(prefix)]


def checkpoint_sync(tmp_path, key_file) -> tuple[Any, StateDB]:
    """checkpoint-sync's runtime (home `pfs`, destination `offsite` in region remote) and
    its state database."""
    config = site_config(tmp_path / "site.toml", {"pfs": tmp_path / "home"},
                         f"file://{tmp_path / 'away'}", key_file=key_file,
                         state=tmp_path / "state.db")
    return load_runtime(config), StateDB(tmp_path / "state.db")


def one_pass(state: StateDB, runtime: Any) -> WorldRow:
    """One world pass over run-a, with nothing to give way to; its row after."""
    run_pass(state, [("pfs", "run-a")], runtime,
             PassGuard(Guard(threading.Event(), float("inf")), threading.Event(),
                       budget=1 << 40), None)
    [row] = world_rows(state, "offsite")
    return row


def test_a_restricted_input_alices_record_pins_never_reaches_a_remote_store(tmp_path):
    home, away, key, _ = stores(tmp_path)
    data = dataset(tmp_path / "data")
    domain = granted(home, key, data, "restricted")
    assert read_residency(home, as_master_keys(key), domain) == \
        TreeResidency(domain, ("restricted",), ("home",))
    alice_stages(home, key, domain, data)
    row = copy(home, away, key, "remote")
    assert not row.complete and row.refused == (
        f"input {data}: data class restricted may not reside in region 'remote' "
        "(allowed: home)")
    assert nothing_of_it(away) == []
    there = copy(home, away, key, "home")  # a store in its own region takes it
    assert there.complete and there.refused is None


def test_a_forged_moved_or_deleted_residency_object_is_refused(tmp_path):
    home, away, key, _ = stores(tmp_path)
    data = dataset(tmp_path / "data")
    domain = granted(home, key, data, "restricted")
    alice_stages(home, key, domain, data)
    name = residency_name(domain)
    # forged: sealed under a key of alice's making, allowing everywhere
    write_residency(home, KeyFile(os.urandom(32)), TreeResidency(domain, ("public",), ANYWHERE))
    row = copy(home, away, key, "remote")
    assert row.refused is not None and "its residency record is refused" in row.refused
    # moved: the daemon's sound record of another (unrestricted) domain put under this name
    other = granted(home, key, tmp_path / "public", "public")
    home.put(name, home.get(residency_name(other)))
    row = copy(home, away, key, "remote")
    assert row.refused is not None and "its residency record is refused" in row.refused
    # deleted: fail closed
    home.delete(name)
    assert copy(home, away, key, "remote").refused == \
        f"input {data}: no residency record from the federation daemon"
    assert nothing_of_it(away) == []
    # a later grant writes it again, sound (a refused object is replaced, never trusted)
    granted(home, key, data, "restricted")
    assert copy(home, away, key, "remote").refused is not None
    assert nothing_of_it(away) == []


def test_a_grant_without_the_class_does_not_widen_a_restricted_domain(tmp_path):
    home, away, key, _ = stores(tmp_path)
    data = dataset(tmp_path / "data")
    domain = granted(home, key, data, "restricted")
    tree_grants(job({"geo-inputs": str(data)}), home, key, create=True, rules=RULES)
    assert read_residency(home, as_master_keys(key), domain) == \
        TreeResidency(domain, ("internal", "restricted"), ("home",))
    alice_stages(home, key, domain, data)
    assert copy(home, away, key, "remote").refused is not None


def test_checkpoint_sync_skips_a_refused_world_says_so_once_and_counts_it(tmp_path, caplog):
    home, away, key, key_file = stores(tmp_path)
    data = dataset(tmp_path / "data")
    domain = granted(home, key, data, "restricted")
    alice_stages(home, key, domain, data)
    runtime, state = checkpoint_sync(tmp_path, key_file)
    assert runtime.destination_region == "remote"
    state.add([{"root": "pfs", "run": "run-a", "step": 2, "destination": "offsite",
                "sequence": 0, "status": "verified"}], 0.0)
    caplog.set_level(logging.INFO, logger="slurm_geo.sync")
    for _ in range(2):
        row = one_pass(state, runtime)
    assert not row.complete and row.refused is not None and "restricted" in row.refused
    assert row.failures == 0 and row.next_attempt_at > 0
    said = [r for r in caplog.records if "world_residency_refused" in r.getMessage()]
    assert len(said) == 1  # one line, not one a pass
    assert nothing_of_it(away) == []
    state.close()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for m in SyncCollector(tmp_path / "state.db", Live).collect() for s in m.samples}
    assert samples[("slurm_geo_sync_worlds", (("destination", "offsite"),
                                              ("state", "refused")))] == 1


def test_sync_status_shows_a_refused_world_and_why(tmp_path):
    from slurm_geo.cli.sync import world_summaries
    row = WorldRow("pfs", "run-a", "offsite", record_sha256="0" * 64, trees=1,
                   refused="input /pfs/tok: data class restricted may not reside in region "
                   "'remote' (allowed: home)")
    assert world_summaries([row])[("run-a", "offsite")] == {
        "world": "refused", "trees": 1, "staged_bytes": 0, "pending_bytes": 0,
        "lag_s": 0.0, "error": row.refused}
    assert row.lag_s(100.0) == 0.0  # refused: no lag to alert on
    waiting = WorldRow("pfs", "run-b", "offsite", record_sha256="0" * 64, record_seen_at=40.0)
    assert waiting.lag_s(100.0) == 60.0


def test_an_older_wider_residency_put_back_gains_nothing_with_checkpoint_sync(tmp_path):
    """Where users may write the store (a bucket-wide key): alice keeps the daemon's first
    object of her domain (internal: anywhere), the domain is then narrowed (a job declares
    the root restricted), and she puts the old object back. checkpoint-sync narrows what it
    reads by what it read before, so the world is still refused."""
    home, away, key, key_file = stores(tmp_path)
    data = dataset(tmp_path / "data")
    domain = granted(home, key, data, "internal")
    wide = home.get(residency_name(domain))
    alice_stages(home, key, domain, data)
    runtime, state = checkpoint_sync(tmp_path, key_file)

    # checkpoint-sync reads the wide one first (the world is copied: internal may go there)
    assert one_pass(state, runtime).complete
    granted(home, key, data, "restricted")  # narrowed by the daemon
    assert "restricted" in (one_pass(state, runtime).refused or "")
    home.put(residency_name(domain), wide)  # the daemon's own older object, put back
    assert read_residency(home, as_master_keys(key), domain).regions == ANYWHERE
    row = one_pass(state, runtime)
    assert row.refused is not None and "restricted" in row.refused
    state.close()


def test_a_world_copied_before_its_domain_was_narrowed_is_withdrawn(tmp_path, caplog):
    """Copied off-site while internal (anywhere), then declared restricted (home only):
    checkpoint-sync removes the run's record, the snapshots and the domain's packs from
    the destination, says so once, and copies nothing again. A residency object that is
    only unreadable (forged, deleted) stops copies but withdraws nothing: spoiling the
    home store's object must not delete a site's off-site world."""
    home, away, key, key_file = stores(tmp_path)
    data = dataset(tmp_path / "data")
    domain = granted(home, key, data, "internal")
    alice_stages(home, key, domain, data)
    runtime, state = checkpoint_sync(tmp_path, key_file)
    caplog.set_level(logging.INFO, logger="slurm_geo.sync")

    def world_there() -> list[str]:
        return [n for prefix in (f"tree-packs/{domain}/", f"trees/{domain}/", "worlds/")
                for n in away.list(prefix)]

    assert one_pass(state, runtime).complete and world_there()
    saved = home.get(residency_name(domain))
    home.delete(residency_name(domain))  # unreadable: copies stop, nothing is withdrawn
    assert one_pass(state, runtime).refused is not None and world_there()
    home.put(residency_name(domain), saved)
    granted(home, key, data, "restricted")  # narrowed by the daemon
    row = one_pass(state, runtime)
    assert row.refused is not None and "restricted" in row.refused and row.bytes_there == 0
    assert world_there() == []
    said = [r for r in caplog.records if "world_withdrawn" in r.getMessage()]
    assert len(said) == 1
    assert one_pass(state, runtime).refused is not None and world_there() == []
    assert len([r for r in caplog.records if "world_withdrawn" in r.getMessage()]) == 1
    state.close()


@pytest.mark.root(reason="runs users as root does")
def test_no_user_writes_tree_residency_in_a_shared_local_store():
    """tree-residency/ of a shared store (1777, as the sandbox's pfs) is the daemons' (0755):
    alice can neither put her own object there first nor replace the daemon's."""
    import shutil
    import stat
    import tempfile

    from slurm_geo.sandbox.users import ALICE as USER
    from tests.helpers import as_uid

    top = Path(tempfile.mkdtemp(prefix="slurm-geo-residency-", dir="/tmp"))
    try:
        top.chmod(0o755)
        pfs = top / "pfs"
        pfs.mkdir()
        pfs.chmod(0o1777)
        LocalDirStore(pfs)  # as a daemon opening it makes its shared directories
        info = (pfs / "tree-residency").stat()
        assert info.st_uid != USER.uid and stat.S_IMODE(info.st_mode) == 0o755  # daemons'

        name = residency_name("d" * 32)
        forged = TreeResidency("d" * 32, ("public",), ANYWHERE).to_payload()
        assert as_uid(USER.uid, lambda: LocalDirStore(pfs).put(name, forged)) != "ok"
        write_residency(LocalDirStore(pfs), KeyFile(bytes(32)),
                        TreeResidency("d" * 32, ("restricted",), ("home",)))
        before = (pfs / name).read_bytes()
        assert as_uid(USER.uid, lambda: LocalDirStore(pfs).put(name, forged)) != "ok"
        assert as_uid(USER.uid, lambda: LocalDirStore(pfs).delete(name)) != "ok"
        assert (pfs / name).read_bytes() == before
    finally:
        shutil.rmtree(top)
