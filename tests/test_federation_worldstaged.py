"""The planner's view of a run's world (federation.worldstaged): complete in a store that
holds the run's world record, of unknown size while none does; read from the stores."""

from __future__ import annotations

import os
from pathlib import Path

from slurm_geo.ckpt.format.keys import KeyFile
from slurm_geo.ckpt.repo.runkey import unwrap_run_keys
from slurm_geo.ckpt.stores.store import LocalDirStore
from slurm_geo.federation.decide.worldstaged import world_staging
from slurm_geo.stage.keys import MasterTreeKeys
from slurm_geo.stage.record import PinnedTree, WorldRecord, manifest_digest, write_world_record
from slurm_geo.stage.trees import Trees
from slurm_geo.stage.walk import LocalOpener

MASTER = KeyFile(bytes(range(32)))


def stores(tmp_path: Path) -> dict[str, LocalDirStore]:
    found = {}
    for name in ("pfs", "offsite", "far"):
        (tmp_path / name).mkdir()
        found[name] = LocalDirStore(tmp_path / name)
    return found


def test_a_world_is_complete_where_its_record_is_and_unknown_before(tmp_path: Path) -> None:
    found = stores(tmp_path)
    run = f"run-{os.getpid()}"
    assert world_staging(found, MASTER, "pfs", run).missing("offsite") is None
    assert world_staging(found, MASTER, "pfs", None).missing("offsite") is None
    data = tmp_path / "data"
    data.mkdir()
    (data / "tokens.bin").write_bytes(os.urandom(200_000))
    offsite = found["offsite"]
    tree = "a" * 32
    done = Trees(offsite, MasterTreeKeys(offsite, MASTER)).stage(tree, LocalOpener(data),
                                                                 "home:/d")
    snapshot = done.manifest.snapshot
    pin = PinnedTree("input", "/d", tree, tree, snapshot,
                     manifest_digest(offsite, tree, snapshot))
    write_world_record(offsite, unwrap_run_keys(offsite, MASTER, run, create=True),
                       WorldRecord(run, (pin,)), os.urandom)
    staging = world_staging(found, MASTER, "pfs", run)
    assert staging.missing("offsite") == 0 and staging.missing("pfs") == 0
    assert staging.total_bytes is not None and staging.total_bytes > 200_000
    assert staging.missing("far") == staging.total_bytes  # all of it still to copy there


def test_a_world_staged_at_home_only_is_missing_in_full_elsewhere_while_home_answers(
        tmp_path: Path) -> None:
    """A move while home is up must stage it first (federation.worldwait): its size is
    read from home's store; while home is down that store is not asked."""
    found = stores(tmp_path)
    run = f"home-only-{os.getpid()}"
    data = tmp_path / "data"
    data.mkdir()
    (data / "tokens.bin").write_bytes(os.urandom(300_000))
    pfs = found["pfs"]
    tree = "b" * 32
    done = Trees(pfs, MasterTreeKeys(pfs, MASTER)).stage(tree, LocalOpener(data), "home:/d")
    snapshot = done.manifest.snapshot
    pin = PinnedTree("input", "/d", tree, tree, snapshot, manifest_digest(pfs, tree, snapshot))
    write_world_record(pfs, unwrap_run_keys(pfs, MASTER, run, create=True),
                       WorldRecord(run, (pin,)), os.urandom)
    up = world_staging(found, MASTER, "pfs", run, source_up=True)
    assert up.total_bytes is not None and up.total_bytes > 300_000
    assert up.missing("offsite") == up.missing("far") == up.total_bytes
    assert up.missing("pfs") == 0
    assert world_staging(found, MASTER, "pfs", run).missing("offsite") is None
