"""Build a Federation from the site config: clients, stores, key, state, audit log.

The state and audit log are SQLite files for a daemon alone, or etcd for a replica among
several (federation.state.open, which readers use too); a replica's Leadership says when
it may act."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

from slurm_geo.ckpt.format.keys import LiveKeyFile
from slurm_geo.ckpt.stores.open_store import DECIDING, open_store, paced
from slurm_geo.ckpt.stores.pacing import TokenBucket
from slurm_geo.ckpt.stores.store import Store
from slurm_geo.config.model import (
    ClusterConfig,
    FederationConfig,
    SiteConfig,
    load_config,
)
from slurm_geo.config.paths import master_key_path
from slurm_geo.federation.access.tls import ca_pem
from slurm_geo.federation.act.credentials import read_job_credentials
from slurm_geo.federation.decide.bandwidth import BandwidthModel
from slurm_geo.federation.engine.core import Federation
from slurm_geo.federation.state.open import federation_config, open_federation_state
from slurm_geo.federation.wiring import Wiring
from slurm_geo.registry import RegistryReader
from slurm_geo.slurm import SlurmClient, connect


def check_files_read_at_use(site: SiteConfig) -> None:
    """The files the daemon reads at each submission (each store's job_credentials, the CA
    in ca_file), checked now: a bad one is a start-up or reload error, not a failed move."""
    for store in site.stores.values():
        if store.job_credentials is not None:
            read_job_credentials(store.job_credentials)
    if site.federation is not None and site.federation.ca_file is not None:
        ca_pem(site.federation.ca_file)


def slurm_client(cluster: ClusterConfig, config: FederationConfig) -> SlurmClient:
    """The client the federation (daemon and commands) calls `cluster` with."""
    # The daemon's own calls wait at most a few probe intervals: a controller that dies
    # in the middle of one must not hold up the move it causes.
    call_timeout = max(3.0, 3 * config.probe_interval_s)
    return connect(replace(cluster, timeout_s=min(cluster.timeout_s, call_timeout)))


def build(config_path: Path | None, env: Mapping[str, str] = os.environ,
          daemon: bool = True, clock: Callable[[], float] = time.time) -> Federation:
    """The Federation the config describes; `daemon=False` for commands that only look.
    Every part reads the time from `clock`."""
    site = load_config(config_path)
    config = federation_config(site)
    if daemon:
        check_files_read_at_use(site)
    master_keys = LiveKeyFile(master_key_path(config.key_file, env))
    clients = {name: slurm_client(cluster, config) for name, cluster in site.clusters.items()}
    probe_timeout = min(config.probe_interval_s, 5.0)
    probes = {name: connect(replace(cluster, timeout_s=min(cluster.timeout_s, probe_timeout)))
              for name, cluster in site.clusters.items()}
    stores = {name: open_store(store.url, endpoint_url=store.endpoint_url or None,
                               patience=DECIDING, ca_file=store.ca_file)
              for name, store in site.stores.items()}
    # The cap checkpoint-sync keeps to holds for the daemon's own copies and probes too.
    bucket = TokenBucket(site.sync.bandwidth_mb_s * 1e6) if site.sync is not None else None
    paced_stores: dict[str, Store] = {name: paced(store, name, bucket)
                                      for name, store in stores.items()}
    opened = open_federation_state(config, master_keys, clock=clock, daemon=daemon)
    if daemon and opened.leadership is None:
        # A replica does this each time it begins to lead (Federation.begin_term).
        opened.state.refresh_leases(clock())
    bandwidth = BandwidthModel.restore(opened.state.bandwidth_snapshot())
    wiring = Wiring(site, config, master_keys, clients, stores, paced_stores, opened.state,
                    opened.audit, clock, RegistryReader(site.registry_path, missing_ok=True),
                    leadership=opened.leadership)
    return Federation(wiring, probes, bandwidth)
