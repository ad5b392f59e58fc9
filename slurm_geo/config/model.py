"""Typed view of the slurm-geo config file, validated once at load time.

Parsing is pure (dict in, dataclasses out) so every rule is tested without files; only
`load_config` touches the disk. Each table is declared once, as a dataclass and its
Settings: the daemons' [sync] and [federation] in `daemons.py`, every other in
`tables.py`; the declaration machinery and the one set of validators are in `settings.py`.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_geo.config.daemons import (
    FEDERATION_SETTINGS,
    SYNC_SETTINGS,
    FederationConfig,
    SyncConfig,
    parse_federation,
    parse_sync,
)
from slurm_geo.config.paths import (
    CONFIG_ENV,
    DEFAULT_CONFIG_PATH,
    config_path_from_env,
)
from slurm_geo.config.settings import (
    Setting,
    read_settings,
    reject_unknown,
    settings_table,
    site_name,
)
from slurm_geo.config.tables import (
    ACCESS_METHODS,
    CLUSTER_SETTINGS,
    DEFAULT_REGISTRY_PATH,
    DEFAULT_TIMEOUT_S,
    REGISTRY_SETTINGS,
    SITE_SETTINGS,
    BillingTable,
    ClusterConfig,
    PriceEntry,
    Prices,
    StoreConfig,
    parse_billing,
    parse_cluster,
    parse_policy,
    parse_retention,
    parse_store,
)
from slurm_geo.errors import ConfigError
from slurm_geo.policy.geo import GeoPolicy
from slurm_geo.policy.retention import RetentionPolicy

# What is imported from here today, whichever module of the package declares it.
__all__ = [
    "ACCESS_METHODS", "CLUSTER_SETTINGS", "CONFIG_ENV", "DEFAULT_CONFIG_PATH",
    "DEFAULT_REGISTRY_PATH", "DEFAULT_TIMEOUT_S", "FEDERATION_SETTINGS", "SYNC_SETTINGS",
    "BillingTable", "ClusterConfig", "FederationConfig", "PriceEntry", "Prices", "Setting",
    "SiteConfig", "StoreConfig", "SyncConfig", "config_path_from_env", "load_config",
    "parse_config", "settings_table",
]

TABLES = ("site", "clusters", "stores", "retention", "sync", "policy", "registry",
          "federation", "billing")


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
    billing: BillingTable = field(default_factory=BillingTable)  # [billing]: chargeback

    def cluster(self, name: str) -> ClusterConfig:
        try:
            return self.clusters[name]
        except KeyError:
            known = ", ".join(sorted(self.clusters)) or "none"
            raise ConfigError(
                f"cluster '{name}' is not in {self.source} (known clusters: {known})"
            ) from None


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
    reject_unknown(raw, set(TABLES), source)
    tables = {name: _table(raw, name, source) for name in TABLES}
    for kind in ("clusters", "stores"):
        for name in tables[kind]:  # before a name goes into any message
            site_name(name, f"{source} [{kind}]: a {kind[:-1]}'s name")
    home = read_settings(tables["site"], SITE_SETTINGS, f"{source} [site]").get(
        "home_cluster", "")
    clusters = {name: parse_cluster(name, table, f"{source} [clusters.{name}]")
                for name, table in tables["clusters"].items()}
    stores = {name: parse_store(name, table, f"{source} [stores.{name}]")
              for name, table in tables["stores"].items()}
    if home and home not in clusters:
        raise ConfigError(f"{source}: home_cluster '{home}' is not one of [clusters]")
    for cluster in clusters.values():
        if cluster.store and cluster.store not in stores:
            raise ConfigError(f"{source} [clusters.{cluster.name}]: store '{cluster.store}' is "
                              f"not one of [stores] ({', '.join(sorted(stores)) or 'none'})")
    registry = read_settings(tables["registry"], REGISTRY_SETTINGS, f"{source} [registry]")
    return SiteConfig(
        home_cluster=home, clusters=clusters, stores=stores, source=source,
        retention=parse_retention(tables["retention"], f"{source} [retention]"),
        sync=parse_sync(tables["sync"], stores, f"{source} [sync]") if "sync" in raw else None,
        policy=parse_policy(tables["policy"], {c.region for c in clusters.values()},
                            f"{source} [policy]"),
        registry_path=registry.get("path", DEFAULT_REGISTRY_PATH),
        federation=(parse_federation(tables["federation"], clusters, home,
                                     f"{source} [federation]")
                    if "federation" in raw else None),
        billing=parse_billing(tables["billing"], clusters, f"{source} [billing]"),
    )


def _table(raw: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    value = raw.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: [{key}] must be a table")
    return value
