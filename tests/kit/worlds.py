"""The worlds the staging and residency tests build: a dataset on disk, a run trained into a
store, the home and away stores with it, what alice's job stages and what it was granted."""

from __future__ import annotations

import os
import random
from pathlib import Path

from slurm_geo.ckpt.format.keys import KeyFile
from slurm_geo.ckpt.repo.repository import Repository
from slurm_geo.ckpt.stores.store import LocalDirStore
from slurm_geo.federation.act.worldgrants import tree_grants
from slurm_geo.federation.model import JobStatus, LogicalJob
from slurm_geo.policy.geo import GeoPolicy, GeoRules
from slurm_geo.slurm import Owner
from slurm_geo.stage.keys import MasterTreeKeys
from slurm_geo.stage.record import (
    PinnedTree,
    WorldRecord,
    manifest_digest,
    write_world_record,
)
from slurm_geo.stage.trees import Trees
from slurm_geo.stage.walk import LocalOpener
from tests.kit.sync import Trainer, master_key
from tests.kit.trees import OPTIONS, write_tree


def dataset(root: Path, files: int = 3, size: int = 300_000) -> Path:
    """`files` shards of `size` random bytes (the same for the same arguments)."""
    return write_tree(root, {f"shard-{i}.bin": random.Random(i).randbytes(size)
                             for i in range(files)})


def trained(root: Path, key: bytes, run: str) -> Trainer:
    """`run` trained two steps and saved into the store at `root`."""
    trainer = Trainer(root, key, run)
    trainer.train(2)
    trainer.save()
    return trainer


ALICE = Owner("alice", 2001, 2001)
RULES = GeoRules(GeoPolicy(data_classes={"restricted": ("home",)}),
                 {"onprem": "home", "rented": "remote"})


def job(directives: dict[str, str], spec: dict | None = None) -> LogicalJob:
    """alice's onprem-1 (run-a), running at home with these directives."""
    return LogicalJob(logical_job="onprem-1", run="run-a", home="onprem", script="#!/bin/bash\n",
                      spec=spec or {}, directives=directives, generation=0, cluster="onprem",
                      job_id=1, resume_step=None, status=JobStatus.RUNNING, owner=ALICE)


def stores(tmp_path: Path) -> tuple[LocalDirStore, LocalDirStore, bytes, Path]:
    """Stores home (run-a trained into it) and away, the master key and its file."""
    key_file, key = master_key(tmp_path)
    for name in ("home", "away"):
        (tmp_path / name).mkdir()
    trained(tmp_path / "home", key, "run-a")
    return LocalDirStore(tmp_path / "home"), LocalDirStore(tmp_path / "away"), key, key_file


def alice_stages(home: LocalDirStore, key: bytes, tree: str, source: Path) -> None:
    """What alice's job does with what it was granted: stage, then pin in its record."""
    trees = Trees(home, MasterTreeKeys(home, KeyFile(key)), OPTIONS)
    snapshot = trees.stage(tree, LocalOpener(source), f"home:{source}").manifest.snapshot
    pin = PinnedTree("input", str(source), tree, tree, snapshot,
                     manifest_digest(home, tree, snapshot))
    write_world_record(home, Repository(home, key).run_keys("run-a"),
                       WorldRecord("run-a", (pin,), 1.0), os.urandom)


def granted(home: LocalDirStore, key: bytes, data: Path, data_class: str) -> str:
    grants = tree_grants(job({"geo-inputs": f"{data}:{data_class}"}), home, key, create=True,
                         rules=RULES)
    return next(g.domain for g in grants if g.path == str(data))
