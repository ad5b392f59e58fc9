"""A moved job's preamble: its world materialised and presented, then its own script run in
it, as the job's user (issue 31 item 3; docs/training.md "A moved job's world").

On a cluster with none of home's files the daemon submits a small wrapper instead of the
job's script (federation.resubmit.wrapped_script); it runs `python -m slurm_geo.stage.run`
(the thin CLI), which gets the incarnation's key reply (lease.client: the run's key ring
and the key rings of its world's trees), opens the site's store and calls `enter_world`:

1. the run's world record (`worlds/<run>`, stage.record), sealed under the run key: the
   pinned snapshot and manifest hash of each root; none: the script runs as before,
   without its world (one line says so);
2. every pinned manifest read is checked against its pin (`PinnedStore`): a snapshot put
   in its place (by another holder of a shared domain's key) is refused, `CorruptObject`,
   exit 21, never followed to `tree-latest`;
3. each root materialised into the job's private workspace (stage.present.prepare,
   stage.trees: every chunk checked against its keyed id); a damaged or unreadable chunk
   fails that root, which is fetched once more from scratch (`RefetchingTrees`), then
   refused: never used;
4. the job's script (the text Slurm held for the job at home, carried in the wrapper) run
   in the presented world, signals passed on to it; its exit code is the job's. The
   preamble holds the lease (renewing it) until then, and hands the key reply and the
   lease on to the trainer right before (`handover`, lease.handoff);
5. `at_start` with the presentation right before the script starts, and `at_exit` with
   it and the exit code, before the workspace is removed: the outputs' uploader
   (stage.shipping) ships the job's log and outputs home from there.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from slurm_geo.ckpt.errors import CorruptObject, StoreUnavailable
from slurm_geo.ckpt.stores.store import Store
from slurm_geo.jobenv import JobEnv
from slurm_geo.lease.protocol import KeyReply
from slurm_geo.policy.world import World
from slurm_geo.stage.keys import GivenTreeKeys
from slurm_geo.stage.materialise import Materialised
from slurm_geo.stage.names import snapshot_name
from slurm_geo.stage.node import Node, choose
from slurm_geo.stage.present import Presentation, Source, StagedRoot, prepare
from slurm_geo.stage.record import WorldRecord, read_world_record
from slurm_geo.stage.steps import (
    NOT_IN_A_JOB,
    WorldStep,
    start_world_step,
    write_presentation,
    write_shim,
)
from slurm_geo.stage.trees import Trees
from slurm_geo.stage.workspace import Workspace, default_base

SCRIPT_NAME = "job-script"  # the job's script, in its workspace
CONTAINED_SCRIPT = "/.slurm-geo-job-script"  # where an image's root gets it
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2, signal.SIGCONT, signal.SIGALRM)


class PinMismatch(CorruptObject):
    """A pinned snapshot's manifest is not the one its run recorded."""


@dataclass(frozen=True)
class Finished:
    """What `at_exit` is told: the presentation (None where no world was staged), the
    workspace (still there), the job's exit code."""

    presentation: Presentation | None
    workspace: Workspace
    returncode: int


AtExit = Callable[[Finished], None]
AtStart = Callable[[Presentation | None], None]


class PinnedStore:
    """The site's store, every read of a pinned snapshot's manifest checked against the
    SHA-256 the run's world record holds for it (docs/format.md §11.8). Whatever reads the
    manifest (a first fetch, a second one) reads it through here."""

    def __init__(self, store: Store, record: WorldRecord):
        self._store = store
        self._pins = {snapshot_name(p.tree, p.snapshot): p for p in record.trees}
        self._run = record.run

    def get(self, name: str) -> bytes:
        data = self._store.get(name)
        pin = self._pins.get(name)
        if pin is not None:
            digest = hashlib.sha256(data).hexdigest()
            if digest != pin.manifest_sha256:
                raise PinMismatch(name, f"the staged {pin.what} '{pin.path}': its snapshot "
                                  f"{pin.snapshot} hashes to {digest[:16]}, not the "
                                  f"{pin.manifest_sha256[:16]} run {self._run} pinned; "
                                  "it was replaced in the store: stage it again at home")
        return data

    def __getattr__(self, name: str) -> Any:  # put, list, exists, sizes, get_range ...
        return getattr(self._store, name)


