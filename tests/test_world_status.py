"""`slurm-geo status JOB` shows where a job's world is staged (issue 31 item 7): each root,
its size, the stores that hold its pinned snapshot verified, the staging lag and pending
bytes, and why the job is not movable while its world is staged nowhere but home. The
summary is pure (table-tested); the daemon's reading is tested against local stores it
reads the way it reads them (never a user's path)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from slurm_geo.ckpt.format.keys import KeyFile, as_master_keys
from slurm_geo.ckpt.repo.repository import Repository
from slurm_geo.cli.federation import staging_lines
from slurm_geo.federation.operator.worldstatus import Observed, PinSize, job_world_status, summarise
from slurm_geo.policy.geo import GeoPolicy
from slurm_geo.stage.record import PinnedTree, WorldRecord, write_world_record
from slurm_geo.stage.residency import checker
from slurm_geo.sync.worlds import WorldCopy
from slurm_geo.sync.worldstate import WorldRow
from tests.kit.worlds import alice_stages, dataset, granted, job, stores

D = "/pfs/data"
PIN = PinnedTree("input", D, "a" * 32, "a" * 32, 2, "0" * 64)
OLD = PinnedTree("input", D, "a" * 32, "a" * 32, 1, "1" * 64)
HOME = WorldRecord("run-a", (PIN,), 1000.0)
SIZES = {f"{PIN.tree}/2/{'0' * 64}": PinSize(5000, {"p1": 3000, "p2": 2000})}
ANY = {D: ("internal", ("home", "remote"))}
HOME_ONLY = {D: ("restricted", ("home",))}
REGIONS = {"pfs": "home", "offsite": "remote"}


def observed(there: WorldRecord | None, packs: frozenset[str] = frozenset(),
             home: WorldRecord | None = HOME) -> Observed:
    return Observed("pfs", home, SIZES if home else {}, {"offsite": there},
                    {"offsite": packs})


@pytest.mark.parametrize(("seen", "residency", "state", "lag", "pending", "why"), [
    # whole off-site: verified, no lag, movable
    (observed(HOME), ANY, "verified", 0.0, {}, None),
    # nothing there yet: the lag is the home pin's age, every pack pending
    (observed(None), ANY, "pending", 600.0, {"offsite": 5000},
     "its world is staged nowhere but home yet (checkpoint-sync is copying it)"),
    (observed(None, frozenset({"p1"})), ANY, "pending", 600.0, {"offsite": 2000},
     "its world is staged nowhere but home yet (checkpoint-sync is copying it)"),
    # an older record there: movable with the older snapshot; the new one lags
    (observed(WorldRecord("run-a", (OLD,), 500.0)), ANY, "snapshot 1 (older)", 600.0,
     {"offsite": 5000}, None),
    # its class keeps it home: the store refuses, status says why
    (observed(None), HOME_ONLY, "refused: data class restricted may not reside in region "
     "remote", 600.0, {"offsite": 0},
     f"its world may not leave home: input {D} (data class restricted) may not reside in "
     "region remote of any other store"),
    # the home job pinned nothing yet
    (observed(None, home=None), ANY, "not staged at home yet", None, {"offsite": 0},
     "its world is not staged yet: the home job has pinned nothing"),
])
def test_where_a_world_is_staged(seen, residency, state, lag, pending, why):
    status = summarise(seen, [("input", D)], residency, REGIONS, now=1600.0)
    [root] = status["roots"]
    assert root["stores"] == {"offsite": state}
    assert root["bytes"] == (5000 if seen.home else None)
    assert status["lag_s"] == lag
    assert status["pending_bytes"] == pending
    assert status["why_not_movable"] == why
    text = "\n".join(staging_lines(status))
    assert D in text and ("not movable" in text) == (why is not None)


def test_status_reads_the_stores_the_daemon_reads(tmp_path):
    home, away, key, _ = stores(tmp_path)
    data = dataset(tmp_path / "data")
    domain = granted(home, key, data, "internal")
    alice_stages(home, key, domain, data)
    site = SimpleNamespace(
        policy=GeoPolicy(data_classes={"restricted": ("home",)}),
        clusters={"onprem": SimpleNamespace(region="home", store="pfs"),
                  "rented": SimpleNamespace(region="remote", store="offsite")},
        stores={"pfs": SimpleNamespace(region="home"), "offsite": SimpleNamespace(region="remote")})
    site.cluster = site.clusters.__getitem__
    the_job = job({"geo-inputs": f"{data}:internal"})
    keys = as_master_keys(key)
    before = job_world_status({"pfs": home, "offsite": away}, keys, site, the_job, 10.0)
    root = next(r for r in before["roots"] if r["path"] == str(data))
    assert root["stores"] == {"offsite": "pending"} and root["bytes"] == 3 * 300_000
    assert before["pending_bytes"]["offsite"] > 0
    assert before["why_not_movable"] is not None
    WorldCopy(home, away, KeyFile(key), why_not=checker(home, keys, "remote", {})).copy(
        WorldRow("pfs", "run-a", "offsite"), lambda _row: None)
    after = job_world_status({"pfs": home, "offsite": away}, keys, site, the_job, 10.0)
    assert after["complete_at"] == ["offsite"] and after["why_not_movable"] is None
    assert after["lag_s"] == 0.0 and after["pending_bytes"] == {}
    # a newer pin at home: the lag counts from it until it is across
    write_world_record(home, Repository(home, key).run_keys("run-a"),
                       WorldRecord("run-a", (PinnedTree("input", str(data), domain, domain, 1,
                                                        "2" * 64),), 4.0), os.urandom)
    newer = job_world_status({"pfs": home, "offsite": away}, keys, site, the_job, 10.0)
    assert newer["lag_s"] == 6.0 and newer["complete_at"] == ["offsite"]
