"""Typed view of the slurm-geo config file, validated once at load time.

Parsing is pure (dict in, dataclasses out) so every rule is tested without files; only
`load_config` touches the disk.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_geo.errors import ConfigError
from slurm_geo.policy.geo import GeoPolicy
from slurm_geo.policy.retention import RetentionPolicy

DEFAULT_CONFIG_PATH = Path("/etc/slurm-geo/config.toml")
CONFIG_ENV = "SLURM_GEO_CONFIG"
ACCESS_METHODS = ("cli", "rest")
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_REGISTRY_PATH = Path("/var/lib/slurm-geo/registry.db")


@dataclass(frozen=True)
class Prices:
    """What a cluster charges; all in USD."""

    gpu_hour: float = 0.0
    cpu_hour: float = 0.0
    egress_per_gb: float = 0.0
    marketplace_fee_pct: float = 0.0


@dataclass(frozen=True)
class ClusterConfig:
    """One Slurm cluster and how slurm-geo reaches it.

    `access = "cli"` runs Slurm's commands with `slurm_conf`; `access = "rest"` talks to
    slurmrestd at `rest_url` with the JWT in `token_file`, as across the internet.
    """

    name: str
    region: str
    access: str
    provider: str = ""
    slurm_conf: Path | None = None
    rest_url: str = ""
    rest_user: str = ""
    token_file: Path | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    prices: Prices = field(default_factory=Prices)
    store: str = ""  # the [stores] name jobs on this cluster write checkpoints to
    partitions: tuple[str, ...] = ()  # empty: any
    gpu_types: tuple[str, ...] = ()
    compliance: str = ""  # compliance domain, e.g. "eu-gdpr"; informational
    slurm_federation: str = ""  # native Slurm federation it belongs to: Slurm moves jobs


@dataclass(frozen=True)
class StoreConfig:
    """An object store or directory checkpoints are written to."""

    name: str
    url: str
    region: str
    endpoint_url: str = ""
    # S3 credentials (an env file) the federation daemon gives jobs it submits that write
    # here, in place of its own: scope them to this store's bucket.
    job_credentials: Path | None = None


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
    poll_interval_s: float = 10.0
    nice: int = 10
    cpu_policy: str = "idle"
    io_class: str = "idle"
    max_attempts: int = 5
    attempt_timeout_s: float = 1800.0
    retry_base_s: float = 30.0
    retry_max_s: float = 900.0


@dataclass(frozen=True)
class SiteConfig:
    home_cluster: str
    clusters: dict[str, ClusterConfig]
    stores: dict[str, StoreConfig]
    source: str = "<memory>"
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)
    sync: SyncConfig | None = None  # the [sync] table, for the checkpoint-sync daemon
    policy: GeoPolicy = field(default_factory=GeoPolicy)  # [policy]: the --geo-* rules
    registry_path: Path = DEFAULT_REGISTRY_PATH  # [registry] path: the controller's jobs
    federation: FederationConfig | None = None  # [federation]: the federation daemon
    billing: dict[str, Any] = field(default_factory=dict)  # [billing], read by billing.config

    def cluster(self, name: str) -> ClusterConfig:
        try:
            return self.clusters[name]
        except KeyError:
            known = ", ".join(sorted(self.clusters)) or "none"
            raise ConfigError(
                f"cluster '{name}' is not in {self.source} (known clusters: {known})"
            ) from None


def config_path_from_env() -> Path:
    return Path(os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG_PATH)


def load_config(path: Path | None = None) -> SiteConfig:
    """Read and validate the config at `path`, `$SLURM_GEO_CONFIG` or the default path."""
    path = path or config_path_from_env()
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"config file {path} does not exist; set {CONFIG_ENV} or create it "
            "(see docs/install.md)"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    return parse_config(raw, source=str(path))


def parse_config(raw: dict[str, Any], source: str = "<memory>") -> SiteConfig:
    _reject_unknown(raw, {"site", "clusters", "stores", "retention", "sync", "policy",
                          "registry", "federation", "billing"}, source)
    site = _table(raw, "site", source)
    _reject_unknown(site, {"home_cluster"}, f"{source} [site]")
    clusters = {
        name: _parse_cluster(name, table, f"{source} [clusters.{name}]")
        for name, table in _table(raw, "clusters", source).items()
    }
    stores = {
        name: _parse_store(name, table, f"{source} [stores.{name}]")
        for name, table in _table(raw, "stores", source).items()
    }
    home = site.get("home_cluster", "")
    if home and home not in clusters:
        raise ConfigError(f"{source}: home_cluster '{home}' is not one of [clusters]")
    retention = RetentionPolicy.from_mapping(_table(raw, "retention", source),
                                             f"{source} [retention]")
    sync = (_parse_sync(raw["sync"], stores, f"{source} [sync]") if "sync" in raw else None)
    policy = GeoPolicy.from_mapping(_table(raw, "policy", source),
                                    {c.region for c in clusters.values()}, f"{source} [policy]")
    for cluster in clusters.values():
        if cluster.store and cluster.store not in stores:
            raise ConfigError(f"{source} [clusters.{cluster.name}]: store '{cluster.store}' is "
                              f"not one of [stores] ({', '.join(sorted(stores)) or 'none'})")
    federation = (_parse_federation(raw["federation"], clusters, home, f"{source} [federation]")
                  if "federation" in raw else None)
    return SiteConfig(home_cluster=home, clusters=clusters, stores=stores, source=source,
                      retention=retention, sync=sync, policy=policy, federation=federation,
                      billing=_table(raw, "billing", source),
                      registry_path=_parse_registry(_table(raw, "registry", source),
                                                    f"{source} [registry]"))


def _parse_registry(table: dict[str, Any], where: str) -> Path:
    _reject_unknown(table, {"path"}, where)
    return _path(table["path"], f"{where}: path") if "path" in table else DEFAULT_REGISTRY_PATH


_CLUSTER_KEYS = {
    "region", "access", "provider", "slurm_conf", "rest_url", "rest_user", "token_file",
    "timeout_s", "prices", "store", "partitions", "gpu_types", "compliance", "slurm_federation",
}


def _parse_cluster(name: str, table: Any, where: str) -> ClusterConfig:
    if not isinstance(table, dict):
        raise ConfigError(f"{where} must be a table")
    _reject_unknown(table, _CLUSTER_KEYS, where)
    access = _required_str(table, "access", where)
    if access not in ACCESS_METHODS:
        raise ConfigError(f"{where}: access '{access}' is not one of {', '.join(ACCESS_METHODS)}")
    if access == "cli" and "slurm_conf" not in table:
        raise ConfigError(
            f"{where}: access 'cli' needs slurm_conf = PATH to the cluster's slurm.conf")
    if access == "rest":
        for key in ("rest_url", "rest_user", "token_file"):
            _required_str(table, key, where)
    timeout = table.get("timeout_s", DEFAULT_TIMEOUT_S)
    if not isinstance(timeout, int | float) or timeout <= 0:
        raise ConfigError(f"{where}: timeout_s must be a positive number of seconds")
    return ClusterConfig(
        name=name,
        region=_required_str(table, "region", where),
        access=access,
        provider=str(table.get("provider", "")),
        slurm_conf=Path(table["slurm_conf"]) if "slurm_conf" in table else None,
        rest_url=str(table.get("rest_url", "")).rstrip("/"),
        rest_user=str(table.get("rest_user", "")),
        token_file=Path(table["token_file"]) if "token_file" in table else None,
        timeout_s=float(timeout),
        prices=_parse_prices(table.get("prices", {}), f"{where}.prices"),
        store=str(table.get("store", "")),
        partitions=_string_list(table, "partitions", where),
        gpu_types=_string_list(table, "gpu_types", where),
        compliance=str(table.get("compliance", "")),
        slurm_federation=str(table.get("slurm_federation", "")),
    )


def _string_list(table: dict[str, Any], key: str, where: str) -> tuple[str, ...]:
    value = table.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{where}: {key} must be a list of names, got {value!r}")
    return tuple(value)


def _parse_prices(table: Any, where: str) -> Prices:
    if not isinstance(table, dict):
        raise ConfigError(f"{where} must be a table")
    known = set(Prices.__dataclass_fields__)
    _reject_unknown(table, known, where)
    for key, value in table.items():
        if not isinstance(value, int | float) or value < 0:
            raise ConfigError(f"{where}: {key} must be a number >= 0, got {value!r}")
    return Prices(**{key: float(value) for key, value in table.items()})


def _parse_store(name: str, table: Any, where: str) -> StoreConfig:
    if not isinstance(table, dict):
        raise ConfigError(f"{where} must be a table")
    _reject_unknown(table, {"url", "region", "endpoint_url", "job_credentials"}, where)
    url = _required_str(table, "url", where)
    if not url.startswith(("file://", "s3://")):
        raise ConfigError(f"{where}: url '{url}' must start with file:// or s3://")
    job_credentials = _path(table["job_credentials"], f"{where}: job_credentials") \
        if "job_credentials" in table else None
    if job_credentials is not None and not url.startswith("s3://"):
        raise ConfigError(f"{where}: job_credentials is for s3:// stores; '{url}' needs none")
    return StoreConfig(
        name=name,
        url=url,
        region=_required_str(table, "region", where),
        endpoint_url=str(table.get("endpoint_url", "")),
        job_credentials=job_credentials,
    )


def _table(raw: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    value = raw.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: [{key}] must be a table")
    return value


def _required_str(table: dict[str, Any], key: str, where: str) -> str:
    value = table.get(key)
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: missing {key} = \"...\"")
    return value


def _reject_unknown(table: dict[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(known))}"
        )


# --- [sync]: settings declared once ------------------------------------------------------

Parse = Callable[[Any, str], Any]


@dataclass(frozen=True)
class Setting:
    """One key of a table: how to read it (raising ConfigError naming `where`), its default
    and its help. A setting without a default is required."""

    name: str
    parse: Parse
    default: Any
    help: str
    required: bool = False


def _whole(low: int, high: int) -> Parse:
    def parse(value: Any, where: str) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise ConfigError(f"{where} must be a whole number from {low} to {high}, "
                              f"got {value!r}")
        return value
    return parse


def _seconds(value: Any, where: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise ConfigError(f"{where} must be a number of seconds > 0, got {value!r}")
    return float(value)


def _rate(value: Any, where: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{where} must be a number of MB/s >= 0 (0: no cap), got {value!r}")
    return float(value)


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where} must be a non-empty string, got {value!r}")
    return value


def _path(value: Any, where: str) -> Path:
    text = _text(value, where)
    if not text.startswith("/"):
        raise ConfigError(f"{where} must be an absolute path, got {value!r}")
    return Path(text)


def _choice(*choices: str) -> Parse:
    def parse(value: Any, where: str) -> str:
        if value not in choices:
            raise ConfigError(f"{where} must be one of {', '.join(choices)}, got {value!r}")
        return str(value)
    return parse


def _names(value: Any, where: str) -> tuple[str, ...]:
    if (not isinstance(value, list) or not value
            or not all(isinstance(v, str) and v for v in value)):
        raise ConfigError(f"{where} must be a non-empty list of store names or URLs, "
                          f"got {value!r}")
    if len(set(value)) != len(value):
        raise ConfigError(f"{where} names a store twice: {value!r}")
    return tuple(value)


SYNC_SETTINGS = (
    Setting("roots", _names, None, "Stores to watch for committed checkpoints: names from "
            "[stores], or file:// and s3:// URLs.", required=True),
    Setting("destination", _text, None, "The [stores] name checkpoints are replicated to.",
            required=True),
    Setting("state", _path, SyncConfig.state, "The SQLite state database (WAL mode); its "
            "directory must be writable."),
    Setting("key_file", _path, None, "The site master key (0600). Default: "
            "$SLURM_GEO_KEY_FILE, else /etc/slurm-geo/master.key."),
    Setting("metrics_address", _text, SyncConfig.metrics_address,
            "Address of the Prometheus endpoint."),
    Setting("metrics_port", _whole(0, 65535), SyncConfig.metrics_port,
            "Port of the Prometheus endpoint; 0 turns it off."),
    Setting("bandwidth_mb_s", _rate, SyncConfig.bandwidth_mb_s,
            "Cap on bytes sent to and read back from the destination, in MB/s "
            "(10^6 bytes); 0: no cap."),
    Setting("poll_interval_s", _seconds, SyncConfig.poll_interval_s,
            "Seconds between scans of the roots."),
    Setting("nice", _whole(0, 19), SyncConfig.nice, "CPU niceness the daemon gives itself "
            "(for cpu_policy batch or normal)."),
    Setting("cpu_policy", _choice("idle", "batch", "normal"), SyncConfig.cpu_policy,
            "CPU scheduling policy: idle (SCHED_IDLE: runs in the gaps training leaves; "
            "replicas lag on saturated CPUs), batch (SCHED_BATCH), normal."),
    Setting("io_class", _choice("idle", "best-effort", "none"), SyncConfig.io_class,
            "I/O scheduling class the daemon gives itself (none: leave it)."),
    Setting("max_attempts", _whole(1, 1000), SyncConfig.max_attempts,
            "Failed attempts before a checkpoint is marked failed; attempts cut short by an "
            "unreachable store do not count."),
    Setting("attempt_timeout_s", _seconds, SyncConfig.attempt_timeout_s,
            "An attempt still running after this long fails (and counts)."),
    Setting("retry_base_s", _seconds, SyncConfig.retry_base_s,
            "Wait after a first failure; it doubles with each further one."),
    Setting("retry_max_s", _seconds, SyncConfig.retry_max_s, "The longest wait between tries."),
)


def _read_settings(table: Any, settings: tuple[Setting, ...], where: str) -> dict[str, Any]:
    """The table's values, each read by its Setting; unknown keys and missing required
    ones are refused, naming them."""
    if not isinstance(table, dict):
        raise ConfigError(f"{where} must be a table")
    _reject_unknown(table, {s.name for s in settings}, where)
    values = {}
    for setting in settings:
        if setting.name in table:
            values[setting.name] = setting.parse(table[setting.name], f"{where}: {setting.name}")
        elif setting.required:
            raise ConfigError(f"{where}: missing {setting.name} ({setting.help})")
    return values


def _parse_sync(table: Any, stores: dict[str, StoreConfig], where: str) -> SyncConfig:
    config = SyncConfig(**_read_settings(table, SYNC_SETTINGS, where))
    _check_sync_stores(config, stores, where)
    if config.retry_max_s < config.retry_base_s:
        raise ConfigError(f"{where}: retry_max_s ({config.retry_max_s:g}) is shorter than "
                          f"retry_base_s ({config.retry_base_s:g})")
    return config


def _check_sync_stores(config: SyncConfig, stores: dict[str, StoreConfig], where: str) -> None:
    known = ", ".join(sorted(stores)) or "none"
    for root in config.roots:
        if "://" in root:
            if not root.startswith(("file://", "s3://")):
                raise ConfigError(f"{where}: root '{root}' must start with file:// or s3://")
        elif root not in stores:
            raise ConfigError(f"{where}: root '{root}' is neither a URL nor one of [stores] "
                              f"(stores: {known})")
    if config.destination not in stores:
        raise ConfigError(f"{where}: destination '{config.destination}' is not one of [stores] "
                          f"(stores: {known})")
    destination_url = stores[config.destination].url
    for root in config.roots:
        if root == config.destination or stores.get(root, StoreConfig("", root, "")).url \
                == destination_url:
            raise ConfigError(f"{where}: destination '{config.destination}' is also one of "
                              "roots; a store cannot be replicated into itself")


def settings_table(settings: tuple[Setting, ...] = SYNC_SETTINGS) -> str:
    """The Markdown table of a settings declaration, as docs/checkpoint-sync.md shows it."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for s in settings:
        default = "required" if s.required else ("-" if s.default is None else
                                                 f"`{_toml_value(s.default)}`")
        rows.append(f"| `{s.name}` | {default} | {s.help} |")
    return "\n".join(rows)


