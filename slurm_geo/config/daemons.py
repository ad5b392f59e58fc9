"""The tables of the two daemons, declared once: [sync] (checkpoint-sync) and [federation].

Each is a dataclass and its Settings (slurm_geo.config.settings); the docs' tables of
their keys (docs/checkpoint-sync.md, docs/federation.md) are rendered from the Settings
and tests keep the two equal.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from slurm_geo.config.settings import (
    Setting,
    choice,
    flag,
    is_loopback,
    names,
    number,
    path,
    read_settings,
    seconds,
    secure_url,
    shown,
    site_name,
    tables,
    text,
    whole,
)
from slurm_geo.config.tables import KEY_FILE_HELP, ClusterConfig, StoreConfig
from slurm_geo.errors import ConfigError

DEFAULT_ETCD_PREFIX = "/slurm-geo/federation"
_ETCD_PREFIX = re.compile(r"(/[A-Za-z0-9._~-]+)+")


@dataclass(frozen=True)
class SyncConfig:
    """The [sync] table: what the checkpoint-sync daemon watches, where it replicates, how.

    Every key is declared once in SYNC_SETTINGS (type, default, help); validation and the
    table in docs/checkpoint-sync.md both come from there.
    """

    roots: tuple[str, ...]
    destination: str
    state: Path = Path("/var/lib/slurm-geo/checkpoint-sync.db")
    key_file: Path | None = None
    metrics_address: str = "127.0.0.1"
    metrics_port: int = 9851
    bandwidth_mb_s: float = 0.0
    wan_rtt_ms: float = 20.0
    poll_interval_s: float = 10.0
    nice: int = 10
    cpu_policy: str = "idle"
    io_class: str = "idle"
    max_attempts: int = 5
    attempt_timeout_s: float = 1800.0
    retry_base_s: float = 30.0
    retry_max_s: float = 900.0
    scrub_gb_per_day: float = 100.0
    scrub_interval_s: float = 86400.0
    scrub_at: str = "destination"


SYNC_SETTINGS = (
    Setting("roots", names(what="store names or URLs", each="a store", non_empty=True), None,
            "Stores to watch for committed checkpoints: names from [stores], or file:// and "
            "s3:// URLs.", required=True),
    Setting("destination", text, None, "The [stores] name checkpoints are replicated to.",
            required=True),
    Setting("state", path, SyncConfig.state, "The SQLite state database (WAL mode); its "
            "directory must be writable."),
    Setting("key_file", path, None, KEY_FILE_HELP),
    Setting("metrics_address", text, SyncConfig.metrics_address,
            "Address of the Prometheus endpoint: plain http, unauthenticated, so loopback "
            "unless only the monitoring network reaches the address ([Metrics](#metrics))."),
    Setting("metrics_port", whole(0, 65535), SyncConfig.metrics_port,
            "Port of the Prometheus endpoint; 0 turns it off."),
    Setting("bandwidth_mb_s", number(0, unit="MB/s", note="(0: no cap)"),
            SyncConfig.bandwidth_mb_s, "Cap on bytes sent to and read back from the "
            "destination, in MB/s (10^6 bytes); 0: no cap."),
    # 20 ms: a round trip between regions of one continent. Guessing high costs a few idle
    # streams; guessing low leaves a fast link half empty.
    Setting("wan_rtt_ms", number(0, 10_000, unit="milliseconds"), SyncConfig.wan_rtt_ms,
            "Round trip to the destination in milliseconds (as ping measures it). With "
            "bandwidth_mb_s it sets how many packs go up at once: enough TCP streams to keep "
            "bandwidth_mb_s times the round trip in flight, two at least (see Parallel "
            "uploads); without a cap, two."),
    Setting("poll_interval_s", seconds, SyncConfig.poll_interval_s,
            "Seconds between scans of the roots."),
    Setting("nice", whole(0, 19), SyncConfig.nice, "CPU niceness the daemon gives itself "
            "(for cpu_policy batch or normal)."),
    Setting("cpu_policy", choice("idle", "batch", "normal"), SyncConfig.cpu_policy,
            "CPU scheduling policy: idle (SCHED_IDLE: runs in the gaps training leaves; "
            "replicas lag on saturated CPUs), batch (SCHED_BATCH), normal."),
    Setting("io_class", choice("idle", "best-effort", "none"), SyncConfig.io_class,
            "I/O scheduling class the daemon gives itself (none: leave it)."),
    Setting("max_attempts", whole(1, 1000), SyncConfig.max_attempts,
            "Failed attempts before a checkpoint is marked failed; attempts cut short by an "
            "unreachable store do not count."),
    Setting("attempt_timeout_s", seconds, SyncConfig.attempt_timeout_s,
            "An attempt still running after this long fails (and counts)."),
    Setting("retry_base_s", seconds, SyncConfig.retry_base_s,
            "Wait after a first failure; it doubles with each further one."),
    Setting("retry_max_s", seconds, SyncConfig.retry_max_s, "The longest wait between tries."),
    # 100 GB a day is 1.2 MB/s on average: a 10 TB destination is re-read every 100 days.
    Setting("scrub_gb_per_day", number(0, unit="GB/day", note="(0: no scrubbing)"),
            SyncConfig.scrub_gb_per_day, "Rate at which the scrub reads from the "
            "destination to find damage in verified replicas, in GB (10^9 bytes) a day on "
            "average: whole replicas with scrub_at here, a few KB a replica with destination; "
            "each read counts against bandwidth_mb_s too (see Scrubbing). 0: never."),
    # A small destination would otherwise be re-read over and over at the full rate.
    Setting("scrub_interval_s", number(0, unit="seconds"), SyncConfig.scrub_interval_s,
            "A replica is scrubbed at most this often (after its verification or its last "
            "scrub)."),
    # Reading a replica back crosses the WAN again; scrub-here reads it where it is.
    Setting("scrub_at", choice("destination", "here"), SyncConfig.scrub_at,
            "Where a scrub reads the packs: destination (the report `slurm-geo sync "
            "scrub-here` writes there, a few KB, plus the replica's manifest, key and a "
            "listing of its packs) or here (the whole replica read back across the WAN, as "
            "verification did; for a destination on this host's disk). See Scrubbing."),
)


def parse_sync(table: Any, stores: Mapping[str, StoreConfig], where: str) -> SyncConfig:
    config = SyncConfig(**read_settings(table, SYNC_SETTINGS, where))
    _check_sync_stores(config, stores, where)
    if config.retry_max_s < config.retry_base_s:
        raise ConfigError(f"{where}: retry_max_s ({config.retry_max_s:g}) is shorter than "
                          f"retry_base_s ({config.retry_base_s:g})")
    return config


def _check_sync_stores(config: SyncConfig, stores: Mapping[str, StoreConfig],
                       where: str) -> None:
    known = ", ".join(sorted(stores)) or "none"
    for root in config.roots:
        if "://" in root:
            if not root.startswith(("file://", "s3://")):
                raise ConfigError(f"{where}: root {shown(root)} must start with file:// or s3://")
        elif root not in stores:
            raise ConfigError(f"{where}: root {shown(root)} is neither a URL nor one of [stores] "
                              f"(stores: {known})")
    if config.destination not in stores:
        raise ConfigError(f"{where}: destination {shown(config.destination)} is not one of "
                          "[stores] "
                          f"(stores: {known})")
    destination_url = stores[config.destination].url
    for root in config.roots:
        if root == config.destination or stores.get(root, StoreConfig("", root, "")).url \
                == destination_url:
            raise ConfigError(f"{where}: destination '{config.destination}' is also one of "
                              "roots; a store cannot be replicated into itself")


@dataclass(frozen=True)
class ReplicaConfig:
    """One [[federation.replicas]] entry: a federation daemon sharing the state in etcd."""

    name: str
    site: str
    url: str  # its public_url: where jobs and the other replicas reach its service


REPLICA_SETTINGS = (
    Setting("name", site_name, None, "The replica's name (`replica` at that replica).",
            required=True),
    Setting("site", site_name, None, "The trusted site it runs at (home, control).",
            required=True),
    Setting("url", secure_url("write https:// (the replica's public_url)"), None,
            "Its public_url: where jobs on every cluster reach its lease and key service.",
            required=True),
)


@dataclass(frozen=True)
class FederationConfig:
    """The [federation] table: how the federation daemon watches clusters and moves jobs."""

    state: Path = Path("/var/lib/slurm-geo/federation.db")
    audit_path: Path = Path("/var/lib/slurm-geo/audit.db")
    key_file: Path | None = None
    listen_address: str = "127.0.0.1"
    listen_port: int = 9852
    public_url: str = ""
    tls_cert: Path | None = None
    tls_key: Path | None = None
    ca_file: Path | None = None
    refusal_audit_interval_s: float = 60.0
    probe_interval_s: float = 10.0
    outage_after: int = 3
    lease_ttl_s: float = 60.0
    margin_s: float = 60.0
    failback: bool = True
    failback_stable_s: float = 120.0
    munge_socket: Path | None = None
    # A follower leads within TTL + TTL/3 (6.7 s) of the leader's last renewal: the
    # ~10 s a site's loss may cost the federation before another site's daemon acts.
    leader_ttl_s: int = 5
    etcd_endpoints: tuple[str, ...] = ()
    etcd_prefix: str = DEFAULT_ETCD_PREFIX
    etcd_ca_file: Path | None = None
    etcd_cert: Path | None = None
    etcd_key: Path | None = None
    etcd_user: str = ""
    etcd_password_file: Path | None = None
    replica: str = ""
    replicas: tuple[ReplicaConfig, ...] = ()

    @property
    def url(self) -> str:
        """Where jobs reach this daemon's lease and key service."""
        if self.public_url:
            return self.public_url
        scheme = "https" if self.tls_cert is not None else "http"
        host = f"[{self.listen_address}]" if ":" in self.listen_address \
            else self.listen_address
        return f"{scheme}://{host}:{self.listen_port}"

    @property
    def replicated(self) -> bool:
        """The state is in etcd, shared by the replicas of [[federation.replicas]]."""
        return bool(self.etcd_endpoints)

    @property
    def job_urls(self) -> tuple[str, ...]:
        """Every URL a job may send its requests to: each replica's, this one's first."""
        others = tuple(r.url for r in self.replicas if r.url != self.url)
        return (self.url, *others)

    @property
    def this_replica(self) -> ReplicaConfig:
        """This daemon as [[federation.replicas]] names it (one alone on SQLite: itself)."""
        for replica in self.replicas:
            if replica.name == self.replica:
                return replica
        return ReplicaConfig(self.replica, "", self.url)

    @property
    def detection_window_s(self) -> float:
        return self.probe_interval_s * self.outage_after


