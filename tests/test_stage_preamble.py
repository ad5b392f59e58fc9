"""A moved job's preamble (issue 31 item 3; stage.preamble, stage.run): the run's world
record read under the run key, each pinned snapshot checked and materialised as alice into
her private workspace, her script run in the presented world; bob cannot read it; a
manifest other than the pinned one and a flipped byte in a pack are refused, never used;
a bad read is fetched once more. No Slurm, no daemon: the key reply is built here as the
daemon would send it, and the trees are staged here (as root, reading alice's files; the
home job stages them as alice in the wiring).
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from slurm_geo.ckpt.format.keys import KeyFile, RunKeyRing
from slurm_geo.ckpt.stores.store import Store
from slurm_geo.lease.client import FederatedRun, Fenced
from slurm_geo.lease.handoff import ENV_KEY_HANDOFF, HandoffError, bound_to, open_reply, seal_reply
from slurm_geo.lease.protocol import KeyReply, TreeGrant
from slurm_geo.policy.world import Input, World
from slurm_geo.sandbox.users import ALICE, BOB
from slurm_geo.stage.keys import MasterTreeKeys
from slurm_geo.stage.preamble import enter_world, supervise
from slurm_geo.stage.record import PinnedTree, manifest_digest, write_world_record
from slurm_geo.stage.trees import Trees
from slurm_geo.stage.walk import LocalOpener
from tests.helpers import as_uid
from tests.kit.stage import (  # noqa: F401 - base_fixture: the fixture base
    MASTER,
    PYTHON,
    RUN,
    Staged,
    base_fixture,
    home_path,
    stage_world,
)

SCRIPT = b"""#!/bin/bash
set -e
data="$SLURM_GEO_WORLD_ROOT$DATA_HOME"
cd "$data"
sha256sum tokens.bin sub/labels.txt > "$REPORT"
echo "mode=$SLURM_GEO_WORLD_MODE" >> "$REPORT"
echo "cwd=$OLDPWD" >> "$REPORT"
echo "project=$(cat "$SLURM_GEO_WORKDIR/project.txt")" >> "$REPORT"
if [ -n "$WAIT_FOR" ]; then
  touch "$WAIT_FOR.ready"
  for i in $(seq 600); do [ -e "$WAIT_FOR" ] && break; sleep 0.1; done
