"""The conventions of docs/cli.md, held for the whole command tree (`make check-cli`): every
group and command answers --help, and every command that reads or reports state has --json.
The docs' exit-code table is kept equal to the code's by tests/test_exitcodes.py, which
`make check-cli` runs beside this file."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from slurm_geo.cli import PROG, cli
from slurm_geo.cli.tree import option_names, walk

TREE = list(walk(cli, PROG))
LEAVES = {" ".join(path[1:]): command for path, command in TREE
          if not isinstance(command, click.Group)}

# Commands with no --json, each for its reason; every other command has one.
WITHOUT_JSON = {
    "completion": "prints a shell script to source, not state",
    "logs": "prints the job's own output as it wrote it; --follow streams it",
    "policy export-lua": "writes files for slurmctld and names them; nothing to parse",
    "sandbox up": "acts, with progress on stderr; `sandbox status --json` reports after",
    "sandbox down": "acts and prints nothing",
    "sandbox env": "prints export lines for the shell's eval",
    "sandbox exec": "becomes COMMAND; its output is that command's",
}


def test_the_walk_reaches_every_group_and_their_commands():
    paths = {" ".join(path[1:]) for path, _ in TREE}
    assert {"", "ckpt", "ckpt push", "keys rotate", "sandbox exec", "sync retry"} <= paths
    assert len(LEAVES) > 30


@pytest.mark.parametrize("path", [path for path, _ in TREE], ids=" ".join)
def test_every_group_and_command_answers_help(path):
    result = CliRunner().invoke(cli, [*path[1:], "--help"], prog_name=path[0])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"Usage: {' '.join(path)} ")


def test_every_command_that_reports_state_has_json():
    lacking = {name for name, command in LEAVES.items()
               if "--json" not in option_names(command)}
    # equal, not a subset: an allowed command that gains --json leaves the list too
    assert lacking == set(WITHOUT_JSON)