def etcd_urls(value: Any, where: str) -> tuple[str, ...]:
    """Distinct http(s)://host:port URLs, plain http only to a loopback host: a member
    that answers for another could make two replicas lead."""
    endpoints = names(what="etcd client URLs", each="a member")(value, where)
    member = secure_url("write https:// and give etcd_ca_file")
    for endpoint in endpoints:
        member(endpoint, where)
        parts = urlsplit(endpoint)
        if parts.port is None or parts.path not in ("", "/") or parts.query:
            raise ConfigError(f"{where} must be URLs of the form https://host:port (no path), "
                              f"got {shown(endpoint)}")
    return endpoints


def etcd_prefix(value: Any, where: str) -> str:
    try:
        return check_etcd_prefix(text(value, where))
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def check_etcd_prefix(prefix: str) -> str:
    """The prefix every federation key lives under in etcd (slurm_geo.federation.state.etcd.layout
    checks its own with this too)."""
    if not _ETCD_PREFIX.fullmatch(prefix):
        raise ValueError(f"etcd prefix {prefix!r}: expected /name[/name...] of letters, "
                         "digits and ._~- (no trailing slash)")
    return prefix


FEDERATION_SETTINGS = (
    Setting("state", path, FederationConfig.state, "The daemon's SQLite state (logical jobs, "
            "incarnations, leases, cluster health, bandwidth); not with etcd_endpoints."),
    Setting("audit_path", path, FederationConfig.audit_path,
            "The append-only, hash-chained audit log (SQLite); not with etcd_endpoints."),
    Setting("key_file", path, None, KEY_FILE_HELP),
    Setting("listen_address", text, FederationConfig.listen_address,
            "Address of the lease/key service and the Prometheus /metrics endpoint."),
    Setting("listen_port", whole(1, 65535), FederationConfig.listen_port,
            "Port of the lease/key service and /metrics."),
    Setting("public_url", secure_url("write https:// and give tls_cert and tls_key (or put "
                                     "TLS in front of the service)"), None,
            "URL jobs on every cluster use to reach the service (default "
            "https://listen_address:listen_port with tls_cert, else http://...); https "
            "unless the host is loopback."),
    Setting("tls_cert", path, None, "The service's certificate chain (PEM): with tls_key, "
            "it serves https."),
    Setting("tls_key", path, None, "The private key of tls_cert (PEM, mode 0600, read at "
            "start)."),
    Setting("ca_file", path, None, "The CA certificate (PEM) jobs verify the service "
            "against; jobs the daemon submits elsewhere get its text in their environment. "
            "Default: the system's CAs."),
    Setting("refusal_audit_interval_s", seconds, FederationConfig.refusal_audit_interval_s,
            "A refused request (400, 401, 403, 404, 409) is audited at most once per source "
            "address in this many seconds; the next entry counts the ones left out."),
    Setting("probe_interval_s", seconds, FederationConfig.probe_interval_s,
            "Seconds between health probes of each cluster."),
    Setting("outage_after", whole(1, 100), FederationConfig.outage_after,
            "Consecutive failed probes before a cluster is declared out."),
    Setting("lease_ttl_s", seconds, FederationConfig.lease_ttl_s,
            "A job's training lease lasts this long without renewal; a job that cannot renew "
            "stops training, and no other incarnation starts before the lease has expired."),
    Setting("margin_s", seconds, FederationConfig.margin_s,
            "A running job moves only if that saves more than this many seconds."),
    Setting("failback", flag, FederationConfig.failback,
            "Move jobs back home when home is healthy and the plan favours it."),
    Setting("failback_stable_s", seconds, FederationConfig.failback_stable_s,
            "Home must have answered every probe for this long before a failback."),
    Setting("munge_socket", path, None, "The home cluster's munged socket: home jobs prove "
            "who they are to the daemon with `munge`, the daemon checks with `unmunge`. "
            "Default: the socket the home cluster's slurm.conf names (AuthInfo=socket=), "
            "else munge's own."),
    Setting("leader_ttl_s", whole(2, 60), FederationConfig.leader_ttl_s,
            "With the state replicated on etcd: the lease of the leader key, in whole "
            "seconds. The leader renews it every third of this and stops acting once it "
            "could not renew for this long; a follower campaigns every third of it."),
    Setting("etcd_endpoints", etcd_urls, None, "The client URLs of the etcd members "
            "(https://host:2379, one per site): the state and the audit log are then in "
            "etcd, shared by [[federation.replicas]], and state and audit_path are not "
            "given. Empty: this daemon alone, on SQLite."),
    Setting("etcd_prefix", etcd_prefix, FederationConfig.etcd_prefix,
            "Where in etcd the state is: every key of it starts with this."),
    Setting("etcd_ca_file", path, None, "The CA certificate (PEM) the etcd members' https "
            "is verified against. Default: the system's CAs."),
    Setting("etcd_cert", path, None, "A client certificate (PEM) for etcd members that "
            "ask for one (--client-cert-auth); with etcd_key."),
    Setting("etcd_key", path, None, "The private key of etcd_cert (PEM)."),
    Setting("etcd_user", text, FederationConfig.etcd_user, "The etcd user the replicas "
            "act as, where the members have auth enabled (RBAC); with etcd_password_file."),
    Setting("etcd_password_file", path, None, "The file (mode 0600) holding etcd_user's "
            "password; the replicas trade it for a token at the members they name."),
    Setting("replica", site_name, None, "With etcd_endpoints: which of "
            "[[federation.replicas]] this daemon is."),
    Setting("replicas", tables, (), "[[federation.replicas]]: every replica of the "
            "federation daemon (name, site, url); jobs get every url and follow the leader."),
)

