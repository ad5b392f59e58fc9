"""Where a logical job's shipped objects (docs/format.md §11.9) are read at home, and the
run key that opens them: `slurm-geo logs` and `slurm-geo outputs fetch`. An admin (who
reads the master key) opens the key with it; a user asks the federation daemon for her
run's key (`run-key`, an owner verb: released only for a run one of her jobs names)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Shipped:
    """Where a logical job's shipped objects are, and the run key that opens them."""

    logical_job: str
    run: str
    home: str
    store: Any
    ring: Any


def run_ring(site: Any, store: Any, run: str) -> Any:
    """The run's key ring: from the master key where this process reads it, else asked
    of the federation daemon as the run's owner."""
    from slurm_geo.ckpt.format.keys import LiveKeyFile, RunKeyRing
    from slurm_geo.ckpt.repo.repository import Repository
    from slurm_geo.cli.ckpt_owner import run_key
    from slurm_geo.config.paths import master_key_path
    from slurm_geo.federation.state.open import federation_config

    key_file = master_key_path(federation_config(site).key_file, os.environ)
    if os.access(key_file, os.R_OK):
        return Repository(store, LiveKeyFile(key_file)).run_keys(run)
    keys = run_key(site, run)
    return keys if isinstance(keys, RunKeyRing) else RunKeyRing.of(keys)


def shipped_of(site: Any, job: Any, store_spec: str | None, with_key: bool = True) -> Shipped:
    from slurm_geo.ckpt.stores.open_store import open_store, open_store_or_named
    from slurm_geo.errors import ConfigError

    if store_spec is not None:
        store = open_store_or_named(store_spec, None if site.source.startswith("<")
                                    else Path(site.source))
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
    the file would be). The run key is asked once, and only when a moved incarnation
    shipped something; parts once read are kept (they never change), so `--follow`
    fetches what is new only."""
    from slurm_geo.errors import SlurmGeoError
    from slurm_geo.stage.outputs import incarnation_name, latest_index, outputs_prefix, read_part

    opened: list[Shipped | None] = []
    parts: dict[tuple[str, str], bytes] = {}

    def log_of(incarnation: Any) -> bytes | None:
        if incarnation.cluster == job.home or incarnation.job_id is None or not job.run:
            return None
        name = incarnation_name(incarnation.cluster, incarnation.job_id)
        try:
            if not opened:
                opened.append(None)
                opened[0] = shipped_of(site, job, None, with_key=False)
            shipped = opened[0]
            if shipped is None or not shipped.store.list(
                    f"{outputs_prefix(shipped.run, name)}index/"):
                return None
            if shipped.ring is None:
                try:
                    shipped.ring = run_ring(site, shipped.store, shipped.run)
                except SlurmGeoError:
                    opened[0] = None  # asked once: a refusal is not asked again each poll
                    raise
            index = latest_index(shipped.store, shipped.ring, shipped.run, name)
            if index is None or index.log is None:
                return None
            for part in index.log.parts:
                if (name, part[0]) not in parts:
                    parts[(name, part[0])] = read_part(shipped.store, shipped.ring,
                                                       shipped.run, name, part)
            return b"".join(parts[(name, p[0])] for p in index.log.parts)
        except SlurmGeoError:
            return None
    return log_of