class RefetchingTrees(Trees):
    """Trees whose materialisation is tried once more from scratch where a chunk failed
    its check or the store failed a read (a cut transfer, a flipped bit on the way); the
    failed attempt left nothing behind (docs/format.md §11.6). A manifest that is not
    the pinned one is not fetched again."""

    def __init__(self, *args: Any, err: TextIO = sys.stderr, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._err = err

    def materialise(self, tree: str, snapshot: int, target: str | os.PathLike[str],
                    domain: str | None = None) -> Materialised:
        try:
            return super().materialise(tree, snapshot, target, domain)
        except PinMismatch:
            raise
        except (CorruptObject, StoreUnavailable) as exc:
            print(f"slurm-geo: world: {exc}; fetching it once more", file=self._err,
                  flush=True)
            return super().materialise(tree, snapshot, target, domain)


def tree_keys(reply: KeyReply) -> GivenTreeKeys:
    """The domain rings the daemon granted this job (and nothing else opens with them)."""
    return GivenTreeKeys({grant.domain: grant.ring for grant in reply.trees})


def sources_of(record: WorldRecord, script_file: Path) -> tuple[dict[str, Source], str | None,
                                                               str | None]:
    """`(sources, workdir, script)` for stage.present.prepare from the record's pins: each
    pinned root's staged snapshot, except the script, which is the text Slurm held (in
    the workspace) presented at the script's home path. Pure."""
    sources: dict[str, Source] = {}
    workdir = script = None
    for pin in record.trees:
        if pin.what == "script":
            script = pin.path
            sources[pin.path] = script_file
            continue
        if pin.what == "workdir":
            workdir = pin.path
        sources[pin.path] = StagedRoot(pin.tree, pin.snapshot, pin.domain)
    return sources, workdir, script


def enter_world(reply: KeyReply | None, store: Store | None, script: bytes, world: World,
                job: str, *,
                base: Path | None = None, environ: Mapping[str, str] | None = None,
                out: TextIO = sys.stdout, err: TextIO = sys.stderr,
                python: str = sys.executable, at_exit: AtExit | None = None,
                at_start: AtStart | None = None,
                handover: Callable[[], Mapping[str, str]] = dict,
                node_keys: str | None = None, srun: str | None = None) -> int:
    """Materialise and present the run's world, run `script` in it; its exit code.
    `handover`: called right before the script starts (the preamble renews the lease
    until then), the variables it returns go into the script's environment. No `reply`:
    the job named no run before it moved (a job moved while pending at home), so nothing
    of its world can have been staged: the script runs without it. `node_keys`: the key
    reply sealed for the world step (stage.steps), which presents the world on every node
    of the allocation for the tasks of the script's srun steps; `srun`: the node's srun
    (else the one on PATH)."""
    environ = dict(os.environ if environ is None else environ)
    record = None if reply is None or store is None else \
        read_world_record(store, reply.data_keys, reply.run)
    base = base or default_base(environ)
    with Workspace(base, job) as workspace:
        script_file = _write_script(workspace, script)
        presentation = step = None
        if reply is None or store is None or record is None or not record.trees:
            which = "the job named no run" if reply is None else f"run {reply.run}"
            print(f"slurm-geo: world: {which} has no staged world yet: the job runs "
                  "without it (its inputs and environment are not on this cluster)",
                  file=out, flush=True)
            command, env, cwd = [str(script_file)], environ, None
        else:
            sources, workdir, script_home = sources_of(record, script_file)
            trees = RefetchingTrees(PinnedStore(store, record), tree_keys(reply), err=err)
            probe = workspace.path / "probe"
            probe.mkdir(mode=0o700)
            node = Node.probe(probe, python)
            if script_home is None and choose(node, world.env).mode == "apptainer":
                script_home = CONTAINED_SCRIPT  # bound into the image, which has no workspace
                sources[script_home] = script_file
            presentation = prepare(world, sources, workspace, node, trees, workdir,
                                   script_home)
            argv = [_script_in(presentation, script_file)]
            print(presentation.line(), file=out, flush=True)
            command, env, cwd = presentation.command(argv, environ, python)
            step, env = _on_every_node(presentation, workspace, base, environ, env,
                                       node_keys, srun, python, out)
        try:
            if at_start is not None:
                at_start(presentation)
            returncode = supervise(command, {**env, **handover()}, cwd, out)
            if at_exit is not None:
                at_exit(Finished(presentation, workspace, returncode))
        finally:
            if step is not None:
                step.stop()
        return returncode


def _on_every_node(presentation: Presentation, workspace: Workspace, base: Path,
                   environ: Mapping[str, str], env: dict[str, str], node_keys: str | None,
                   srun: str | None, python: str, out: TextIO
                   ) -> tuple[WorldStep | None, dict[str, str]]:
    """The world on every node of the allocation for the script's srun steps (the world
    step, stage.steps) and the script's environment with the preamble's srun first on
    its PATH; where that cannot be (not a Slurm job: nothing said), one line says so."""
    write_presentation(workspace.path, presentation.to_json())
    srun = srun or shutil.which("srun", path=environ.get("PATH"))
    step, why = start_world_step(workspace, base, environ, node_keys, srun, python)
    if step is None:
        if why != NOT_IN_A_JOB:
            print(f"slurm-geo: world: the batch step only: the tasks of srun steps run "
                  f"without it ({why})", file=out, flush=True)
        return None, env
    assert srun is not None
    shim = write_shim(workspace, python, srun, base)
    print(f"slurm-geo: world: on every node of the allocation "
          f"({JobEnv.from_environ(environ).job_nodelist or '-'}): the tasks of srun steps "
          "run in it",
          file=out, flush=True)
    return step, {**env, "PATH": f"{shim}:{env.get('PATH', '')}"}


def _script_in(presentation: Presentation, script_file: Path) -> str:
    """The path the job's script runs at: its presented root; in container mode a copy in
    the unpacked image's root (the node's disk, the workspace included, is not in it);
    else its file in the workspace."""
    shown = next((r for r in presentation.roots if r.what == "script"), None)
    if shown is not None:
        return presentation.where(shown)
    if presentation.mode == "container" and presentation.image is not None:
        _write(presentation.image / CONTAINED_SCRIPT.lstrip("/"), script_file.read_bytes())
        return CONTAINED_SCRIPT
    return str(script_file)


def _write_script(workspace: Workspace, script: bytes) -> Path:
    return _write(workspace.path / SCRIPT_NAME, script)


def _write(path: Path, script: bytes) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o700)
    with os.fdopen(fd, "wb") as handle:
        handle.write(script)
    os.chmod(path, 0o700)
    return path


def supervise(command: list[str], env: Mapping[str, str], cwd: str | None,
              out: TextIO) -> int:
    """Run `command`, passing on the signals Slurm sends the batch step (a `--signal`
    the trainer checkpoints on, the TERM of a cancel or a time limit); its exit code, as
    a shell gives it (128 + N for a signal)."""
    child = subprocess.Popen(command, env=dict(env), cwd=cwd, stdin=subprocess.DEVNULL,
                             stdout=out)

    def forward(number: int, _frame: object) -> None:
        try:
            child.send_signal(number)
        except ProcessLookupError:
            pass

    previous = {number: signal.signal(number, forward) for number in FORWARDED}
    try:
        returncode = child.wait()
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    return 128 - returncode if returncode < 0 else returncode
