"""The daemon with fakes (tests.kit.federation.Site): a move a person approves for
a job whose world is staged at home only waits for it at the target; the trainer trains
on meanwhile, and is released once the world's record is there (federation.worldwait)."""

from __future__ import annotations

import os
from pathlib import Path

from slurm_geo.ckpt.format.keys import KeyFile
from slurm_geo.ckpt.repo.runkey import unwrap_run_keys
from slurm_geo.stage.keys import MasterTreeKeys
from slurm_geo.stage.record import PinnedTree, WorldRecord, manifest_digest, write_world_record
from slurm_geo.stage.trees import Trees
from slurm_geo.stage.walk import LocalOpener
from tests.kit.federation import KEY, RUN, Site


def stage_world(site: Site, store: str, data: Path) -> None:
    """The run's world as the home job stages it (into `store`), its record last."""
    target = site.stores[store]
    keys = KeyFile(KEY)
    tree = "c" * 32
    done = Trees(target, MasterTreeKeys(target, keys)).stage(tree, LocalOpener(data),
                                                             "home:/data")
    snapshot = done.manifest.snapshot
    pin = PinnedTree("input", "/data", tree, tree, snapshot,
                     manifest_digest(target, tree, snapshot))
    write_world_record(target, unwrap_run_keys(target, keys, RUN, create=True),
                       WorldRecord(RUN, (pin,)), os.urandom)


def test_an_approved_move_waits_for_the_world_and_the_trainer_trains_on(tmp_path: Path):
    site = Site(tmp_path)
    job_id = site.submit_home()
    site.submitted_directives[job_id]["geo-inputs"] = "/data"
    site.start_home(job_id)
    site.tick()
    assert site.lease("onprem", job_id, last_step=None)["verdict"] == "grant"
    site.checkpoint("pfs", 40)
    data = tmp_path / "data"
    data.mkdir()
    (data / "tokens.bin").write_bytes(os.urandom(300_000))
    stage_world(site, "pfs", data)  # at home only
    site.federation.bandwidth.observe("pfs", "away", 50_000_000, 2.0)
    logical = site.job().logical_job
    site.federation.approve(logical, "rented", "operator")
    # Before the daemon has looked at rented, and after: the trainer trains on.
    assert site.lease("onprem", job_id, last_step=60)["action"] == "train"
    site.tick()
    reply = site.lease("onprem", job_id, last_step=80)
    assert reply["action"] == "train", reply
    assert "the move to rented waits: staging the world to rented: 0 MB left" in \
        reply["reason"]
    waits = [e for e in site.federation.audit.entries() if "waits for its world" in e.what]
    assert len(waits) == 1 and waits[0].detail["missing_bytes"] > 300_000
    assert waits[0].detail["predicted_s"] is not None
    assert site.job().cluster == "onprem" and not site.rented.submitted
    stage_world(site, "away", data)  # checkpoint-sync copied it, its record last
    site.tick()
    assert site.lease("onprem", job_id, last_step=100)["action"] == "release"
    site.lease("onprem", job_id, last_step=100, release=True)
    site.tick()
    assert site.job().cluster == "rented" and len(site.rented.submitted) == 1
