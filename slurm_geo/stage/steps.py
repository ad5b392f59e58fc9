"""A moved job's world on every node of its allocation, for the tasks of its `srun` steps
(issue 31 item 3; docs/training.md "A moved job's world", "On every node").

The batch step's preamble (stage.preamble) presents the world to the job's script only.
The tasks of an `srun` step are started by slurmstepd on each node, outside that
namespace and, on another node, without the trees. So, before the script starts, the
preamble (as the job's user, no plugin, no root):

1. starts one *world step*: `srun --overlap` of `python3 -m slurm_geo.stage.nodeworld`,
   one task per node of the allocation. Each materialises the world into its node's
   private workspace `<scratch>/slurm-geo-<uid>/job-<id>.<node>` (stage.workspace: 0700,
   every chunk verified, under the workspace's lock, which it holds until the job ends:
   one task a node makes it, once, and a second could not open it), writes how it is
   presented there (`presentation.json`, whole or not at all), says `READY <node>` and
   holds it; on the batch node it presents the batch step's own trees (nothing fetched
   twice). The preamble waits for every node's line before the script starts, so no task
   of the script's steps starts before its node's world is whole; a node that cannot (a
   damaged chunk refused twice) fails the job before its script starts, in one line;
2. puts an `srun` of its own first on the script's PATH (`bin/srun` in the workspace):
   it runs stage.srunshim, which finds each component's command in srun's arguments
   (stage.srunargs) and runs the real srun with `python3 -m slurm_geo.stage.task --`
   before it. Each task then enters its node's world (stage.task) and `exec`s the
   command there: same mode, same home paths, the same SLURM_GEO_* variables;
3. when the script ends, stops the world step (closes its standard input, which srun
   passes on to every task: `--input=all`): each node's workspace is removed. One left
   by a killed job is swept by the next job of the user on that node (its lock is
   free), as the batch node's is.

The keys the world step needs (the run key and the trees' key rings) reach it in its own
environment only (not the job's record, which never holds them), sealed under a key
derived from the incarnation's lease secret and bound to the job and its restart
(lease.handoff's seal, `bound`), as the trainer's are. The tasks of the user's steps are
given no key: they only read what their node's world step presented.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import IO

from slurm_geo.atomic import write_atomic
from slurm_geo.errors import SlurmGeoError
from slurm_geo.exitcodes import ExitCode
from slurm_geo.jobenv import JobEnv
from slurm_geo.lease import handoff, protocol
from slurm_geo.lease.protocol import KeyReply
from slurm_geo.stage.workspace import Workspace

ENV_NODE_KEYS = "SLURM_GEO_NODE_KEYS"  # the world step's sealed key reply
PRESENTATION = "presentation.json"  # in a workspace: how its world is presented
READY = "READY"
SHIM_DIR = "bin"
NOT_IN_A_JOB = "not in a Slurm job"
STOP_WAIT_S = 30
_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")


class StepWorldError(SlurmGeoError):
    exit_code = ExitCode.FAILURE


def bound(environ: Mapping[str, str]) -> bytes:
    """What a world step's sealed keys are bound to: this job and restart only."""
    job = JobEnv.from_environ(environ)
    return f"slurm-geo/node-world:{job.job_id}:{job.restart_count or '0'}".encode()


def seal_node_keys(reply: KeyReply, environ: Mapping[str, str]) -> str | None:
    """The key reply sealed for this job's world step; None without a lease secret."""
    secret = environ.get(protocol.ENV_LEASE_SECRET, "")
    if not secret:
        return None
    return handoff.seal_reply(reply, "", secret, bound(environ))


def open_node_keys(sealed: str, environ: Mapping[str, str]) -> KeyReply:
    try:
        reply, _session = handoff.open_reply(sealed, environ.get(protocol.ENV_LEASE_SECRET, ""),
                                             bound(environ))
    except handoff.HandoffError:
        raise StepWorldError(f"{ENV_NODE_KEYS} does not open for job "
                             f"{JobEnv.from_environ(environ).job_id or '?'}: it was sealed for "
                             "another job or restart") from None
    return reply


def node_job(job: str, node: str) -> str:
    """The workspace name of job `job`'s world on node `node` (several slurmd "nodes" may
    share one machine, and its /tmp)."""
    if not _NODE_NAME.match(node or ""):
        raise StepWorldError(f"node name {node!r} (SLURMD_NODENAME): this runs in a task of "
                             "a Slurm step")
    return f"{job}.{node}"


def node_workspace(base: Path, job: str, node: str) -> Workspace:
    return Workspace(base, node_job(job, node))


def write_presentation(workspace_path: Path, data: Mapping[str, object]) -> Path:
    """`presentation.json`, whole or not at all (written aside, then renamed): its being
    there says the world is ready."""
    path = workspace_path / PRESENTATION
    write_atomic(path, json.dumps(data), 0o600)
    return path


