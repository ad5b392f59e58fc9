"""One opener of the federation state and its audit log from the config, either backend:
SQLite files for a daemon alone, etcd for replicas. The daemon (federation.engine.runtime)
and every reader (the commands, billing, the drills) open it here, so a reader never
loads the daemon.

Both backends are the one interface of federation.state.interface; the assignments at the
end have mypy check each of them against it."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from slurm_geo.ckpt.format.keys import MasterKeys, load_master_key
from slurm_geo.config.model import FederationConfig, SiteConfig
from slurm_geo.config.paths import master_key_path
from slurm_geo.errors import ConfigError
from slurm_geo.federation.model import Replica, StateUnavailable
from slurm_geo.federation.state.audit import AuditLog
from slurm_geo.federation.state.etcd.audit import EtcdAuditLog
from slurm_geo.federation.state.etcd.identities import EtcdIdentities
from slurm_geo.federation.state.etcd.kv import EtcdKV, EtcdTLS
from slurm_geo.federation.state.etcd.layout import Layout
from slurm_geo.federation.state.etcd.leadership import Bystander, Leadership
from slurm_geo.federation.state.etcd.state import EtcdFederationState
from slurm_geo.federation.state.etcd.version import check_layout
from slurm_geo.federation.state.identities import Identities
from slurm_geo.federation.state.interface import Audit, IdentityStore, State
from slurm_geo.federation.state.sqlite import FederationState


def federation_config(site: SiteConfig) -> FederationConfig:
    """The site's [federation] table; ConfigError, saying what to add, when it has none."""
    if site.federation is None:
        raise ConfigError(f"{site.source} has no [federation] table; the federation daemon "
                          "needs one, and a store = \"NAME\" per cluster (docs/federation.md)")
    return site.federation


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


def open_replicas_to_read(config: FederationConfig,
                          env: Mapping[str, str] = os.environ) -> OpenedState:
    """The replicas' state and audit log in etcd, read as a person's command reads them:
    with the master key (they are sealed under it), leading nothing."""
    keys = load_master_key(master_key_path(config.key_file, env))
    return open_federation_state(config, keys, daemon=False, readonly=True)


def read_state(config: FederationConfig, env: Mapping[str, str] = os.environ) -> State | None:
    """The state, read-only, as a command reads it: the SQLite file (None before a daemon
    alone ever started) or the replicas' in etcd."""
    if not config.replicated:
        return FederationState(config.state, readonly=True) if config.state.exists() else None
    return open_replicas_to_read(config, env).state


def read_audit(config: FederationConfig, env: Mapping[str, str] = os.environ) -> Audit:
    """The audit log, read-only, as a command reads it: the SQLite file (AuditError, naming
    it, where there is none) or the replicas' in etcd."""
    if not config.replicated:
        return AuditLog(config.audit_path, readonly=True)
    return open_replicas_to_read(config, env).audit


def open_kv(config: FederationConfig, master_keys: MasterKeys) -> EtcdKV:
    """etcd at `config`'s endpoints, its values sealed under `master_keys`."""
    return EtcdKV(config.etcd_endpoints, master_keys,
                  tls=EtcdTLS(config.etcd_ca_file, config.etcd_cert, config.etcd_key,
                              config.etcd_user, config.etcd_password_file))


# Each backend is the one interface: mypy refuses these if a class strays from it.
_STATES: tuple[type[State], ...] = (FederationState, EtcdFederationState)
_AUDITS: tuple[type[Audit], ...] = (AuditLog, EtcdAuditLog)
_IDENTITIES: tuple[type[IdentityStore], ...] = (Identities, EtcdIdentities)
