"""The planner's view of a run's world (federation.worldstaged): complete in a store that
holds the run's world record, of unknown size while none does; read from the stores."""

from __future__ import annotations

import os
from pathlib import Path

from slurm_geo.ckpt.keys import KeyFile
from slurm_geo.ckpt.runkey import unwrap_run_keys
from slurm_geo.ckpt.store import LocalDirStore
from slurm_geo.federation.worldstaged import world_staging
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
