"""The `slurm-geo` command: thin shells that parse, call the library and report.

Subcommand groups are imported only when used, so `slurm-geo --help` stays fast and never
pulls in torch, boto3 or the Slurm layer.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import sys

import click

from slurm_geo import __version__
from slurm_geo.errors import SlurmGeoError
from slurm_geo.exitcodes import ExitCode

PROG = "slurm-geo"
# Named, not derived from argv[0] as click would: `python3 -m slurm_geo` completes too.
COMPLETE_VAR = "_SLURM_GEO_COMPLETE"

# name -> (module, attribute, one-line help shown by --help without importing the module)
SUBCOMMANDS = {
    "approve": ("slurm_geo.cli.federation", "approve",
                "Consent to moving a job that did not ask --geo-failover=auto."),
    "plan": ("slurm_geo.cli.federation", "plan",
             "Where a logical job should run now, and why (read-only)."),
    "status": ("slurm_geo.cli.federation", "status",
               "A logical job across clusters: state, recoveries, lease."),
    "cancel": ("slurm_geo.cli.federation", "cancel",
               "Cancel a logical job, every incarnation; release its lease."),
    "resubmit": ("slurm_geo.cli.federation", "resubmit",
                 "Resubmit a failed logical job from its newest verified checkpoint."),
    "logs": ("slurm_geo.cli.federation", "logs",
             "A logical job's output, incarnation by incarnation."),
    "outputs": ("slurm_geo.cli.outputs", "outputs",
                "Fetch what a job's moved incarnations shipped home (--geo-outputs)."),
    "federation": ("slurm_geo.cli.federation", "federation",
                   "The daemon's replicas: who leads; etcd's members and their lag."),
    "doctor": ("slurm_geo.cli.doctor", "doctor",
               "Check this host's part of the deployment; one line per problem and its fix."),
    "drill": ("slurm_geo.cli.drill", "drill",
              "Fail the home cluster in the sandbox; report RTO, RPO, bytes and cost."),
    "audit": ("slurm_geo.cli.audit", "audit",
              "Show and verify the federation daemon's hash-chained audit log."),
    "sandbox": ("slurm_geo.cli.sandbox", "sandbox", "Run a local two-cluster Slurm sandbox."),
    "billing": ("slurm_geo.cli.billing", "billing", "Chargeback: ingest, reports, invoices."),
    "ckpt": ("slurm_geo.cli.ckpt", "ckpt",
             "Push, pull, list, verify, promote and garbage-collect checkpoints."),
    "keys": ("slurm_geo.cli.ckpt", "keys", "Create the site master key; rotate it."),
    "policy": ("slurm_geo.cli.policy", "policy",
               "Check --geo-* directives; export the policy for job_submit.lua."),
    "sync": ("slurm_geo.cli.sync", "sync",
             "Replication state kept by checkpoint-sync; requeue failed replicas."),
    "config": ("slurm_geo.cli.config", "config",
               "Check the site config file: what it holds, or its first problem."),
    "site": ("slurm_geo.cli.site", "site",
             "Install the hooks, units, SPANK plugin and helper on a Slurm site."),
    "completion": ("slurm_geo.cli.completion", "completion",
                   "Print the shell completion script for bash, zsh or fish."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *SUBCOMMANDS])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in SUBCOMMANDS:
            module, attr, _ = SUBCOMMANDS[name]
            return getattr(importlib.import_module(module), attr)
        return super().get_command(ctx, name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, SUBCOMMANDS[name][2]) for name in sorted(SUBCOMMANDS)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


# glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
# The largest M_MMAP_THRESHOLD glibc accepts on 64-bit (HEAP_MAX_SIZE / 2): a 16 MiB pack
# and every chunk-sized buffer are then carved from the heap, not mapped one by one.
KEPT_ALLOCATION = 32 << 20
KEPT_FREE = 1 << 30


def keep_freed_memory() -> None:
    """Have glibc keep the memory this process frees for its next allocations.

    By default each buffer over a few MiB (a pack read back, a chunk decrypted, a plane
    decompressed) is a fresh mapping, unmapped when freed, and every page of the next one
    is faulted in and zeroed anew; on a VM whose free memory goes back to the host it is
    also faulted in on the host, about 2.5 ms a MiB on the 2-core VM. Measured there
    (docs/benchmarks.md): a pull of 300 MB took 98-131k page faults and 55-58k after,
    `ckpt check --read-data` of 1 GB 202-338k and 108-126k. What is kept stays in the
    process's RSS until it exits, and a thread's arena keeps its own: peak RSS of a 4 GiB
    push 153-167 MB with it, of a 4 GiB pull 86 MB (both under the 300 MB the CLI is held
    to). A no-op where malloc is not glibc's."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, KEPT_ALLOCATION)
        mallopt(M_TRIM_THRESHOLD, KEPT_FREE)


@click.group(cls=LazyGroup)
@click.version_option(__version__, prog_name=PROG)
def cli() -> None:
    """slurm-geo: Slurm training jobs that survive the loss of their cluster."""


def main() -> None:
    # numpy (byte planes, xor deltas) never calls BLAS here, but OpenBLAS starts a thread
    # per core at import that spins waiting for work: measured on the 2-core VM, a quarter
    # of the CPU samples of a `ckpt push`, taken from the threads hashing and encoding
    # (0.28 s of CPU against 0.15 s without). A user's own setting is kept.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    keep_freed_memory()
    try:
        cli.main(prog_name=PROG, complete_var=COMPLETE_VAR, standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(ExitCode.INTERRUPTED)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except SlurmGeoError as exc:
        click.echo(f"slurm-geo: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.exit(ExitCode.INTERRUPTED)
