"""`slurm-geo config check`: read a site config as every command and daemon would, and say
what is wrong with it, or what it holds.

The check is the loader's own (slurm_geo.config.model.load_config): syntax, types, ranges,
unknown keys and what crosses tables (a cluster's store, home_cluster, the replicas). It
opens no file the config names (keys, tokens, certificates, databases): those are the
deployment's, checked where they are used and by `slurm-geo doctor`, so a config can be
checked on any host, before the files exist.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click


@click.group()
def config() -> None:
    """The site config file (TOML): check it."""


@config.command()
@click.argument("path", required=False, type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True,
              help="Print {path, ok, problems, summary} as JSON; the exit code is the same.")
def check(path: Path | None, as_json: bool) -> None:
    """Check the config at PATH (default: $SLURM_GEO_CONFIG or /etc/slurm-geo/config.toml).

    Syntax and meaning only: files it names (keys, tokens, certificates) need not exist
    here. A problem is one line naming the table, the key and the fix, exit 3; the loader
    stops at the first, so fix it and check again.
    """
    from slurm_geo.config.model import load_config
    from slurm_geo.config.paths import config_path_from_env
    from slurm_geo.errors import ConfigError

    path = path or config_path_from_env()
    try:
        site = load_config(path)
    except ConfigError as exc:
        if as_json:
            click.echo(json.dumps({"path": str(path), "ok": False, "problems": [str(exc)],
                                   "summary": None}, indent=2))
        else:
            click.echo(f"slurm-geo: error: {exc}", err=True)
        sys.exit(int(exc.exit_code))
    summary = _summary(site)
    if as_json:
        click.echo(json.dumps({"path": str(path), "ok": True, "problems": [],
                               "summary": summary}, indent=2))
    else:
        click.echo(f"{path}: ok")
        for key, value in summary.items():
            shown = ", ".join(value) if isinstance(value, list) else value
            click.echo(f"  {key:<11} {shown if shown not in ('', None, []) else '-'}")


def _summary(site: Any) -> dict[str, Any]:
    """What the config holds, as a reader checks they meant it."""
    federation = site.federation
    if federation is None:
        daemon = None
    elif federation.replicated:
        daemon = f"replica {federation.replica} of {len(federation.replicas)}, on etcd"
    else:
        daemon = f"alone, state {federation.state}"
    return {
        "home": site.home_cluster or None,
        "clusters": [f"{c.name} ({c.access}, {c.region})" for c in site.clusters.values()],
        "stores": [f"{s.name} ({s.region})" for s in site.stores.values()],
        "sync": (f"{', '.join(site.sync.roots)} -> {site.sync.destination}"
                 if site.sync is not None else None),
        "federation": daemon,
        "budgets": sorted(site.billing.budgets),
    }
