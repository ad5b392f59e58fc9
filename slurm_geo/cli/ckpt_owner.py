"""`ckpt ls`, `verify` and `pull` for a run's owner, who cannot read the master key: her
run's data key comes from the federation daemon, asked by MUNGE (federation.ownerverbs
releases it only to the owner of a job that names the run, or to an admin), and the store
is read with it alone (`RunKeyRepository`). Whoever reads the key file goes on as before.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from slurm_geo.cli.options import chosen_config


def owner_site(key_file: Path):  # type: ignore[no-untyped-def]
    """The site config when the master key cannot be read here but a federation daemon
    can be asked for a run's key; None: use the key file (its errors say what is wrong).
    A --key-file given on the command line is always used: one it cannot read is that
    file's error (KEY_FILE, 28), never a question to the daemon."""
    import click
    from click.core import ParameterSource

    from slurm_geo.config.model import config_path_from_env, load_config

    ctx = click.get_current_context(silent=True)
    given = ctx is not None and ctx.get_parameter_source("key_file") is ParameterSource.COMMANDLINE
    if given or os.access(key_file, os.R_OK):
        return None
    path = chosen_config() or config_path_from_env()
    if not path.exists():
        return None
    site = load_config(path)
    return site if site.federation is not None else None


def run_key(site: Any, run: str) -> Any:
    """The run's key ring (docs/format.md §4.2), as the daemon released it to its owner."""
    from slurm_geo.federation.operator.ownerclient import OwnerClient
    from slurm_geo.lease.protocol import KeyReply

    return KeyReply.from_json(OwnerClient(site).ask("run-key", run=run)).data_keys


def owned_runs(site: Any) -> list[str]:
    """The runs the caller's jobs name (an admin's: every job's), as the daemon says."""
    from slurm_geo.federation.operator.ownerclient import OwnerClient

    views = OwnerClient(site).ask("status")["views"]
    return sorted({v["run"] for v in views if v["run"]})


def run_repository(store: Any, site: Any, run: str):  # type: ignore[no-untyped-def]
    from slurm_geo.ckpt.repo.runkey import RunKeyRepository

    return RunKeyRepository(store, run, run_key(site, run))


def with_run_key_of(source: Any, store: Any, run: str):  # type: ignore[no-untyped-def]
    """`store` (a pulled copy) read with the run key `source` holds."""
    from slurm_geo.ckpt.repo.runkey import RunKeyRepository

    return RunKeyRepository(store, run, source._keys(run))


class OwnedRuns:
    """The runs of a store whose keys the daemon released, read as one repository by
    `ckpt ls`: every call goes to the run's own `RunKeyRepository`."""

    def __init__(self, store: Any, site: Any, runs: list[str]):
        self._by_run = {run: run_repository(store, site, run) for run in runs}

    def runs(self) -> list[str]:
        return [run for run, repository in self._by_run.items() if repository.steps(run)]

    def steps(self, run: str) -> list[int]:
        return self._by_run[run].steps(run)

    def latest(self, run: str) -> int | None:
        return self._by_run[run].latest(run)

    def manifest(self, run: str, step: int):  # type: ignore[no-untyped-def]
        return self._by_run[run].manifest(run, step)

    def is_promoted(self, run: str, step: int) -> bool:
        return self._by_run[run].is_promoted(run, step)
