"""The S3 credentials a job the daemon submits gets for the store it writes to.

A store may name an env file of credentials scoped to its bucket (`job_credentials`); the
job gets those and never the daemon's own, which may reach every bucket the site uses.
Without one, the daemon passes its own, as a site with a single trusted bucket may choose.
A job that writes to a directory store gets no S3 credentials at all.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

from slurm_geo.config.model import StoreConfig
from slurm_geo.errors import ConfigError

SECRET_NAMES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
REQUIRED_NAMES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
REGION_NAME = "AWS_DEFAULT_REGION"


def parse_credentials(text: str, where: str) -> dict[str, str]:
    """KEY=VALUE lines as in a systemd EnvironmentFile: blank lines and # comments are
    skipped, one pair of surrounding quotes is dropped; only S3 credential names."""
    found: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, equals, value = line.partition("=")
        name, value = name.strip(), value.strip()
        if not equals or not name:
            raise ConfigError(f"{where}, line {number}: expected NAME=VALUE")
        if name not in SECRET_NAMES:
            raise ConfigError(f"{where}, line {number}: {name} is not one of "
                              f"{', '.join(SECRET_NAMES)}")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        found[name] = value
    missing = [name for name in REQUIRED_NAMES if not found.get(name)]
    if missing:
        raise ConfigError(f"{where}: missing {', '.join(missing)}")
    return found


def read_job_credentials(path: Path) -> dict[str, str]:
    try:
        with open(path) as handle:
            mode = os.fstat(handle.fileno()).st_mode
            text = handle.read()
    except OSError as exc:
        raise ConfigError(f"job_credentials {path}: cannot read it ({exc.strerror})") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"job_credentials {path}: mode {stat.S_IMODE(mode):04o} lets "
                          "others in; chmod 600 it")
    return parse_credentials(text, f"job_credentials {path}")


def job_environment(store: StoreConfig, daemon_env: Mapping[str, str]) -> dict[str, str]:
    """What a job writing to `store` gets in its environment for it. The file is read at
    each submission, so rotated credentials need no daemon restart."""
    if not store.url.startswith("s3://"):
        return {}  # a directory store needs no key
    env = {REGION_NAME: daemon_env[REGION_NAME]} if REGION_NAME in daemon_env else {}
    if store.job_credentials is not None:
        return {**env, **read_job_credentials(store.job_credentials)}
    return {**env, **{name: daemon_env[name] for name in SECRET_NAMES if name in daemon_env}}
