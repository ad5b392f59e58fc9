"""A staged world on this machine as the preamble, shipping and node-step tests use it: the
directory alice and bob share (the fixture `base`, imported as `base_fixture`), the home
paths, the trees staged and the key reply a job gets; and a tiny root image."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from slurm_geo.ckpt.format.keys import KeyFile, RunKeyRing
from slurm_geo.ckpt.stores.store import LocalDirStore
from slurm_geo.lease.protocol import KeyReply, TreeGrant
from slurm_geo.policy.world import Input, World
from slurm_geo.sandbox.users import ALICE
from slurm_geo.stage.keys import MasterTreeKeys
from slurm_geo.stage.node import Node
from slurm_geo.stage.record import PinnedTree, WorldRecord, manifest_digest, write_world_record
from slurm_geo.stage.trees import Trees
from slurm_geo.stage.walk import LocalOpener
from tests.helpers import as_uid, reachable_dir

MASTER = bytes(range(32))
PYTHON = "/usr/bin/python3"  # one alice may run
RUN = "run-preamble"


@pytest.fixture(name="base")
def base_fixture() -> Iterator[Path]:
    """A directory alice and bob may both create in (as /scratch is), removed after."""
    with reachable_dir("preamble", 0o1777, "/var/tmp") as path:
        yield path


@dataclass
class Staged:
    store: LocalDirStore
    reply: KeyReply
    record: WorldRecord
    world: World
    data_home: str
    work_home: str
    files: dict[str, bytes]
    report: Path
    base: Path


def home_path(tag: str) -> str:
    """A home path that exists nowhere on this machine (its parent neither)."""
    return f"/slurm-geo-home-{os.getpid()}-{tag}"


def stage_world(base: Path, tag: str) -> Staged:
    data, work = base / "home-data", base / "home-llm"
    files = {"tokens.bin": os.urandom(400_000), "sub/labels.txt": b"cat\ndog\n"}
    for name, content in files.items():
        (data / name).parent.mkdir(parents=True, exist_ok=True)
        (data / name).write_bytes(content)
    work.mkdir()
    (work / "project.txt").write_text("llm-7b\n")
    store_dir = base / "store"
    store_dir.mkdir()
    store = LocalDirStore(store_dir)
    master = MasterTreeKeys(store, KeyFile(MASTER))
    trees = Trees(store, master)
    data_home, work_home = home_path(tag) + "/data", home_path(tag) + "/llm"
    pins, grants = [], []
    roots: tuple[tuple[Literal["input", "workdir"], Path, str, str], ...] = (
        ("input", data, data_home, "d" * 32), ("workdir", work, work_home, "e" * 32))
    for what, source, home, tree in roots:
        done = trees.stage(tree, LocalOpener(source), f"home:{home}")
        snapshot = done.manifest.snapshot
        pins.append(PinnedTree(what, home, tree, tree, snapshot,
                               manifest_digest(store, tree, snapshot)))
        grants.append(TreeGrant(what, home, tree, tree, master.ring(tree)))
    ring = RunKeyRing.of(os.urandom(32))
    record = WorldRecord(RUN, tuple(pins), time.time())
    write_world_record(store, ring, record, os.urandom)
    subprocess.run(["chmod", "-R", "a+rX", str(store_dir)], check=True)
    report = base / "report.txt"
    return Staged(store, KeyReply(RUN, ring, trees=tuple(grants)), record,
                  World((Input(data_home),)), data_home, work_home, files, report, base)


def userns_works(base: Path) -> bool:
    probe = base / "probe"
    probe.mkdir()
    probe.chmod(0o777)
    result = as_uid(ALICE.uid, lambda: _probe(probe))
    return result == "ok"


def _probe(directory: Path) -> None:
    node = Node.probe(directory, PYTHON)
    if node.userns is not None:
        raise RuntimeError(node.userns)


def build_image(directory: Path) -> None:
    """A tiny root: dash and the libraries it loads, and a file to tell it by."""
    for binary in ("/bin/dash", "/bin/cat"):
        shutil.copy2(binary, directory / "bin" / Path(binary).name)
        libraries = subprocess.run(["ldd", binary], capture_output=True, text=True,
                                   check=True).stdout
        for word in libraries.split():
            if word.startswith("/") and Path(word).exists():
                target = directory / word.lstrip("/")
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(word, target)
