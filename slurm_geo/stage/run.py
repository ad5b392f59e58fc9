"""The moved job's preamble, as its owner, before its script (issue 31 item 3):

    python3 -m slurm_geo.stage.run --script-base64-stdin   < the job's script, base64
    python3 -m slurm_geo.stage.run --script FILE

The wrapper the daemon submits (federation.resubmit.wrapped_script) runs this. It takes
the lease and the incarnation's key reply from the federation daemon (lease.client, with
the SLURM_GEO_* variables the incarnation was given), hands the reply on to the trainer
its script starts (lease.handoff: the daemon releases it once per restart), opens the
site's store and enters the world (stage.preamble.enter_world), with the reply sealed
for the world step that presents it on every node of the allocation (stage.steps). A
fault is one line, `slurm-geo: error: ...`, and the exit code of its class
(slurm_geo.exitcodes).
"""

from __future__ import annotations

import argparse
import base64
import binascii
import os
import sys

from slurm_geo.ckpt.stores.open_store import open_store
from slurm_geo.errors import SlurmGeoError
from slurm_geo.exitcodes import ExitCode
from slurm_geo.jobenv import JobEnv
from slurm_geo.lease import protocol
from slurm_geo.lease.client import FederatedRun
from slurm_geo.lease.handoff import ENV_KEY_HANDOFF
from slurm_geo.policy.directives import JOB_PREFIX, from_environment
from slurm_geo.policy.world import World
from slurm_geo.stage.homestart import stage_home_world
from slurm_geo.stage.preamble import enter_world
from slurm_geo.stage.shipping import OutputsUploader
from slurm_geo.stage.steps import seal_node_keys


def _script(args: argparse.Namespace) -> bytes:
    if args.script is not None:
        with open(args.script, "rb") as handle:
            return handle.read()
    try:
        return base64.b64decode(sys.stdin.buffer.read(), validate=False)
    except (binascii.Error, ValueError) as exc:
        raise SlurmGeoError(f"the job's script on stdin is not base64: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m slurm_geo.stage.run",
        description="A moved job's preamble: materialise its world from the site's store, "
                    "then run its script in it (docs/training.md, A moved job's world).")
    given = parser.add_mutually_exclusive_group(required=True)
    given.add_argument("--script", help="the job's script, a file")
    given.add_argument("--script-base64-stdin", action="store_true",
                       help="the job's script, base64 on stdin (what the wrapper sends)")
    args = parser.parse_args(argv)
    env = os.environ
    try:
        script = _script(args)
        world = World.of(from_environment(env, JOB_PREFIX))
        job = JobEnv.from_environ(env).job_id or str(os.getpid())
        if not env.get(protocol.ENV_RUN):  # moved before it named its run: nothing staged
            return enter_world(None, None, script, world, job)
        # A copy: the secret and token stay in the environment the trainer inherits.
        federated = FederatedRun.from_environment(env[protocol.ENV_RUN], dict(env),
                                                   stage_world=stage_home_world)
        federated.acquire()
        reply = federated.key_reply()
        store = open_store(env[protocol.ENV_STORE],
                           endpoint_url=env.get(protocol.ENV_STORE_ENDPOINT) or None)
        # The job's log and outputs, shipped home while it runs and at its end
        # (stage.shipping): under the run key, into this site's store.
        uploader = OutputsUploader.from_environment(store, reply.data_keys, reply.run, env,
                                                    job)
        return enter_world(reply, store, script, world, job,
                           at_start=uploader.start if uploader else None,
                           at_exit=uploader.finish if uploader else None,
                           handover=lambda: {ENV_KEY_HANDOFF: federated.hand_over()},
                           node_keys=seal_node_keys(reply, env))
    except SlurmGeoError as exc:
        print(f"slurm-geo: error: {exc}", file=sys.stderr, flush=True)
        return int(exc.exit_code)
    except KeyError as exc:
        print(f"slurm-geo: error: {exc.args[0]} is not set: this preamble runs in a job the "
              "federation daemon submitted", file=sys.stderr, flush=True)
        return ExitCode.CONFIG
    except OSError as exc:
        print(f"slurm-geo: error: the job's world: {exc}", file=sys.stderr, flush=True)
        return ExitCode.FAILURE


if __name__ == "__main__":
    sys.exit(main())
