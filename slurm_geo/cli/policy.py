"""`slurm-geo policy ...`: check --geo-* directives, and export the policy for Slurm's Lua."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import click

from slurm_geo.atomic import write_if_changed

config_option = click.option(
    "--config", "config_path", type=click.Path(path_type=Path), default=None,
    help="The slurm-geo config (default: $SLURM_GEO_CONFIG or /etc/slurm-geo/config.toml).")


@click.group()
def policy() -> None:
    """Residency, data classes and budgets of the --geo-* directives."""


@policy.command("export-lua")
@config_option
@click.option("--cluster", required=True, help="The cluster whose controller reads the files.")
@click.option("--dir", "directory", required=True,
              type=click.Path(file_okay=False, path_type=Path),
              help="The directory of that cluster's slurm.conf.")
def export_lua(config_path: Path | None, cluster: str, directory: Path) -> None:
    """Write geo_policy.lua, job_submit.lua and cli_filter.lua into DIR.

    slurmctld re-reads job_submit.lua when it changes, and reads geo_policy.lua at every
    submission: no restart is needed after a policy change.
    """
    from slurm_geo.config import load_config
    from slurm_geo.policy.geo import rules_for
    from slurm_geo.policy.lua import export_files

    site = load_config(config_path)
    for name, text in export_files(rules_for(site), cluster, site.source).items():
        changed = write_if_changed(directory / name, text)
        click.echo(f"{'wrote' if changed else 'unchanged'} {directory / name}")


@policy.command(context_settings={"ignore_unknown_options": True})
@config_option
@click.option("--cluster", default=None, help="The cluster the job goes to (default: home).")
@click.option("--json", "as_json", is_flag=True,
              help="Print {accepted, exit_code, reason} as JSON; the exit code is the same.")
@click.argument("directives", nargs=-1, type=click.UNPROCESSED)
def check(config_path: Path | None, cluster: str | None, as_json: bool,
          directives: tuple[str, ...]) -> None:
    """Check --geo-NAME=VALUE directives as sbatch would: `accepted`, or the reason as one
    error line on stderr, exit 5 (a mistake) or 6 (the policy forbids it); 3 for a
    --cluster the config does not know."""
    from slurm_geo.config import load_config
    from slurm_geo.errors import ConfigError
    from slurm_geo.hooks.validator import run

    try:
        if cluster is not None:  # an unknown cluster: 3, as in every command
            load_config(config_path).cluster(cluster)
    except ConfigError as exc:
        code, reason = int(exc.exit_code), str(exc)
    else:
        argv = [f"--config={config_path}"] if config_path else []
        argv += [f"--cluster={cluster}"] if cluster else []
        said = io.StringIO()
        code = run([*argv, *directives], out=said)
        reason = said.getvalue().strip().removeprefix("geo: ")
    if as_json:
        click.echo(json.dumps({"accepted": code == 0, "exit_code": code,
                               "reason": reason or None}))
    elif code:
        click.echo(f"slurm-geo: error: {reason}", err=True)
    else:
        click.echo("accepted")
    sys.exit(code)
