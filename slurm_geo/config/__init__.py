"""The slurm-geo config file (TOML): clusters, their access, prices and object stores.

The names below are imported when first used: `paths` alone (where the config and the key
are) is wanted by every command, the model and its tables (20 ms) only by those that read
the config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from slurm_geo.lazy import module_getattr

if TYPE_CHECKING:
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

_HOMES = {
    **dict.fromkeys(["ClusterConfig", "FederationConfig", "Prices", "SiteConfig",
                     "StoreConfig", "SyncConfig", "load_config", "parse_config"], "model"),
    **dict.fromkeys(["DEFAULT_KEY_FILE", "KEY_FILE_ENV", "config_path_from_env",
                     "master_key_path"], "paths"),
}

__all__ = [
    "ClusterConfig", "DEFAULT_KEY_FILE", "FederationConfig", "KEY_FILE_ENV", "Prices",
    "SiteConfig", "StoreConfig", "SyncConfig", "config_path_from_env", "load_config",
    "master_key_path", "parse_config",
]

__getattr__ = module_getattr(__name__, _HOMES)
