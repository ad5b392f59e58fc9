"""`slurm-geo outputs fetch JOB`: what moved incarnations shipped (docs/format.md §11.9),
read from the home store (checkpoint-sync brings it there) under the run's key
(slurm_geo.cli.shipped), written where the job named it at home."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from slurm_geo.cli.federation import CONFIG_HELP, JSON_HELP
from slurm_geo.cli.shipped import run_ring, shipped_of

STORE_HELP = ("Read from this store (a URL or a [stores] name) instead of the home "
              "cluster's: the off-site store, or a job's checkpoint directory at home, "
              "which checkpoint-sync never writes into.")


def job_of(site: Any, job: str) -> Any:
    """The logical job `job` names, from the state (an admin) or the daemon (a user)."""
    from slurm_geo.federation.model import UnknownLogicalJob
    from slurm_geo.federation.operator.operations import resolve
    from slurm_geo.federation.operator.ownerclient import (
        AskedState,
        OwnerClient,
        reads_daemon_files,
    )

    if not reads_daemon_files(site):
        asked = AskedState(OwnerClient(site), job)
        return asked.job(asked.logical_job)
    from slurm_geo.cli.federation import _open_state

    state = _open_state(site)
    if state is None:
        raise UnknownLogicalJob(job)
    return state.job(resolve(state, job).logical_job)


@click.group("outputs")
def outputs() -> None:
    """What moved incarnations of a job shipped home: their --geo-outputs."""


@outputs.command("fetch")
@click.argument("job")
@click.option("--to", "to", type=click.Path(path_type=Path), default=None,
              help="Write under this directory (DIR + each home path) instead of at the "
              "home paths themselves.")
@click.option("--incarnation", default=None, metavar="CLUSTER-JOBID",
              help="Only what this incarnation shipped (default: every one, the latest "
              "standing where two shipped the same file).")
@click.option("--store", "store_spec", default=None, metavar="STORE", help=STORE_HELP)
@click.option("--config", type=click.Path(path_type=Path), default=None, help=CONFIG_HELP)
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
def fetch(job: str, to: Path | None, incarnation: str | None, store_spec: str | None,
          config: Path | None, as_json: bool) -> None:
    """Write the --geo-outputs that logical job JOB's moved incarnations shipped home to the
    paths the job named at home (or under --to DIR), as you. A file absent is written; one
    with the same content is left; one changed here after the shipped copy is kept, never
    replaced, and listed (exit code 1); a link is never written through. Only the run's
    owner (or an admin) gets the run key that opens them."""
    from slurm_geo.config.model import load_config
    from slurm_geo.errors import ConfigError
    from slurm_geo.stage.outputs import incarnations
    from slurm_geo.stage.outputs_fetch import Fetched, fetch_outputs

    site = load_config(config)
    if to is not None and to.exists() and not to.is_dir():
        raise ConfigError(f"--to {to} is not a directory; name a directory (it is made "
                          "when missing)")
    shipped = shipped_of(site, job_of(site, job), store_spec, with_key=False)
    done = Fetched()
    if incarnations(shipped.store, shipped.run):  # the run key is asked only then
        ring = run_ring(site, shipped.store, shipped.run)
        done = fetch_outputs(shipped.store, ring, shipped.run, to, incarnation)
    if as_json:
        click.echo(json.dumps({"logical_job": shipped.logical_job,
                               "incarnations": done.incarnations, "written": done.written,
                               "unchanged": done.unchanged,
                               "kept": [{"path": p, "why": w} for p, w in done.kept]},
                              indent=2))
    else:
        if not done.incarnations:
            click.echo(f"{shipped.logical_job}: no moved incarnation shipped outputs")
        for path in done.written:
            click.echo(f"written    {path}")
        for path in done.unchanged:
            click.echo(f"unchanged  {path}")
        for path, why in done.kept:
            click.echo(f"kept       {path} ({why})")
    if done.kept:
        click.echo(f"slurm-geo: warning: {len(done.kept)} file(s) kept as they are here; "
                   "fetch with --to DIR to see the shipped copies", err=True)
        raise SystemExit(1)