def shim_text(python: str, srun: str, base: Path, shim_dir: Path) -> str:
    """The `srun` the script finds first on its PATH: stage.srunshim with the node's own
    Python and srun (absolute: the environment's bin is on PATH before them)."""
    words = [python, "-m", "slurm_geo.stage.srunshim", "--srun", srun, "--python", python,
             "--base", str(base), "--shim-dir", str(shim_dir), "--"]
    return "#!/bin/sh\nexec " + " ".join(shlex.quote(w) for w in words) + ' "$@"\n'


def write_shim(workspace: Workspace, python: str, srun: str, base: Path) -> Path:
    """`bin/srun` in the batch workspace; its directory (to put first on PATH)."""
    directory = workspace.path / SHIM_DIR
    directory.mkdir(mode=0o700)
    path = directory / "srun"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o700)
    with os.fdopen(fd, "w") as handle:
        handle.write(shim_text(python, srun, base, directory))
    return directory


def world_step_argv(srun: str, python: str, nodes: int, base: Path, batch_node: str,
                    batch_workspace: Path) -> list[str]:
    """The world step: one task on each node of the allocation, overlapping every other
    step (it holds no CPU, memory or GPU from the job's own steps), each reading srun's
    standard input (`--input=all`): its end is theirs. Pure."""
    return [srun, "--overlap", f"--nodes={nodes}", f"--ntasks={nodes}",
            "--ntasks-per-node=1", "--cpus-per-task=1", "--kill-on-bad-exit=1",
            "--export=ALL", "--input=all", "--job-name=slurm-geo-world", "--quiet", "--",
            python, "-m", "slurm_geo.stage.nodeworld", "--base", str(base),
            "--batch-node", batch_node, "--batch-workspace", str(batch_workspace)]


def ready_nodes(lines: list[str]) -> set[str]:
    """The nodes whose world step said READY. Pure."""
    return {parts[1] for parts in (line.split() for line in lines)
            if len(parts) == 2 and parts[0] == READY}


class WorldStep:
    """The running world step, from the preamble: `start` returns once every node said
    READY (else raises, the step stopped); `stop` ends it (each node removes its world)."""

    def __init__(self, argv: list[str], environ: Mapping[str, str], sealed: str,
                 nodes: int, err: IO[str] | None = None):
        self._argv = argv
        self._env = {**environ, ENV_NODE_KEYS: sealed}
        self._nodes = nodes
        self._err = err
        self._process: subprocess.Popen[str] | None = None

    def start(self) -> set[str]:
        self._process = subprocess.Popen(self._argv, env=self._env, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=self._err,
                                         text=True)
        assert self._process.stdout is not None
        lines: list[str] = []
        while len(ready_nodes(lines)) < self._nodes:
            line = self._process.stdout.readline()
            if not line:
                code = self._process.wait()
                raise StepWorldError(
                    f"the job's world could not be presented on every node of its "
                    f"allocation ({len(ready_nodes(lines))} of {self._nodes} ready, the "
                    f"world step ended with {code}; its error output above says why)")
            lines.append(line)
        return ready_nodes(lines)

    def stop(self) -> int | None:
        """End the world step: its standard input closed, which srun passes on to each
        node's task as the end of theirs (a SIGTERM to srun would cancel the step with
        SIGKILL, leaving the trees); each removes its node's world and exits. Its exit
        code, None where it had to be cancelled after STOP_WAIT_S."""
        process = self._process
        if process is None:
            return None
        if process.stdin is not None:
            try:
                process.stdin.close()
            except BrokenPipeError:
                pass
        try:
            code: int | None = process.wait(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            code = None
        if process.stdout is not None:
            process.stdout.close()
        return code


def start_world_step(workspace: Workspace, base: Path, environ: Mapping[str, str],
                     sealed: str | None, srun: str | None, python: str = sys.executable
                     ) -> tuple[WorldStep | None, str]:
    """Start the world step where this is a Slurm job with srun and sealed keys: (the
    step, "" ) or (None, why not: the line the job's output gets)."""
    slurm = JobEnv.from_environ(environ)
    node, job = slurm.node, slurm.job_id
    if not job or not node:
        return None, NOT_IN_A_JOB
    if srun is None:
        return None, "no srun on this node's PATH"
    if sealed is None:
        return None, "no lease secret to seal the world's keys for the nodes with"
    try:
        nodes = int(slurm.num_nodes or 1)
    except ValueError:
        nodes = 1
    step = WorldStep(world_step_argv(srun, python, nodes, base, node, workspace.path),
                     environ, sealed, nodes)
    step.start()
    return step, ""