def _toml_value(value: Any) -> str:
    if isinstance(value, str | Path):
        return f'"{value}"'
    return f"{value:g}" if isinstance(value, float) else str(value)


# --- [federation]: the federation daemon --------------------------------------------------

@dataclass(frozen=True)
class FederationConfig:
    """The [federation] table: how the federation daemon watches clusters and moves jobs."""

    state: Path = Path("/var/lib/slurm-geo/federation.db")
    audit_path: Path = Path("/var/lib/slurm-geo/audit.db")
    key_file: Path | None = None
    listen_address: str = "127.0.0.1"
    listen_port: int = 9852
    public_url: str = ""
    probe_interval_s: float = 10.0
    outage_after: int = 3
    lease_ttl_s: float = 60.0
    margin_s: float = 60.0
    failback: bool = True
    failback_stable_s: float = 120.0

    @property
    def url(self) -> str:
        """Where jobs reach the daemon's lease and key service."""
        return self.public_url or f"http://{self.listen_address}:{self.listen_port}"

    @property
    def detection_window_s(self) -> float:
        return self.probe_interval_s * self.outage_after


def _flag(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    return value


FEDERATION_SETTINGS = (
    Setting("state", _path, FederationConfig.state, "The daemon's SQLite state (logical jobs, "
            "incarnations, leases, cluster health, bandwidth)."),
    Setting("audit_path", _path, FederationConfig.audit_path,
            "The append-only, hash-chained audit log (SQLite)."),
    Setting("key_file", _path, None, "The site master key (0600). Default: "
            "$SLURM_GEO_KEY_FILE, else /etc/slurm-geo/master.key."),
    Setting("listen_address", _text, FederationConfig.listen_address,
            "Address of the lease/key service and the Prometheus /metrics endpoint."),
    Setting("listen_port", _whole(1, 65535), FederationConfig.listen_port,
            "Port of the lease/key service and /metrics."),
    Setting("public_url", _text, None, "URL jobs on every cluster use to reach the service "
            "(default http://listen_address:listen_port); put TLS in front of it off-site."),
    Setting("probe_interval_s", _seconds, FederationConfig.probe_interval_s,
            "Seconds between health probes of each cluster."),
    Setting("outage_after", _whole(1, 100), FederationConfig.outage_after,
            "Consecutive failed probes before a cluster is declared out."),
    Setting("lease_ttl_s", _seconds, FederationConfig.lease_ttl_s,
            "A job's training lease lasts this long without renewal; a job that cannot renew "
            "stops training, and no other incarnation starts before the lease has expired."),
    Setting("margin_s", _seconds, FederationConfig.margin_s,
            "A running job moves only if that saves more than this many seconds."),
    Setting("failback", _flag, FederationConfig.failback,
            "Move jobs back home when home is healthy and the plan favours it."),
    Setting("failback_stable_s", _seconds, FederationConfig.failback_stable_s,
            "Home must have answered every probe for this long before a failback."),
)


def _parse_federation(table: Any, clusters: dict[str, ClusterConfig], home: str,
                      where: str) -> FederationConfig:
    values = _read_settings(table, FEDERATION_SETTINGS, where)
    if not home:
        raise ConfigError(f"{where} needs [site] home_cluster: jobs fail over from it and back")
    missing = sorted(name for name, c in clusters.items() if not c.store)
    if missing:
        raise ConfigError(f"{where}: cluster(s) {', '.join(missing)} have no store = \"NAME\"; "
                          "the daemon must know where each cluster's jobs keep checkpoints")
    return FederationConfig(**values)