# Settings that belong to one backend of the state only.
SQLITE_ONLY = ("state", "audit_path")
ETCD_ONLY = ("etcd_prefix", "etcd_ca_file", "etcd_cert", "etcd_key", "etcd_user",
             "etcd_password_file", "replica", "replicas")


def parse_federation(table: Any, clusters: Mapping[str, ClusterConfig], home: str,
                     where: str) -> FederationConfig:
    values = read_settings(table, FEDERATION_SETTINGS, where)
    if not home:
        raise ConfigError(f"{where} needs [site] home_cluster: jobs fail over from it and back")
    missing = sorted(name for name, c in clusters.items() if not c.store)
    if missing:
        raise ConfigError(f"{where}: cluster(s) {', '.join(missing)} have no store = \"NAME\"; "
                          "the daemon must know where each cluster's jobs keep checkpoints")
    values["replicas"] = tuple(
        ReplicaConfig(**read_settings(row, REPLICA_SETTINGS, f"{where} replicas[{i}]"))
        for i, row in enumerate(values.get("replicas", ())))
    if values.get("etcd_endpoints"):
        values["public_url"] = _replica_url(values, where)
    else:
        _check_alone(values, where)
    config = FederationConfig(**values)
    _check_transport(config, where)
    return config


def _check_alone(values: Mapping[str, Any], where: str) -> None:
    given = [name for name in ETCD_ONLY if values.get(name)]
    if given:
        raise ConfigError(f"{where}: {given[0]} is for a state shared in etcd, and there are "
                          "no etcd_endpoints; give etcd_endpoints, or remove it")


