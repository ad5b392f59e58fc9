"""`slurm-geo sandbox ...`: bring the local two-cluster sandbox up and down."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import click

from slurm_geo.sandbox import Sandbox, root_from_env
from slurm_geo.sandbox.layout import ROOT_ENV

dir_option = click.option(
    "--dir",
    "root",
    type=click.Path(path_type=Path),
    default=None,
    help=f"Sandbox directory (default: ${ROOT_ENV} or /var/lib/slurm-geo/sandbox).",
)


@click.group()
def sandbox() -> None:
    """Run a local two-cluster Slurm sandbox: `onprem` (CLI) and `rented` (slurmrestd)."""


@sandbox.command()
@dir_option
@click.option("--port-base", type=click.IntRange(1024, 65000), default=None,
              help="First of the sandbox's ports (default 16800; fixed at first `up`).")
def up(root: Path | None, port_base: int | None) -> None:
    """Start munge, MariaDB, both clusters, slurmrestd and the S3 endpoint (idempotent)."""
    Sandbox(root_from_env(root), port_base).up(progress=lambda msg: click.echo(msg, err=True))


@sandbox.command()
@dir_option
@click.option("--purge", is_flag=True, help="Also delete the sandbox directory.")
def down(root: Path | None, purge: bool) -> None:
    """Stop every process the sandbox started, and nothing else."""
    Sandbox(root_from_env(root)).down(purge=purge)


@sandbox.command()
@dir_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(root: Path | None, as_json: bool) -> None:
    """Show each component up or down; exits 1 unless all are up."""
    rows = Sandbox(root_from_env(root)).status()
    if as_json:
        click.echo(json.dumps([asdict(row) for row in rows], indent=2))
    else:
        width = max(len(row.name) for row in rows)
        for row in rows:
            state = click.style("up", fg="green") if row.up else click.style("down", fg="red")
            pid = str(row.pid or "-")
            click.echo(f"{row.name:<{width}}  {state:<4}  pid {pid:<8} {row.endpoint}")
    sys.exit(0 if all(row.up for row in rows) else 1)


@sandbox.command()
@dir_option
@click.argument("cluster")
def env(root: Path | None, cluster: str) -> None:
    """Print `export` lines for CLUSTER: eval "$(slurm-geo sandbox env onprem)"."""
    for line in Sandbox(root_from_env(root)).env_lines(cluster):
        click.echo(line)
