"""A site config for a test, written from keyword arguments: one home cluster onprem
with its store pfs (file://ROOT/pfs) and a SQLite federation state under ROOT unless the
test says otherwise.

    write_site(tmp_path)                                  # ROOT/config.toml
    write_site(tmp_path, clusters={**ONPREM, "rented": cluster("cloud", "off")},
               stores={**PFS, "off": store(tmp_path / "off", "cloud")},
               federation={"key_file": str(key)}, billing={"database": "..."})

A table given replaces the default one; `federation=None` leaves [federation] out. Each
top-level keyword is a table of the config (docs/configuration.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from slurm_geo.config.model import SiteConfig, load_config


def cluster(region: str = "home", store: str = "pfs", *, name: str = "onprem",
            **settings: Any) -> dict[str, Any]:
    """A [clusters.NAME] table reached with the CLI (its slurm.conf need not exist)."""
    return {"region": region, "access": "cli", "slurm_conf": f"/nonexistent/{name}.conf",
            "store": store, **settings}


def store(directory: Path | str, region: str = "home", **settings: Any) -> dict[str, Any]:
    """A [stores.NAME] table: a directory store."""
    return {"url": f"file://{directory}", "region": region, **settings}


def site_tables(root: Path, *, home: str = "onprem",
                clusters: dict[str, dict[str, Any]] | None = None,
                stores: dict[str, dict[str, Any]] | None = None,
                federation: dict[str, Any] | None | bool = True,
                **tables: dict[str, Any]) -> dict[str, Any]:
    """The config as the tables it has (what `write_site` writes)."""
    raw: dict[str, Any] = {
        "site": {"home_cluster": home},
        "clusters": clusters if clusters is not None else {
            "onprem": cluster(name="onprem")},
        "stores": stores if stores is not None else {"pfs": store(f"{root}/pfs")},
    }
    if federation is True:
        raw["federation"] = {"state": f"{root}/fed.db", "audit_path": f"{root}/audit.db"}
    elif isinstance(federation, dict):
        raw["federation"] = federation
    raw.update(tables)
    return raw


def toml(raw: dict[str, Any]) -> str:
    """`raw` (tables of tables of strings, numbers, booleans and lists) as TOML."""
    lines: list[str] = []

    def table(name: str, body: dict[str, Any]) -> None:
        scalars = {k: v for k, v in body.items() if not isinstance(v, dict)}
        nested = {k: v for k, v in body.items() if isinstance(v, dict)}
        if scalars or not nested:
            lines.append(f"[{name}]")
            lines.extend(f"{key} = {value_text(value)}" for key, value in scalars.items())
        for key, value in nested.items():
            table(f"{name}.{key}", value)

    for name, body in raw.items():
        table(name, body)
    return "\n".join(lines) + "\n"


def value_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(value_text(item) for item in value) + "]"
    raise TypeError(f"no TOML for {value!r}")


def write_site(root: Path, name: str = "config.toml", **settings: Any) -> Path:
    """Write the site config (`site_tables(root, **settings)`) to ROOT/NAME; its path."""
    path = root / name
    path.write_text(toml(site_tables(root, **settings)))
    return path


def load_site(root: Path, **settings: Any) -> SiteConfig:
    """The `SiteConfig` of `write_site(root, **settings)`, loaded as the daemons load it."""
    return load_config(write_site(root, **settings))


# A whole valid config as parse_config takes it: onprem by the CLI, rented by REST, an S3
# store (test_config.py and test_config_replicas.py build on it).
GOOD = {
    "site": {"home_cluster": "onprem"},
    "clusters": {
        "onprem": {"region": "home", "access": "cli", "slurm_conf": "/etc/slurm/slurm.conf"},
        "rented": {"region": "eu", "access": "rest", "rest_url": "https://r.example:6820/",
                   "rest_user": "geo", "token_file": "/etc/slurm-geo/rented.jwt",
                   "timeout_s": 5, "prices": {"gpu_hour": 2.5, "egress_per_gb": 0.09}},
    },
    "stores": {"offsite": {"url": "s3://bucket/ckpt", "region": "eu",
                           "endpoint_url": "https://minio:9000"}},
}


def federated(**table) -> dict:
    """GOOD with both clusters' store offsite and `table` as its [federation]."""
    raw = {**GOOD, "clusters": {name: {**c, "store": "offsite"}
                                for name, c in GOOD["clusters"].items()},
           "federation": table}
    return raw


SITE = {
    "site": {"home_cluster": "onprem"},
    "clusters": {
        "onprem": {"region": "home", "access": "cli", "slurm_conf": "/etc/slurm/slurm.conf",
                   "store": "pfs", "prices": {"cpu_hour": 0.01}},
        "rented": {"region": "eu", "access": "rest", "rest_url": "https://r.example/",
                   "rest_user": "geo", "token_file": "/etc/slurm-geo/rented.jwt",
                   "provider": "market", "store": "offsite",
                   "users": {"alice": {"account": "geo-alice",
                                       "token_file": "/etc/slurm-geo/rented/alice.jwt"}}},
    },
    "stores": {"pfs": {"url": "file:///pfs/ckpt", "region": "home"},
               "offsite": {"url": "s3://bucket/ckpt", "region": "eu"}},
    "policy": {"data_classes": {"restricted": ["home"]}, "budgets": {"ml": 500}},
    "retention": {"keep_local": 2},
    "registry": {"path": "/var/lib/slurm-geo/registry.db"},
    "billing": {"budgets": {"ml": 1000},
                "prices": [{"provider": "market", "effective_from": "2026-12-01",
                            "gpu_hour": 2, "cpu_hour": 0, "egress_per_gb": 0.1,
                            "marketplace_fee_pct": 5}]},
    "sync": {"roots": ["pfs"], "destination": "offsite"},
    "federation": {},
}