def _replica_url(values: Mapping[str, Any], where: str) -> str:
    """This replica's public_url, checked against [[federation.replicas]]: each replica
    once, each URL once, this one among them."""
    given = [name for name in SQLITE_ONLY if name in values]
    if given:
        raise ConfigError(f"{where}: {given[0]} is the SQLite {given[0].replace('_', ' ')}; "
                          "with etcd_endpoints the state and the audit log are in etcd: "
                          f"remove {given[0]}")
    replicas: tuple[ReplicaConfig, ...] = values["replicas"]
    if not replicas:
        raise ConfigError(f"{where}: etcd_endpoints needs [[federation.replicas]] to name "
                          "every replica (name, site, url): jobs follow the leader among them")
    for what in ("name", "url"):
        seen = [getattr(r, what) for r in replicas]
        twice = next((v for v in seen if seen.count(v) > 1), None)
        if twice is not None:
            raise ConfigError(f"{where}: [[federation.replicas]] names {what} {shown(twice)} "
                              f"twice; each replica has a {what} of its own")
    names_given = ", ".join(r.name for r in replicas)
    if "replica" not in values:
        raise ConfigError(f"{where}: etcd_endpoints needs replica = \"NAME\": which of "
                          f"[[federation.replicas]] ({names_given}) this daemon is")
    me = next((r for r in replicas if r.name == values["replica"]), None)
    if me is None:
        raise ConfigError(f"{where}: replica {shown(values['replica'])} is not one of "
                          f"[[federation.replicas]] ({names_given})")
    if values.get("public_url", me.url) != me.url:
        raise ConfigError(f"{where}: public_url {values['public_url']} is not the url of "
                          f"replica {me.name} in [[federation.replicas]] ({me.url}); give "
                          "one of them, or the same")
    return me.url


