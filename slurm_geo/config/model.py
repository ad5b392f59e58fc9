"""Typed view of the slurm-geo config file, validated once at load time.

Parsing is pure (dict in, dataclasses out) so every rule is tested without files; only
`load_config` touches the disk.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_geo.errors import ConfigError
from slurm_geo.policy.retention import RetentionPolicy

DEFAULT_CONFIG_PATH = Path("/etc/slurm-geo/config.toml")
CONFIG_ENV = "SLURM_GEO_CONFIG"
ACCESS_METHODS = ("cli", "rest")
DEFAULT_TIMEOUT_S = 10.0


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


@dataclass(frozen=True)
class StoreConfig:
    """An object store or directory checkpoints are written to."""

    name: str
    url: str
    region: str
    endpoint_url: str = ""


@dataclass(frozen=True)
class SiteConfig:
    home_cluster: str
    clusters: dict[str, ClusterConfig]
    stores: dict[str, StoreConfig]
    source: str = "<memory>"
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)

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
    _reject_unknown(raw, {"site", "clusters", "stores", "retention"}, source)
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
    return SiteConfig(home_cluster=home, clusters=clusters, stores=stores, source=source,
                      retention=retention)


_CLUSTER_KEYS = {
    "region", "access", "provider", "slurm_conf", "rest_url", "rest_user", "token_file",
    "timeout_s", "prices",
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
    )


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
    _reject_unknown(table, {"url", "region", "endpoint_url"}, where)
    url = _required_str(table, "url", where)
    if not url.startswith(("file://", "s3://")):
        raise ConfigError(f"{where}: url '{url}' must start with file:// or s3://")
    return StoreConfig(
        name=name,
        url=url,
        region=_required_str(table, "region", where),
        endpoint_url=str(table.get("endpoint_url", "")),
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
