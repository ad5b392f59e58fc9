"""Build a Federation from the site config: clients, stores, key, state, audit log.

The state and audit log are SQLite files for a daemon alone, or etcd for a replica among
several (`open_federation_state`); a replica's Leadership says when it may act."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from slurm_geo.ckpt.format.keys import LiveKeyFile, MasterKeys
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
from slurm_geo.errors import ConfigError
from slurm_geo.federation.access.tls import ca_pem
from slurm_geo.federation.act.credentials import read_job_credentials
from slurm_geo.federation.decide.bandwidth import BandwidthModel
from slurm_geo.federation.engine.core import Federation
from slurm_geo.federation.model import Replica, StateUnavailable
from slurm_geo.federation.state.audit import AuditLog
from slurm_geo.federation.state.etcd.audit import EtcdAuditLog
from slurm_geo.federation.state.etcd.kv import EtcdKV, EtcdTLS
from slurm_geo.federation.state.etcd.layout import Layout
from slurm_geo.federation.state.etcd.leadership import Bystander, Leadership
from slurm_geo.federation.state.etcd.state import EtcdFederationState
from slurm_geo.federation.state.etcd.version import check_layout
from slurm_geo.federation.state.sqlite import FederationState
from slurm_geo.federation.wiring import Audit, State, Wiring
from slurm_geo.registry import RegistryReader
from slurm_geo.slurm import SlurmClient, connect


def federation_config(site: SiteConfig) -> FederationConfig:
    if site.federation is None:
        raise ConfigError(f"{site.source} has no [federation] table; the federation daemon "
                          "needs one, and a store = \"NAME\" per cluster (docs/federation.md)")
    return site.federation


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


@dataclass(frozen=True)
class OpenedState:
    state: State
    audit: Audit
    leadership: Leadership | None  # None: a daemon alone, or a command: they always act


def open_federation_state(config: FederationConfig, master_keys: MasterKeys, *,
                          clock: Callable[[], float] = time.time, daemon: bool = True,
                          readonly: bool = False) -> OpenedState:
    """The state and audit log `config` names: SQLite files for a daemon alone (`readonly`
    for commands that only look); else etcd. There the daemon is replica `config.replica`,
    whose Leadership leads only once it campaigns; a command (not `daemon`) leads nothing
    and writes as a person's command does (leadership.Bystander)."""
    if not config.replicated:
        return OpenedState(FederationState(config.state, readonly=readonly),
                           AuditLog(config.audit_path, clock=clock, readonly=readonly), None)
    kv = open_kv(config, master_keys)
    layout, me = Layout(config.etcd_prefix), config.this_replica
    try:  # a state a newer slurm-geo laid out: one line, before anything reads it
        check_layout(kv, layout)
    except StateUnavailable:
        pass  # etcd down: every read says so; the leader settles the layout once it wins
    replica = Replica(me.name, me.site, me.url)
    if not daemon:
        writer = Bystander(layout, replica)  # its audit entries say who ran it
        return OpenedState(EtcdFederationState(kv, layout, writer),
                           EtcdAuditLog(kv, layout, writer, clock=clock), None)
    leadership = Leadership(kv, layout, replica, ttl_s=config.leader_ttl_s)
    return OpenedState(EtcdFederationState(kv, layout, leadership),
                       EtcdAuditLog(kv, layout, leadership, clock=clock, replica=me.name),
                       leadership)


def open_kv(config: FederationConfig, master_keys: MasterKeys) -> EtcdKV:
    """etcd at `config`'s endpoints, its values sealed under `master_keys`."""
    return EtcdKV(config.etcd_endpoints, master_keys,
                  tls=EtcdTLS(config.etcd_ca_file, config.etcd_cert, config.etcd_key,
                              config.etcd_user, config.etcd_password_file))


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
