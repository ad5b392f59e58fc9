"""A moved job's world at the destination (issue 31 item 3; docs/training.md "A moved
job's world"): materialised as the owner in a private workspace, presented at its home
paths in a user and mount namespace (or mapped under $SLURM_GEO_WORLD_ROOT where the node
allows none), a venv run at its home path, a squashfs image unpacked and run as the root;
bob cannot read alice's world; the choice of mode table-tested.

The actions run as alice (uid 2001) and bob (2002) in forked children (tests.helpers.as_uid),
on a base directory under /var/tmp they may both create in.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_geo.ckpt.format.keys import KeyFile
from slurm_geo.ckpt.stores.store import LocalDirStore
from slurm_geo.policy.world import Input, World
from slurm_geo.sandbox.users import ALICE, BOB
from slurm_geo.stage.keys import MasterTreeKeys
from slurm_geo.stage.node import Node, NodeLacks, choose
from slurm_geo.stage.present import (
    PresentError,
    StagedRoot,
    apptainer_argv,
    prepare,
    run,
    wanted_roots,
)
from slurm_geo.stage.trees import Trees
from slurm_geo.stage.walk import LocalOpener
from slurm_geo.stage.workspace import Workspace, WorkspaceError
from tests.helpers import as_uid, reachable_dir
from tests.kit.stage import build_image, userns_works

MASTER = bytes(range(32))
PYTHON = "/usr/bin/python3"  # one alice may run (the test runner's may be root's own)
OPEN = Node(userns=None, unsquashfs="/usr/bin/unsquashfs", apptainer=None)
CLOSED = Node(userns="unshare(user, mount namespaces): Operation not permitted")


@pytest.fixture
def base() -> Iterator[Path]:
    """A directory alice and bob may both create in (as /scratch is), removed after."""
    with reachable_dir("present", 0o1777, "/var/tmp") as path:
        yield path


def missing_home(tag: str) -> str:
    """A home path that exists nowhere on this machine (its parent neither)."""
    return f"/slurm-geo-home-{os.getpid()}-{tag}/data"


# The choice of mode: pure, table-tested.

@pytest.mark.parametrize("node, env, mode", [
    (OPEN, None, "namespace"),
    (OPEN, "/home/alice/venv", "namespace"),
    (OPEN, "/home/alice/img.sqsh", "container"),
    (CLOSED, None, "mapped"),
    (CLOSED, "/home/alice/venv", "mapped"),
    (Node(None, apptainer="/usr/bin/apptainer"), "/x/img.sif", "apptainer"),
    (Node("no", apptainer="/usr/bin/apptainer"), "/x/img.sif", "apptainer"),
])
def test_choice_of_mode(node: Node, env: str | None, mode: str) -> None:
    assert choose(node, env).mode == mode


@pytest.mark.parametrize("node, env, says", [
    (OPEN, "/x/img.sif", "has no apptainer on PATH"),
    (CLOSED, "/x/img.sqsh", "allows no user namespace to run it in"),
    (Node(None, unsquashfs=None), "/x/img.squashfs", "no unsquashfs (Debian: squashfs-tools)"),
])
def test_an_environment_the_node_cannot_run_is_refused_in_one_line(
        node: Node, env: str, says: str) -> None:
    with pytest.raises(NodeLacks) as caught:
        choose(node, env)
    assert says in str(caught.value) and "\n" not in str(caught.value)
    assert env in str(caught.value)


def test_roots_in_order_and_a_script_inside_the_workdir_not_twice() -> None:
    world = World((Input("/pfs/data", "restricted"), Input("/home/alice/cfg")),
                  "/home/alice/venv", ("/home/alice/runs",))
    assert wanted_roots(world, "/home/alice/llm", "/home/alice/llm/train.sh") == [
        ("input", "/pfs/data", True), ("input", "/home/alice/cfg", True),
        ("env", "/home/alice/venv", True), ("workdir", "/home/alice/llm", False),
        ("output", "/home/alice/runs", False)]
    assert ("script", "/spool/job1/script", True) in wanted_roots(
        world, "/home/alice/llm", "/spool/job1/script")


# The workspace: private, swept when stale, removed at the end.

@pytest.mark.root(reason="runs as other users or in namespaces (failed as nobody)")
def test_workspace_is_private_and_bob_cannot_read_it(base: Path) -> None:
    def alice() -> None:
        workspace = Workspace(base, "101").open()
        secret = workspace.at("/pfs/data/tokens.bin")
        secret.parent.mkdir(parents=True)
        secret.write_bytes(b"alice's tokens")
        secret.chmod(0o644)  # world-readable by its own mode: the workspace keeps it
        secret.parent.chmod(0o755)
        (base / "path").write_text(str(secret))
        os._exit(0)  # keep the lock's holder gone without cleanup: as a killed job
    assert as_uid(ALICE.uid, alice) in ("ok", "")
    secret = Path((base / "path").read_text())
    workspace = secret.parents[3]
    assert oct(workspace.stat().st_mode & 0o777) == "0o700"
    assert oct(workspace.parent.stat().st_mode & 0o777) == "0o700"
    assert workspace.parent.stat().st_uid == ALICE.uid
    bob = as_uid(BOB.uid, secret.read_bytes)
    assert bob.startswith("PermissionError"), bob
    bob_list = as_uid(BOB.uid, lambda: os.listdir(workspace.parent))
    assert bob_list.startswith("PermissionError"), bob_list


@pytest.mark.root(reason="runs as other users or in namespaces (failed as nobody)")
def test_a_stale_workspace_of_a_killed_job_does_not_block_the_next(base: Path) -> None:
    def killed() -> None:
        Workspace(base, "7").open()
        os._exit(0)  # killed: no cleanup, the lock goes with the process

    def next_jobs() -> None:
        with Workspace(base, "7") as again:  # the same job's next incarnation
            assert again.world.is_dir()
            with Workspace(base, "8") as other:  # another job of hers meanwhile
                assert again.path.exists(), "a running job's workspace was swept"
                assert other.path.exists()
            assert not other.path.exists()
        assert not again.path.exists()

    as_uid(ALICE.uid, killed)
    assert (base / f"slurm-geo-{ALICE.uid}" / "job-7").exists()
    assert as_uid(ALICE.uid, next_jobs) == "ok"


@pytest.mark.root(reason="runs as other users or in namespaces (failed as nobody)")
def test_a_user_directory_of_someone_else_is_refused(base: Path) -> None:
    (base / f"slurm-geo-{ALICE.uid}").mkdir()  # root's: as an attacker's would be
    answer = as_uid(ALICE.uid, lambda: Workspace(base, "1").open())
    assert answer.startswith("WorkspaceError") and "is not a directory of uid 2001" in answer
    with pytest.raises(WorkspaceError):
        Workspace(base, "../x")


# Presenting, as alice.

def staged(base: Path, source: Path) -> tuple[LocalDirStore, StagedRoot]:
    """`source` staged into a store under `base` that alice can read."""
    store_dir = base / "store"
    store_dir.mkdir(exist_ok=True)
    store = LocalDirStore(store_dir)
    trees = Trees(store, MasterTreeKeys(store, KeyFile(MASTER)))
    tree = f"t{abs(hash(str(source))) % 10**9}"
    done = trees.stage(tree, LocalOpener(source), f"home:{source}")
    subprocess.run(["chmod", "-R", "a+rX", str(store_dir)], check=True)
    return store, StagedRoot(tree, done.manifest.snapshot)


def write_dataset(root: Path) -> dict[str, bytes]:
    files = {"tokens.bin": os.urandom(300_000), "sub/labels.txt": b"cat\ndog\n"}
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    os.symlink("tokens.bin", root / "current")
    return files


CHECK = r"""
import hashlib, json, os, subprocess, sys
root = os.environ["SLURM_GEO_WORLD_ROOT"]
data = root + sys.argv[1]
found = {n: hashlib.sha256(open(os.path.join(data, n), "rb").read()).hexdigest()
         for n in ("tokens.bin", "sub/labels.txt")}
