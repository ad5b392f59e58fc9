"""Options every command group spells the same way."""

from __future__ import annotations

from pathlib import Path

import click

CONFIG_HELP = "Site config (default: $SLURM_GEO_CONFIG or /etc/slurm-geo/config.toml)."
_CONFIG_KEY = "slurm_geo.config"


def _remember_config(ctx: click.Context, _param: click.Parameter, value: Path | None) -> None:
    if value is not None:
        ctx.meta[_CONFIG_KEY] = value


# Not passed to the command: it reaches load_config through chosen_config(), where a store
# name or a default is resolved deep in a helper, so no signature grows a parameter for it.
config_option = click.option(
    "--config", type=click.Path(path_type=Path), default=None, expose_value=False,
    callback=_remember_config, help=CONFIG_HELP)


def chosen_config() -> Path | None:
    """The --config of the running command; None outside one or without it."""
    ctx = click.get_current_context(silent=True)
    return None if ctx is None else ctx.meta.get(_CONFIG_KEY)