def _check_transport(config: FederationConfig, where: str) -> None:
    """TLS settings that go together, and a URL jobs reach the service by that is https
    unless it stays on the machine."""
    if (config.etcd_cert is None) != (config.etcd_key is None):
        raise ConfigError(f"{where}: etcd_cert and etcd_key go together (the client "
                          "certificate and its private key, PEM); give both or neither")
    if bool(config.etcd_user) != (config.etcd_password_file is not None):
        raise ConfigError(f"{where}: etcd_user and etcd_password_file go together (the etcd "
                          "user and the file of its password); give both or neither")
    if (config.tls_cert is None) != (config.tls_key is None):
        raise ConfigError(f"{where}: tls_cert and tls_key go together (the certificate chain "
                          "and its private key, PEM); give both or neither")
    if config.tls_cert is not None and config.public_url.startswith("http://"):
        raise ConfigError(f"{where}: public_url is http:// but tls_cert makes the service "
                          "speak https; write public_url = \"https://...\"")
    if not config.public_url and config.tls_cert is None \
            and not is_loopback(config.listen_address):
        raise ConfigError(f"{where}: listen_address {config.listen_address} is not loopback "
                          "and the service has no TLS, so jobs would reach it over plain "
                          "http; give tls_cert and tls_key, or public_url = \"https://...\" "
                          "(TLS in front)")
