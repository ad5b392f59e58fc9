"""The slurm-geo config file (TOML): clusters, their access, prices and object stores."""

from slurm_geo.config.model import (
    ClusterConfig,
    Prices,
    SiteConfig,
    StoreConfig,
    load_config,
    parse_config,
)

__all__ = [
    "ClusterConfig",
    "Prices",
    "SiteConfig",
    "StoreConfig",
    "load_config",
    "parse_config",
]