fi
exit 7
"""


def as_alice(staged: Staged, store: Store | None = None, wait_for: Path | None = None,
             reply: KeyReply | None = None) -> tuple[str, str, str]:
    """Run the preamble as alice: (as_uid's answer, the job's output, the preamble's
    stderr)."""
    out, err = staged.base / "out.txt", staged.base / "err.txt"
    for path in (out, err):
        path.touch()
        path.chmod(0o666)
    environ = {"PATH": "/usr/bin:/bin", "DATA_HOME": staged.data_home,
               "REPORT": str(staged.report), "WAIT_FOR": str(wait_for or "")}

    def alice() -> None:
        with open(out, "w") as job_out, open(err, "w") as job_err:
            rc = enter_world(reply or staged.reply, store or staged.store, SCRIPT,
                             staged.world, "42", base=staged.base, environ=environ,
                             out=job_out, err=job_err, python=PYTHON)
        if rc != 7:
            raise AssertionError(f"the script's exit code came back as {rc}")
    answer = as_uid(ALICE.uid, alice)
    return answer, out.read_text(), err.read_text()


def read_report(staged: Staged) -> dict[str, str]:
    lines = staged.report.read_text().splitlines()
    hashes = {line.split()[1]: line.split()[0] for line in lines[:2]}
    assert hashes == {n: hashlib.sha256(d).hexdigest() for n, d in staged.files.items()}
    return dict(line.split("=", 1) for line in lines[2:])


def workspace_of(base: Path) -> Path:
    return base / f"slurm-geo-{ALICE.uid}" / "job-42"


@pytest.mark.root(reason="runs as other users or in namespaces (failed as nobody)")
def test_the_pinned_world_is_materialised_and_the_script_reads_it_as_alice(base: Path) -> None:
    staged = stage_world(base, "ok")
    flag = base / "bob-checked"
    found: list[tuple[str, str, str]] = []
    job = threading.Thread(target=lambda: found.append(as_alice(staged, wait_for=flag)))
    job.start()
    try:
        deadline = time.monotonic() + 120
        while not Path(f"{flag}.ready").exists() and job.is_alive() \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        materialised = workspace_of(base) / "world" / staged.data_home.lstrip("/")
        assert materialised.is_dir()  # root sees it: alice's job is running
        bob = as_uid(BOB.uid, lambda: (materialised / "tokens.bin").read_bytes())
        assert bob.startswith("PermissionError"), bob
        bob_list = as_uid(BOB.uid, lambda: os.listdir(workspace_of(base)))
        assert bob_list.startswith("PermissionError"), bob_list
    finally:
        flag.touch()
        job.join(180)
    answer, out, err = found[0]
    assert answer == "ok", (answer, err)
    report = read_report(staged)
    mode = report["mode"]
    assert out.startswith(f"slurm-geo: world: {mode} ("), out
    assert report["project"] == "llm-7b"
    # The job starts in its working directory: its home path, or its mapped place.
    root = "" if mode != "mapped" else str(workspace_of(base) / "world")
    assert report["cwd"] == root + staged.work_home
    assert not workspace_of(base).exists(), "the workspace outlived the job"


@pytest.mark.root(reason="runs as other users or in namespaces (failed as nobody)")
def test_a_manifest_that_is_not_the_pinned_one_is_refused(base: Path) -> None:
    staged = stage_world(base, "pin")
    wrong = replace(staged.record.trees[0], manifest_sha256="0" * 64)
    record = replace(staged.record, trees=(wrong, *staged.record.trees[1:]))
    write_world_record(staged.store, staged.reply.data_keys, record, os.urandom)
    subprocess.run(["chmod", "-R", "a+rX", str(base / "store")], check=True)
    answer, out, err = as_alice(staged)
    assert answer.startswith("PinMismatch: ") and "\n" not in answer, answer
    assert "pinned; it was replaced in the store" in answer
    assert "fetching it once more" not in err  # a substitution is not fetched again
    assert not staged.report.exists(), "the script ran on a world it was not given"


def flip_a_byte(store_dir: Path, domain: str) -> None:
    packs = sorted((store_dir / "tree-packs" / domain).rglob("*"))
    pack = next(p for p in packs if p.is_file())
    data = bytearray(pack.read_bytes())
    data[len(data) // 2] ^= 0x01
    pack.chmod(0o644)
    pack.write_bytes(bytes(data))


@pytest.mark.root(reason="runs as other users or in namespaces (failed as nobody)")
def test_a_flipped_byte_in_a_pack_is_refused_never_used(base: Path) -> None:
    staged = stage_world(base, "flip")
    flip_a_byte(base / "store", "d" * 32)
    answer, out, err = as_alice(staged)
    assert answer.startswith("CorruptObject: "), answer
    assert "fetching it once more" in err  # once, then refused
    assert not staged.report.exists(), "the script ran on a corrupt world"
    assert not workspace_of(base).exists()


class FlipsFirstRead:
    """A store whose first read of a pack comes back with one bit flipped (a transfer
    damaged on the way): the next read is whole."""

    def __init__(self, store: Store):
        self._store = store
        self.flipped = False

    def _maybe_flip(self, name: str, data: bytes) -> bytes:
        if name.startswith("tree-packs/") and not self.flipped and len(data) > 64:
            self.flipped = True
            damaged = bytearray(data)
            damaged[-20] ^= 0x01
            return bytes(damaged)
        return data

    def get(self, name: str) -> bytes:
        return self._maybe_flip(name, self._store.get(name))

    def get_range(self, name: str, offset: int, length: int) -> bytes:
        return self._maybe_flip(name, self._store.get_range(name, offset, length))  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


@pytest.mark.root(reason="runs as other users or in namespaces (failed as nobody)")
def test_a_damaged_read_is_fetched_once_more_and_the_job_reads_whole_data(base: Path) -> None:
    staged = stage_world(base, "flaky")
    answer, out, err = as_alice(staged, store=FlipsFirstRead(staged.store))  # type: ignore[arg-type]
    assert answer == "ok", (answer, err)
    assert "fetching it once more" in err
    read_report(staged)  # byte-identical


@pytest.mark.root(reason="runs as other users or in namespaces (failed as nobody)")
def test_a_run_with_no_world_record_runs_its_script_as_before(base: Path) -> None:
    staged = stage_world(base, "none")
    (base / "store" / "worlds" / RUN).unlink()
    script = b"#!/bin/bash\necho ran as $(id -u) > \"$REPORT\"\nexit 7\n"
    staged.report.touch()
    staged.report.chmod(0o666)

    def alice() -> None:
        output = io.StringIO()
        with open(os.devnull, "w") as sink:
            rc = enter_world(staged.reply, staged.store, script, World(), "43", base=base,
                             environ={"REPORT": str(staged.report), "PATH": "/usr/bin:/bin"},
                             out=sink, err=output, python=PYTHON)
        assert rc == 7, rc
    assert as_uid(ALICE.uid, alice) == "ok"
    assert staged.report.read_text() == f"ran as {ALICE.uid}\n"


def test_the_key_reply_is_handed_to_the_trainer_for_this_incarnation_only() -> None:
    secret = os.urandom(32).hex()
    ring = RunKeyRing.of(os.urandom(32))
    reply = KeyReply("run-1", ring, {"AWS_ACCESS_KEY_ID": "k"},
                     (TreeGrant("input", "/d", "a" * 32, "a" * 32, ring),))
    bound = bound_to("lj-1", 2, "rented", 17, 0)
    session = os.urandom(32).hex()
    sealed = seal_reply(reply, session, secret, bound)
    assert open_reply(sealed, secret, bound) == (reply, session)
    assert session not in sealed
    assert ring.current.data_key.hex() not in sealed
    for other_secret, other_bound in ((os.urandom(32).hex(), bound),
                                      (secret, bound_to("lj-1", 2, "rented", 17, 1))):
        with pytest.raises(HandoffError):
            open_reply(sealed, other_secret, other_bound)
    env = {"SLURM_GEO_GENERATION": "2", "SLURM_GEO_LEASE_SECRET": secret,
           "SLURM_GEO_FEDERATION_URL": "https://127.0.0.1:9", "SLURM_GEO_STORE": "file:///x",
           "SLURM_GEO_KEY_TOKEN": "t", "SLURM_GEO_LOGICAL_JOB": "lj-1",
           "SLURM_CLUSTER_NAME": "rented", "SLURM_JOB_ID": "17", ENV_KEY_HANDOFF: sealed}
    saved = dict(os.environ)
    try:
        federated = FederatedRun.from_environment("run-1", dict(env))
        assert federated.run_key() == ("run-1", ring)  # no daemon asked: none listens there
        assert federated.key_reply().trees == reply.trees
        # The preamble's first lease spent the bootstrap secret: the session's signs.
        assert federated._signer._secret == bytes.fromhex(session)  # type: ignore[attr-defined]
        env["SLURM_JOB_RESTART_COUNT"] = "1"  # a requeue asks the daemon again
        with pytest.raises(Fenced):
            FederatedRun.from_environment("run-1", dict(env))
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_signals_slurm_sends_the_batch_step_reach_the_script(tmp_path: Path) -> None:
    ready, got = tmp_path / "ready", tmp_path / "got"
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\ntrap 'echo usr1 > {got}; exit 0' USR1\ntouch {ready}\n"
                      "for i in $(seq 600); do sleep 0.1; done\nexit 3\n")
    script.chmod(0o755)

    def poke() -> None:
        for _ in range(600):
            if ready.exists():
                os.kill(os.getpid(), signal.SIGUSR1)
                return
            time.sleep(0.05)
    threading.Thread(target=poke, daemon=True).start()
    with open(os.devnull, "w") as sink:
        assert supervise([str(script)], dict(os.environ), None, sink) == 0
    assert got.read_text() == "usr1\n"


def test_a_squashfs_environment_runs_the_script_inside_the_image(base: Path) -> None:
    """--geo-env an enroot squashfs image, staged as a one-file tree: the preamble unpacks
    it as the root and runs the job's script inside it (a copy in the image's root: the
    workspace is not there), the dataset at its home path in it."""
    from tests.kit.stage import build_image, userns_works

    if not (shutil.which("mksquashfs") and shutil.which("unsquashfs")):
        pytest.skip("squashfs-tools is not installed (make install adds it)")
    if not userns_works(base):
        pytest.skip("this machine allows no unprivileged user namespace")
    staged = stage_world(base, "img")
    image_root = base / "image-root"
    for sub in ("bin", "etc", "dev", "proc", "sys", "tmp"):
        (image_root / sub).mkdir(parents=True)
    build_image(image_root)
    (image_root / "bin" / "sh").symlink_to("dash")
    (image_root / "etc" / "geo-image").write_text("inside the image\n")
    image = base / "trainer.sqsh"
    subprocess.run(["mksquashfs", str(image_root), str(image), "-quiet", "-noappend",
                    "-all-root"], check=True, capture_output=True)
    image_home = home_path("img") + "/images/trainer.sqsh"
    master = MasterTreeKeys(staged.store, KeyFile(MASTER))
    tree = "f" * 32
    done = Trees(staged.store, master).stage(tree, LocalOpener(image), f"home:{image_home}")
    pin = PinnedTree("env", image_home, tree, tree, done.manifest.snapshot,
                     manifest_digest(staged.store, tree, done.manifest.snapshot))
    write_world_record(staged.store, staged.reply.data_keys,
                       replace(staged.record, trees=(*staged.record.trees, pin)), os.urandom)
    subprocess.run(["chmod", "-R", "a+rX", str(base / "store")], check=True)
    reply = replace(staged.reply, trees=(*staged.reply.trees,
                                          TreeGrant("env", image_home, tree, tree,
                                                    master.ring(tree))))
    world = World((Input(staged.data_home),), image_home)
    script = (b"#!/bin/sh\ncat /etc/geo-image\ncat \"$DATA_HOME/sub/labels.txt\"\n"
              b"echo \"$SLURM_GEO_WORLD_MODE $0\"\nexit 7\n")
    out = base / "img-out.txt"
    out.touch()
    out.chmod(0o666)

    def alice() -> None:
        with open(out, "w") as job_out, open(os.devnull, "w") as job_err:
            rc = enter_world(reply, staged.store, script, world, "44", base=base,
                             environ={"PATH": "/bin", "DATA_HOME": staged.data_home},
                             out=job_out, err=job_err, python=PYTHON)
        assert rc == 7, rc
    answer = as_uid(ALICE.uid, alice)
    assert answer == "ok", (answer, out.read_text())
    lines = out.read_text().splitlines()
    assert lines[0].startswith("slurm-geo: world: container ("), lines
    assert lines[1:] == ["inside the image", "cat", "dog",
                         "container /.slurm-geo-job-script"], lines
