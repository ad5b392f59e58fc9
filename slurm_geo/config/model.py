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
    printable,
    read_settings,
    reject_unknown,
    settings_table,
    shown,
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
    RemoteAccount,
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
    "BillingTable", "ClusterConfig", "FederationConfig", "PriceEntry", "Prices",
    "RemoteAccount", "Setting",
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
                f"cluster {shown(name)} is not in {self.source} (known clusters: {known})"
            ) from None


MAX_DEPTH = 8  # tables and lists within one another: the deepest real config needs 4


def load_config(path: Path | None = None) -> SiteConfig:
    """Read and validate the config at `path`, `$SLURM_GEO_CONFIG` or the default path.
    Every way the file can be wrong is one ConfigError line naming it: missing, unreadable,
    a directory, not UTF-8, not TOML, nested too deep, or a value the tables refuse."""
    path = path or config_path_from_env()
    source = printable(str(path))
    try:
        raw = tomllib.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            f"config file {source} does not exist; set {CONFIG_ENV} or create it "
            "(see docs/install.md)"
        ) from None
    except IsADirectoryError:
        raise ConfigError(f"config file {source} is a directory; {CONFIG_ENV} must name the "
                          "file itself") from None
    except PermissionError:
        raise ConfigError(f"config file {source} cannot be read by this user; make it "
                          "readable (it holds no secrets: keys and tokens are other files)"
                          ) from None
    except OSError as exc:
        raise ConfigError(f"config file {source} cannot be read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {source} is not UTF-8 text (byte {exc.start}); "
                          "TOML files are UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {source} is not valid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"config file {source} nests values too deeply to read") from None
    check_depth(raw, source)
    return parse_config(raw, source=source)


def check_depth(raw: dict[str, Any], source: str) -> None:
    """Refuse tables and lists nested more than MAX_DEPTH deep, naming the top table."""
    for key, value in raw.items():
        stack = [(value, 1)]
        while stack:
            item, depth = stack.pop()
            if depth > MAX_DEPTH:
                raise ConfigError(f"{source} [{printable(str(key))}]: values nested more "
                                  f"than {MAX_DEPTH} deep; no setting takes that")
            children = item.values() if isinstance(item, dict) else \
                item if isinstance(item, list) else ()
            stack.extend((child, depth + 1) for child in children)


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