try:
    open(os.path.join(data, "new"), "w")
    writable = True
except OSError as exc:
    writable = exc.strerror
child = subprocess.run([sys.executable, "-c", "import os, sys; "
                        "print(os.path.exists(sys.argv[1]))", data],
                       capture_output=True, text=True).stdout.strip()
out = os.environ["SLURM_GEO_OUTPUT_0"]
open(os.path.join(out, "weights.bin"), "wb").write(b"w")
json.dump({"hashes": found, "writable": writable, "child": child, "uid": os.getuid(),
           "link": os.readlink(os.path.join(data, "current")),
           "mode": os.environ["SLURM_GEO_WORLD_MODE"], "input": os.environ["SLURM_GEO_INPUT_0"],
           "cwd": os.getcwd()}, open(sys.argv[2], "w"))
"""


def present_and_check(base: Path, node: Node | None, mode: str) -> dict[str, Any]:
    source = base / "home-data"
    files = write_dataset(source)
    store, root = staged(base, source)
    home, out_home = missing_home(mode), missing_home(mode + "-out")
    world = World((Input(home),), None, (out_home,))
    report = base / f"report-{mode}.json"
    lines = base / f"line-{mode}.txt"
    report.touch()
    report.chmod(0o666)
    lines.touch()
    lines.chmod(0o666)

    def alice() -> None:
        trees = Trees(store, MasterTreeKeys(store, KeyFile(MASTER)))
        with Workspace(base, f"job-{mode}") as workspace:
            scratch = workspace.path / "probe"
            scratch.mkdir()
            found = node or Node.probe(scratch, PYTHON)
            presentation = prepare(world, {home: root}, workspace, found, trees)
            with open(lines, "w") as out:
                rc = run(presentation, [PYTHON, "-c", CHECK, home, str(report)], out,
                         PYTHON)
            assert rc == 0, rc
            output = presentation.roots[-1].at / "weights.bin"
            with open(lines, "a") as out:
                print(output.stat().st_uid, file=out)
    answer = as_uid(ALICE.uid, alice)
    assert answer == "ok", answer
    got = json.loads(report.read_text())
    line, uid = lines.read_text().splitlines()
    assert line.startswith(f"slurm-geo: world: {mode} (") and home in line
    import hashlib
    assert got["hashes"] == {n: hashlib.sha256(d).hexdigest() for n, d in files.items()}
    assert got["writable"] == "Read-only file system" or mode == "mapped"
    assert got["child"] == "True" and got["uid"] == ALICE.uid and uid == str(ALICE.uid)
    assert got["link"] == "tokens.bin" and got["mode"] == mode
    assert not (base / f"slurm-geo-{ALICE.uid}" / f"job-job-{mode}").exists(), "not cleaned up"
    return dict(got)


def test_a_staged_input_at_its_home_path_read_only_as_alice(base: Path) -> None:
    if not userns_works(base):
        pytest.skip("this machine allows no unprivileged user namespace")
    got = present_and_check(base, None, "namespace")
    assert got["input"] == missing_home("namespace")
    assert not Path(missing_home("namespace")).exists(), "a home path made on the host"


@pytest.mark.root(reason="runs as other users or in namespaces (failed as nobody)")
def test_the_mapped_mode_where_no_namespace_is_allowed(base: Path) -> None:
    got = present_and_check(base, CLOSED, "mapped")
    assert got["input"].endswith("/world" + missing_home("mapped"))


@pytest.mark.root(reason="runs as other users or in namespaces (failed as nobody)")
def test_a_root_without_a_staged_tree_is_refused_by_name(base: Path) -> None:
    def alice() -> None:
        with Workspace(base, "9") as workspace:
            prepare(World((Input("/pfs/x"),)), {}, workspace, OPEN)
    answer = as_uid(ALICE.uid, alice)
    assert answer.startswith("PresentError") and "no staged tree for the input '/pfs/x'" \
        in answer, answer
    assert PresentError.exit_code == 2


def test_a_venv_at_its_home_path_runs_its_python_and_scripts(base: Path) -> None:
    if not userns_works(base):
        pytest.skip("this machine allows no unprivileged user namespace")
    home = str(base / "venv-home" / "venv")
    # Built at its home path once, then moved away: its bin/ scripts and pyvenv.cfg name
    # `home`, which no longer exists on the node.
    built = base / "venv-built"
    subprocess.run(["sh", "-c",
                    f"{PYTHON} -m venv --without-pip {home} && "
                    f"printf '#!{home}/bin/python\\nimport sys; print(sys.prefix)\\n' "
                    f"> {home}/bin/where && chmod 755 {home}/bin/where && "
                    f"mv {home} {built} && rmdir {base / 'venv-home'}"], check=True)
    subprocess.run(["chmod", "-R", "a+rX", str(built)], check=True)
    out = base / "venv-out.txt"
    out.touch()
    out.chmod(0o666)

    def alice() -> None:
        with Workspace(base, "venv") as workspace:
            presentation = prepare(World((), home), {home: built}, workspace, OPEN)
            with open(out, "w") as sink:
                rc = run(presentation, ["sh", "-c", "where && python -c 'import sys; "
                                        "print(sys.executable)' && echo $VIRTUAL_ENV"],
                         sink, PYTHON)
            assert rc == 0, out.read_text()
    answer = as_uid(ALICE.uid, alice)
    assert answer == "ok", answer
    lines = out.read_text().splitlines()
    assert lines[1:] == [home, f"{home}/bin/python", home], lines


def test_apptainer_argv_binds_every_root_at_its_home_path() -> None:
    from slurm_geo.stage.node import Choice
    from slurm_geo.stage.present import Presentation, Root
    presentation = Presentation(
        Choice("apptainer", "x"),
        (Root("input", "/pfs/data", Path("/s/w/pfs/data"), True),
         Root("env", "/home/a/img.sif", Path("/s/w/home/a/img.sif"), True, True),
         Root("workdir", "/home/a/llm", Path("/s/w/home/a/llm"), False)),
        2001, 2001, Path("/s/w"), Path("/s/r"), Path("/s/w/home/a/img.sif"), "sif")
    assert apptainer_argv(presentation, ["python", "train.py"]) == [
        "apptainer", "exec", "--bind", "/s/w/pfs/data:/pfs/data:ro",
        "--bind", "/s/w/home/a/llm:/home/a/llm:rw", "--pwd", "/home/a/llm",
        "/s/w/home/a/img.sif", "python", "train.py"]
    variables = presentation.variables("/usr/bin")
    assert variables["SLURM_GEO_INPUT_0"] == "/pfs/data"
    assert variables["SLURM_GEO_WORLD_ROOT"] == ""
    assert variables["SLURM_GEO_WORKDIR"] == "/home/a/llm"


def test_a_squashfs_image_unpacked_and_run_as_the_root(base: Path) -> None:
    if not (shutil.which("mksquashfs") and shutil.which("unsquashfs")):
        pytest.skip("squashfs-tools is not installed (make install adds it)")
    if not userns_works(base):
        pytest.skip("this machine allows no unprivileged user namespace")
    image_root = base / "image-root"
    for sub in ("bin", "etc", "dev", "proc", "sys", "tmp"):
        (image_root / sub).mkdir(parents=True)
    build_image(image_root)
    (image_root / "bin" / "sh").symlink_to("dash")
    (image_root / "etc" / "geo-image").write_text("inside the image\n")
    image_home = "/home/alice/images/trainer.sqsh"
    image_file = base / "trainer.sqsh"
    subprocess.run(["mksquashfs", str(image_root), str(image_file), "-quiet", "-noappend",
                    "-all-root"], check=True, capture_output=True)
    image_file.chmod(0o644)
    data = base / "data"
    data.mkdir()
    (data / "x").write_text("the dataset\n")
    (data / "x").chmod(0o644)
    data.chmod(0o755)
    home = "/pfs/data"
    out = base / "image-out.txt"
    out.touch()
    out.chmod(0o666)

    def alice() -> None:
        with Workspace(base, "img") as workspace:
            node = Node(None, shutil.which("unsquashfs"))
            presentation = prepare(World((Input(home),), image_home),
                                   {home: data, image_home: image_file}, workspace, node)
            with open(out, "w") as sink:
                rc = run(presentation, ["/bin/sh", "-c", "cat /etc/geo-image /pfs/data/x; "
                                        "echo $SLURM_GEO_INPUT_0; "
                                        "echo > /pfs/data/y || echo read-only"], sink, PYTHON)
            assert rc == 0, out.read_text()
    answer = as_uid(ALICE.uid, alice)
    assert answer == "ok", answer
    lines = out.read_text().splitlines()
    assert lines[0].startswith("slurm-geo: world: container (")
    assert lines[1:3] == ["inside the image", "the dataset"]
    assert lines[3] == "/pfs/data" and lines[-1] == "read-only", lines


def test_a_home_path_under_an_existing_directory_keeps_the_nodes_entries(base: Path) -> None:
    """/home/alice missing under the node's /home: the node's /home/geo-alice stays."""
    if not userns_works(base):
        pytest.skip("this machine allows no unprivileged user namespace")
    (base / "node-entry").mkdir()
    (base / "node-entry" / "f").write_text("the node's\n")
    subprocess.run(["chmod", "-R", "a+rX", str(base / "node-entry")], check=True)
    data = base / "data"
    data.mkdir()
    (data / "x").write_text("presented\n")
    subprocess.run(["chmod", "-R", "a+rX", str(data)], check=True)
    home = str(base / "absent" / "data")
    out = base / "shadow-out.txt"
    out.touch()
    out.chmod(0o666)

    def alice() -> None:
        with Workspace(base, "shadow") as workspace:
            presentation = prepare(World((Input(home),)), {home: data}, workspace, OPEN)
            with open(out, "w") as sink:
                rc = run(presentation, ["sh", "-c", f"cat {home}/x {base}/node-entry/f"],
                         sink, PYTHON)
            assert rc == 0, out.read_text()
    answer = as_uid(ALICE.uid, alice)
    assert answer == "ok", answer
    assert out.read_text().splitlines()[1:] == ["presented", "the node's"]
    assert not (base / "absent").exists(), "a home path made on the node's disk"
