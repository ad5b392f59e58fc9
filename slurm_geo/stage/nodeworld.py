"""One node's share of a moved job's world step (stage.steps), as the job's user:

    python3 -m slurm_geo.stage.nodeworld --base DIR --batch-node NODE --batch-workspace DIR

run by the preamble's `srun --overlap`, one task per node. It opens this node's workspace
`job-<id>.<node>` (exclusively locked while it is made), presents the job's world there
and writes how (`presentation.json`): on the batch node the batch step's own
presentation (its trees, nothing fetched again); elsewhere each pinned tree fetched from
the site's store and verified as the preamble does (the keys from its sealed
SLURM_GEO_NODE_KEYS, removed from its environment at once). Then it prints
`READY <node>`, holds the workspace (its lock: no sweep of another job removes it)
until its standard input ends (the preamble's stop: srun passes every task the end of
its own) or SIGTERM (a cancel, the time limit), and removes it. A
`--signal` for the job's steps (USR1, USR2) is ignored here: it is for the trainer.
A fault is one line `slurm-geo: error: ...` and its exit code: the preamble fails the job.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path

from slurm_geo.ckpt.stores.open_store import open_store
from slurm_geo.errors import SlurmGeoError
from slurm_geo.exitcodes import ExitCode
from slurm_geo.jobenv import JobEnv
from slurm_geo.lease import protocol
from slurm_geo.policy.directives import JOB_PREFIX, from_environment
from slurm_geo.policy.world import World
from slurm_geo.stage.node import Node
from slurm_geo.stage.preamble import PinnedStore, RefetchingTrees, sources_of, tree_keys
from slurm_geo.stage.present import prepare
from slurm_geo.stage.record import read_world_record
from slurm_geo.stage.steps import (
    ENV_NODE_KEYS,
    PRESENTATION,
    READY,
    StepWorldError,
    node_workspace,
    open_node_keys,
    write_presentation,
)
from slurm_geo.stage.workspace import Workspace

ENDS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
IGNORED = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM, signal.SIGPIPE)


def present_here(workspace: Workspace, environ: dict[str, str], batch_node: str,
                 batch_workspace: Path, sealed: str, python: str = sys.executable
                 ) -> dict[str, object]:
    """Present the world in `workspace` (open, exclusively locked); what it wrote."""
    node = JobEnv.from_environ(environ).node
    if node == batch_node:
        with open(batch_workspace / PRESENTATION, "rb") as handle:  # the batch step's
            presented = json.load(handle)
    else:
        reply = open_node_keys(sealed, environ)
        store = open_store(environ[protocol.ENV_STORE],
                           endpoint_url=environ.get(protocol.ENV_STORE_ENDPOINT) or None)
        record = read_world_record(store, reply.data_keys, reply.run)
        if record is None or not record.trees:
            raise StepWorldError(f"run {reply.run} has no staged world in this site's "
                                 "store, but the batch step found one")
        sources, workdir, script = sources_of(record, workspace.path / "no-script")
        if script is not None:
            sources.pop(script)  # the batch script runs on the batch node only
        trees = RefetchingTrees(PinnedStore(store, record), tree_keys(reply))
        probe = workspace.path / "probe"
        probe.mkdir(mode=0o700)
        world = World.of(from_environment(environ, JOB_PREFIX))
        presented = prepare(world, sources, workspace, Node.probe(probe, python), trees,
                            workdir, None).to_json()
    write_presentation(workspace.path, presented)
    return presented


def _end_at_eof() -> None:
    """The end of standard input (the preamble closed the world step's): the end."""
    while sys.stdin.buffer.read(65536):
        pass
    os.kill(os.getpid(), signal.SIGTERM)  # blocked: sigwait takes it


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m slurm_geo.stage.nodeworld",
        description="A moved job's world on this node, for the tasks of its srun steps "
                    "(run by the preamble's world step; docs/training.md).")
    parser.add_argument("--base", required=True, help="the node-local scratch directory")
    parser.add_argument("--batch-node", required=True)
    parser.add_argument("--batch-workspace", required=True, type=Path)
    args = parser.parse_args(argv)
    sealed = os.environ.pop(ENV_NODE_KEYS, "")
    environ = dict(os.environ)
    for number in IGNORED:
        signal.signal(number, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, ENDS)  # an end waits for the workspace
    job = JobEnv.from_environ(environ)
    node = job.node
    try:
        workspace = node_workspace(Path(args.base), job.job_id, node)
        with workspace:
            present_here(workspace, environ, args.batch_node, args.batch_workspace, sealed)
            print(f"{READY} {node}", flush=True)
            threading.Thread(target=_end_at_eof, daemon=True).start()
            signal.sigwait(ENDS)
        return 0
    except SlurmGeoError as exc:
        print(f"slurm-geo: error: node {node}: {exc}", file=sys.stderr, flush=True)
        return int(exc.exit_code)
    except KeyError as exc:
        print(f"slurm-geo: error: node {node}: {exc.args[0]} is not set: this runs in a "
              "moved job's world step", file=sys.stderr, flush=True)
        return ExitCode.CONFIG
    except OSError as exc:
        print(f"slurm-geo: error: node {node}: the job's world: {exc}", file=sys.stderr,
              flush=True)
        return ExitCode.FAILURE


if __name__ == "__main__":
    sys.exit(main())
