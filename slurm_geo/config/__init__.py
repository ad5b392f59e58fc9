"""The slurm-geo config file (TOML): clusters, their access, prices and object stores."""

from slurm_geo.config.model import (
    ClusterConfig,
    FederationConfig,
    Prices,
    SiteConfig,
    StoreConfig,
    SyncConfig,
    load_config,
    parse_config,
)
from slurm_geo.config.paths import (
    DEFAULT_KEY_FILE,
    KEY_FILE_ENV,
    config_path_from_env,
    master_key_path,
)

__all__ = [
    "DEFAULT_KEY_FILE",
    "KEY_FILE_ENV",
    "ClusterConfig",
    "FederationConfig",
    "Prices",
    "SiteConfig",
    "StoreConfig",
    "SyncConfig",
    "config_path_from_env",
    "load_config",
    "master_key_path",
    "parse_config",
]
