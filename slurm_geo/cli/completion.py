"""`slurm-geo completion SHELL`: click's completion script, so a package or a user installs
it without knowing click's environment variable (`slurm-geo site install` puts the bash one
where bash-completion finds it)."""

from __future__ import annotations

import click
from click.shell_completion import get_completion_class

from slurm_geo.cli import COMPLETE_VAR, PROG

SHELLS = ("bash", "zsh", "fish")


@click.command("completion")
@click.argument("shell", type=click.Choice(SHELLS))
@click.pass_context
def completion(ctx: click.Context, shell: str) -> None:
    """Print the completion script for SHELL.

    \b
    bash: slurm-geo completion bash > /usr/share/bash-completion/completions/slurm-geo
    zsh:  eval "$(slurm-geo completion zsh)" in ~/.zshrc
    fish: slurm-geo completion fish > ~/.config/fish/completions/slurm-geo.fish
    """
    script_class = get_completion_class(shell)
    assert script_class is not None  # click ships all of SHELLS
    click.echo(script_class(ctx.find_root().command, {}, PROG, COMPLETE_VAR).source())
