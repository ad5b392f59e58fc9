"""The `slurm-geo` command tree, walked: what the convention tests and the man pages read."""

from __future__ import annotations

from collections.abc import Iterator

import click


def walk(root: click.Command, prog: str) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    """Every group and command under `root`, itself first, as (path, command); the path
    starts with the program's name. Lazily imported groups are imported."""
    yield from _walk(root, (prog,), None)


def _walk(command: click.Command, path: tuple[str, ...], parent: click.Context | None
          ) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    yield path, command
    if isinstance(command, click.Group):
        ctx = click.Context(command, info_name=path[-1], parent=parent)
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                yield from _walk(sub, (*path, name), ctx)


def option_names(command: click.Command) -> set[str]:
    return {name for param in command.params if isinstance(param, click.Option)
            for name in (*param.opts, *param.secondary_opts)}
