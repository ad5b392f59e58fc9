"""Where slurm-geo finds its config and the site master key: a default, and the
environment variable that overrides it. Each is resolved here, and only here."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

DEFAULT_CONFIG_PATH = Path("/etc/slurm-geo/config.toml")
CONFIG_ENV = "SLURM_GEO_CONFIG"
DEFAULT_KEY_FILE = Path("/etc/slurm-geo/master.key")
KEY_FILE_ENV = "SLURM_GEO_KEY_FILE"


def config_path_from_env(env: Mapping[str, str] = os.environ) -> Path:
    """$SLURM_GEO_CONFIG, else /etc/slurm-geo/config.toml."""
    return Path(env.get(CONFIG_ENV) or DEFAULT_CONFIG_PATH)


def master_key_path(configured: Path | None, env: Mapping[str, str]) -> Path:
    """The site master key file: `configured` (a `key_file` setting, a --key-file flag),
    else $SLURM_GEO_KEY_FILE, else /etc/slurm-geo/master.key."""
    if configured is not None:
        return configured
    return Path(env.get(KEY_FILE_ENV) or DEFAULT_KEY_FILE)
