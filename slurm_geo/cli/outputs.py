"""`slurm-geo outputs fetch JOB`, and the shipped logs `slurm-geo logs` reads: what moved
incarnations shipped (docs/format.md §11.9), read from the home store (checkpoint-sync
brings it there) under the run's key. An admin (who reads the master key) opens the key
with it; a user asks the federation daemon for her run's key (`run-key`, an owner verb:
released only for a run one of her jobs names)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from slurm_geo.cli.federation import CONFIG_HELP, JSON_HELP

STORE_HELP = ("Read from this store (a URL or a [stores] name) instead of the home "
              "cluster's: the off-site store, or a job's checkpoint directory at home, "
              "which checkpoint-sync never writes into.")


@dataclass
class Shipped:
    """Where a logical job's shipped objects are, and the run key that opens them."""

    logical_job: str
    run: str
    home: str
    store: Any
    ring: Any


def job_of(site: Any, job: str) -> Any:
    """The logical job `job` names, from the state (an admin) or the daemon (a user)."""
    from slurm_geo.federation.model import UnknownLogicalJob
    from slurm_geo.federation.operations import resolve
    from slurm_geo.federation.ownerclient import AskedState, OwnerClient, reads_daemon_files

    if not reads_daemon_files(site):
        asked = AskedState(OwnerClient(site), job)
        return asked.job(asked.logical_job)
    from slurm_geo.cli.federation import _open_state

    state = _open_state(site)
    if state is None:
        raise UnknownLogicalJob(job)
    return state.job(resolve(state, job).logical_job)


def run_ring(site: Any, store: Any, run: str) -> Any:
    """The run's key ring: from the master key where this process reads it, else asked
    of the federation daemon as the run's owner."""
    from slurm_geo.ckpt.keys import LiveKeyFile, RunKeyRing
    from slurm_geo.ckpt.repository import Repository
    from slurm_geo.cli.ckpt_owner import run_key
    from slurm_geo.config.paths import master_key_path
    from slurm_geo.federation.runtime import federation_config

    key_file = master_key_path(federation_config(site).key_file, os.environ)
    if os.access(key_file, os.R_OK):
        return Repository(store, LiveKeyFile(key_file)).run_keys(run)
    keys = run_key(site, run)
    return keys if isinstance(keys, RunKeyRing) else RunKeyRing.of(keys)


def shipped_of(site: Any, job: Any, store_spec: str | None, with_key: bool = True) -> Shipped:
    from slurm_geo.ckpt.open_store import open_store, open_store_or_named
    from slurm_geo.errors import ConfigError

    if store_spec is not None:
        store = open_store_or_named(store_spec, site.source)
    else:
        name = site.cluster(job.home).store
        if not name or name not in site.stores:
            raise ConfigError(f"home cluster {job.home} names no store in {site.source}; "
                              "give one with --store")
        config = site.stores[name]
        store = open_store(config.url, endpoint_url=config.endpoint_url or None,
                           ca_file=config.ca_file)
    if not job.run:
        raise ConfigError(f"job {job.logical_job} names no run (--geo-run): nothing of it "
                          "is shipped under a run key")
    return Shipped(job.logical_job, job.run, job.home, store,
                   run_ring(site, store, job.run) if with_key else None)


def shipped_logs(site: Any, job: Any) -> Callable[[Any], bytes | None]:
    """For `slurm-geo logs`: an incarnation's log as it shipped it home, or None (not
    moved, nothing shipped, or the store or key cannot be had; the caller then says where
    the file would be). The key is asked once, when a moved incarnation needs it."""
    from slurm_geo.errors import SlurmGeoError
    from slurm_geo.stage.outputs import incarnation_name, read_log

    opened: list[Shipped | None] = []

    def log_of(incarnation: Any) -> bytes | None:
        if incarnation.cluster == job.home or incarnation.job_id is None or not job.run:
            return None
        try:
            if not opened:
                opened.append(None)
                opened[0] = shipped_of(site, job, None)
            shipped = opened[0]
            if shipped is None:
                return None
            return read_log(shipped.store, shipped.ring, shipped.run,
                            incarnation_name(incarnation.cluster, incarnation.job_id))
        except SlurmGeoError:
            return None
    return log_of


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
