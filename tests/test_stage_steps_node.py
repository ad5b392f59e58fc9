"""A moved job's world on a node other than the batch node, for the tasks of its srun
steps (issue 31 item 3; stage.nodeworld, stage.task), without Slurm: as alice, the world
step's share for node "n2" materialises the pinned world from the store with the keys
sealed for it, and two tasks started there at once each enter it and hash the input at
its home path (byte-identical), read-only, from the directory srun ran in; bob cannot
read it; a task on a node with no world is refused in one line; a task's `python` is the
venv's, staged only at home, at the venv's home path (its PATH and VIRTUAL_ENV). The sandbox test
(test_stage_steps_sandbox.py) runs the same through real srun steps on two nodes.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_geo.ckpt.format.keys import KeyFile, RunKeyRing
from slurm_geo.ckpt.stores.store import LocalDirStore
from slurm_geo.lease.protocol import ENV_LEASE_SECRET, ENV_STORE, KeyReply, TreeGrant
from slurm_geo.sandbox.users import ALICE, BOB
from slurm_geo.stage import task
from slurm_geo.stage.keys import MasterTreeKeys
from slurm_geo.stage.nodeworld import present_here
from slurm_geo.stage.record import PinnedTree, WorldRecord, manifest_digest, write_world_record
from slurm_geo.stage.steps import node_workspace, seal_node_keys
from slurm_geo.stage.trees import Trees
from slurm_geo.stage.walk import LocalOpener
from tests.helpers import as_uid
from tests.kit.stage import (  # noqa: F401 - base_fixture: the fixture base
    MASTER,
    PYTHON,
    RUN,
    base_fixture,
    home_path,
    stage_world,
)

TASK_SCRIPT = """
data="$SLURM_GEO_WORLD_ROOT$DATA_HOME"
sha256sum < "$data/tokens.bin" > "$OUT"
echo "mode=$SLURM_GEO_WORLD_MODE input=$SLURM_GEO_INPUT_0 pwd=$(pwd)" >> "$OUT"
touch "$data/new" 2>/dev/null && echo "wrote" >> "$OUT" || echo "read-only" >> "$OUT"
"""


def run_task(environ: dict[str, str], base_dir: Path, cwd: str, out: Path) -> int:
    """One task, as the step's task would run (a forked process that becomes its
    command); its exit code."""
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            os.environ.clear()
            os.environ.update({**environ, "OUT": str(out)})
            code = task.enter(["/bin/sh", "-c", TASK_SCRIPT], base_dir, cwd, "/ws/bin",
                              None, python=PYTHON)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.root(reason="runs as other users or in namespaces (failed as nobody)")
def test_tasks_on_another_node_read_the_world_fetched_there_at_its_home_paths(
        base: Path) -> None:
    staged = stage_world(base, "nodes")
    environ = {"PATH": "/ws/bin:/usr/bin:/bin", "SLURM_JOB_ID": "42",
               "SLURMD_NODENAME": "n2", "SLURM_RESTART_COUNT": "0",
               ENV_LEASE_SECRET: os.urandom(32).hex(), ENV_STORE: f"file://{base / 'store'}",
               "SLURM_GEO_INPUTS": staged.data_home, "DATA_HOME": staged.data_home,
               # the batch step's, which the task's own replace
               "SLURM_GEO_WORLD_MODE": "batch", "SLURM_GEO_INPUT_0": "/batch/data"}
    sealed = seal_node_keys(staged.reply, environ)
    assert sealed is not None
    outs = [base / f"task-{n}.txt" for n in range(2)]
    codes: list[int] = []

    def alice() -> None:
        workspace = node_workspace(base, "42", "n2").open()
        present_here(workspace, environ, "n1", base / "batch-is-elsewhere", sealed, PYTHON)
        # held as the world step holds it; not closed: root looks in after
        pids = []
        for out in outs:  # two tasks at once, each its own process and namespace
            pid = os.fork()
            if pid == 0:
                os._exit(run_task(environ, base, staged.work_home, out))
            pids.append(pid)
        codes.extend(os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids)
        if codes != [0, 0]:
            raise AssertionError(f"the tasks exited {codes}")
    for out in outs:
        out.touch()
        out.chmod(0o666)
    answer = as_uid(ALICE.uid, alice)
    assert answer == "ok", answer
    digest = hashlib.sha256(staged.files["tokens.bin"]).hexdigest()
    said = [out.read_text().splitlines() for out in outs]
    assert said[0] == said[1], said
    assert said[0][0].split()[0] == digest
    mode = said[0][1].split()[0].removeprefix("mode=")
    assert mode in ("namespace", "mapped"), said
    ws = base / f"slurm-geo-{ALICE.uid}" / "job-42.n2"
    root = "" if mode != "mapped" else str(ws / "world")
    assert said[0][1] == (f"mode={mode} input={root}{staged.data_home} "
                          f"pwd={root}{staged.work_home}")
    if mode == "namespace":
        assert said[0][2] == "read-only"
    materialised = ws / "world" / staged.data_home.lstrip("/") / "tokens.bin"
    assert materialised.read_bytes() == staged.files["tokens.bin"]  # fetched on "n2"
    assert (ws / "world").stat().st_uid == ALICE.uid
    assert oct(ws.stat().st_mode & 0o777) == "0o700"
    bob = as_uid(BOB.uid, lambda: materialised.read_bytes())
    assert bob.startswith("PermissionError"), bob


@pytest.mark.root(reason="runs as other users or in namespaces (failed as nobody)")
def test_a_task_on_a_node_without_the_job_s_world_is_refused_in_one_line(
        base: Path) -> None:
    err = base / "err.txt"
    err.touch()
    err.chmod(0o666)

    def alice() -> None:
        pid = os.fork()
        if pid == 0:
            fd = os.open(err, os.O_WRONLY)
            os.dup2(fd, 2)
            sys.stderr = os.fdopen(2, "w")
            os._exit(task.enter(["true"], base, None, None, None,
                                {"SLURM_JOB_ID": "43", "SLURMD_NODENAME": "n3",
                                 "PATH": "/usr/bin"}))
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if code == 0:
            raise AssertionError("a task ran without its world")
    answer = as_uid(ALICE.uid, alice)
    assert answer == "ok", answer
    said = err.read_text()
    assert said.startswith("slurm-geo: error: node n3: ") and said.count("\n") == 1, said
    assert "world" in said


def test_a_workspace_being_made_is_never_swept_and_a_second_open_is_refused(
        tmp_path: Path) -> None:
    from slurm_geo.stage.workspace import NEW_PREFIX, Workspace, WorkspaceError

    first = Workspace(tmp_path, "7.n1").open()
    user_dir = first.user_dir
    being_made = user_dir / f"{NEW_PREFIX}young"  # another process, between mkdir and lock
    being_made.mkdir()
    left = user_dir / f"{NEW_PREFIX}old"  # a process killed while making one, long ago
    left.mkdir()
    os.utime(left, (0, 0))
    other = Workspace(tmp_path, "7.n2").open()  # sweeps as it opens
    assert being_made.exists() and not left.exists()
    assert first.path.exists(), "a held workspace was swept"
    with pytest.raises(WorkspaceError, match="in use by another process"):
        Workspace(tmp_path, "7.n1").open()
    assert sorted(p.name for p in user_dir.iterdir()) == [f"{NEW_PREFIX}young", "job-7.n1",
                                                          "job-7.n2"]
    first.close()
    other.close()


@pytest.mark.root(reason="runs as other users or in namespaces (failed as nobody)")
def test_a_task_runs_python_from_the_venv_staged_at_its_home_path(
        base: Path) -> None:
    """The ML case: `srun python train.py` (or torchrun) from a venv that exists only
    at home; on the task's node its python is the venv's, at the venv's home path."""
    base_dir = base
    venv, work = base_dir / "home-venv", base_dir / "home-llm"
    subprocess.run([PYTHON, "-m", "venv", "--without-pip", str(venv)], check=True)
    work.mkdir()
    (base_dir / "store").mkdir()
    store = LocalDirStore(base_dir / "store")
    master = MasterTreeKeys(store, KeyFile(MASTER))
    trees = Trees(store, master)
    venv_home, work_home = home_path("venv") + "/venv", home_path("venv") + "/llm"
    pins, grants = [], []
    for what, source, home, tree in (("env", venv, venv_home, "f" * 32),
                                     ("workdir", work, work_home, "c" * 32)):
        snapshot = trees.stage(tree, LocalOpener(source), f"home:{home}").manifest.snapshot
        pins.append(PinnedTree(what, home, tree, tree, snapshot,  # type: ignore[arg-type]
                               manifest_digest(store, tree, snapshot)))
        grants.append(TreeGrant(what, home, tree, tree, master.ring(tree)))
    ring = RunKeyRing.of(os.urandom(32))
    write_world_record(store, ring, WorldRecord(RUN, tuple(pins), time.time()), os.urandom)
    subprocess.run(["chmod", "-R", "a+rX", str(base_dir / "store")], check=True)
    reply = KeyReply(RUN, ring, trees=tuple(grants))
    environ = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "44", "SLURMD_NODENAME": "n2",
               ENV_LEASE_SECRET: os.urandom(32).hex(),
               ENV_STORE: f"file://{base_dir / 'store'}", "SLURM_GEO_ENV": venv_home}
    sealed = seal_node_keys(reply, environ)
    assert sealed is not None
    out = base_dir / "venv.txt"
    out.touch()
    out.chmod(0o666)

    def alice() -> None:
        workspace = node_workspace(base_dir, "44", "n2").open()
        present_here(workspace, environ, "n1", base_dir / "elsewhere", sealed, PYTHON)
        pid = os.fork()
        if pid == 0:
            code = 99
            try:
                os.environ.clear()
                os.environ.update(environ)
                fd = os.open(out, os.O_WRONLY)
                os.dup2(fd, 1)
                code = task.enter(["sh", "-c", 'command -v python; echo "$VIRTUAL_ENV"; '
                                   'python -c "import sys; print(sys.prefix)"'],
                                  base_dir, work_home, None, None, python=PYTHON)
            finally:
                os._exit(code)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        workspace.close()
        if code != 0:
            raise AssertionError(f"the task exited {code}")
    answer = as_uid(ALICE.uid, alice)
    assert answer == "ok", answer
    said = out.read_text().splitlines()
    mapped = str(base_dir / f"slurm-geo-{ALICE.uid}" / "job-44.n2" / "world")
    at = venv_home if not said[0].startswith(mapped) else mapped + venv_home
    assert said == [f"{at}/bin/python", at, at], said
