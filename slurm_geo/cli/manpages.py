"""Man pages from the help text: one roff page per group and command (`slurm-geo.1`,
`slurm-geo-ckpt-push.1`, ...), so `man` and `--help` never disagree. `make man` writes them
into build/man (`python3 -m slurm_geo.cli.manpages DIR`); `slurm-geo site install` installs
them.

A page is NAME, SYNOPSIS, DESCRIPTION, COMMANDS (groups only), OPTIONS, EXIT STATUS (the
table of slurm_geo.exitcodes) and SEE ALSO (the parent group and the commands under it).
No date in the header: the pages of one version are the same bytes whenever they are built.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import click

from slurm_geo import __version__
from slurm_geo.cli.tree import walk
from slurm_geo.exitcodes import ExitCode

SECTION = 1
# Wide enough that click never cuts a group's one-line summaries short.
SUMMARY_LIMIT = 200


def pages(root: click.Command, prog: str) -> dict[str, str]:
    """File name -> roff text, for `root` and every group and command under it."""
    tree = list(walk(root, prog))
    children: dict[tuple[str, ...], list[tuple[tuple[str, ...], click.Command]]] = {}
    for path, command in tree[1:]:
        children.setdefault(path[:-1], []).append((path, command))
    return {f"{_page_name(path)}.{SECTION}": page(path, command, children.get(path, []))
            for path, command in tree}


def page(path: tuple[str, ...], command: click.Command,
         children: list[tuple[tuple[str, ...], click.Command]]) -> str:
    ctx = click.Context(command, info_name=" ".join(path))
    title = _page_name(path)
    lines = [f'.TH {_escape(title.upper())} {SECTION} "" "{path[0]} {__version__}" '
             f'"{path[0]} manual"',
             ".SH NAME", f"{_escape(title)} \\- {_escape(_summary(command))}",
             ".SH SYNOPSIS",
             f".B {_escape(' '.join(path))}", _escape(" ".join(command.collect_usage_pieces(ctx))),
             ".SH DESCRIPTION", *_paragraphs(command.help or _summary(command))]
    if children:
        lines.append(".SH COMMANDS")
        for child, sub in children:
            lines += [".TP", f".B {_escape(child[-1])}", _escape(_summary(sub))]
    lines += [".SH OPTIONS", *_options(command, ctx), ".SH EXIT STATUS", *_exit_status(),
              ".SH SEE ALSO", _see_also(path, [child for child, _ in children])]
    return "\n".join(lines) + "\n"


def _page_name(path: tuple[str, ...]) -> str:
    return "-".join(path)


def _summary(command: click.Command) -> str:
    return command.get_short_help_str(SUMMARY_LIMIT)


def _paragraphs(help_text: str) -> list[str]:
    """click's help text as roff: paragraphs refilled, those after click's `\\b` kept
    line for line, as --help keeps them."""
    lines = []
    for paragraph in inspect.cleandoc(help_text).split("\n\n"):
        kept = paragraph.splitlines()
        if kept[0].strip() == "\b":
            lines += [".PP", ".nf", *(_escape(line) for line in kept[1:]), ".fi"]
        else:
            lines += [".PP", _escape(" ".join(line.strip() for line in kept))]
    return lines


def _options(command: click.Command, ctx: click.Context) -> list[str]:
    lines = []
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is not None:
            names, help_text = record
            lines += [".TP", f".B {_escape(names)}", _escape(help_text)]
    return lines


def _exit_status() -> list[str]:
    lines = [".TP", ".B 0", "success"]
    for code in ExitCode:
        lines += [".TP", f".B {code.value}", _escape(f"{code.name} ({code.kind}): {code.meaning}")]
    return lines


def _see_also(path: tuple[str, ...], children: list[tuple[str, ...]]) -> str:
    related = ([path[:-1]] if len(path) > 1 else []) + children
    return ",\n".join(f".BR {_escape(_page_name(other))} ({SECTION})" for other in related)


def _escape(text: str) -> str:
    """Text roff prints as it is: backslashes and hyphens escaped, a leading dot or quote
    kept from reading as a request."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\\&" + text if text.startswith((".", "'")) else text


def main(argv: list[str]) -> int:
    from slurm_geo.cli import PROG, cli

    if len(argv) != 1:
        print("usage: python -m slurm_geo.cli.manpages DIR", file=sys.stderr)
        return ExitCode.USAGE
    directory = Path(argv[0])
    directory.mkdir(parents=True, exist_ok=True)
    written = pages(cli, PROG)
    for name, text in written.items():
        (directory / name).write_text(text)
    print(f"wrote {len(written)} man pages to {directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
