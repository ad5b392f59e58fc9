"""`slurm-geo completion SHELL` prints click's script, and the program answers the
requests that script makes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from slurm_geo.cli import COMPLETE_VAR, PROG, cli


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_the_script_names_the_program_and_its_variable(shell):
    result = CliRunner().invoke(cli, ["completion", shell])
    assert result.exit_code == 0, result.output
    assert PROG in result.output and COMPLETE_VAR in result.output
    assert f"{shell}_complete" in result.output


def test_an_unknown_shell_is_a_usage_error():
    result = CliRunner().invoke(cli, ["completion", "tcsh"])
    assert result.exit_code == 2
    assert "'tcsh' is not one of 'bash', 'zsh', 'fish'" in result.output


def test_a_bash_request_for_ck_offers_ckpt():
    # what the bash script sends, to the program itself (not CliRunner: main() reads it)
    env = {**os.environ, COMPLETE_VAR: "bash_complete", "COMP_WORDS": f"{PROG} ck",
           "COMP_CWORD": "1"}
    result = subprocess.run([sys.executable, "-m", "slurm_geo"], env=env, capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["plain,ckpt"]


def test_bash_sourcing_the_script_completes_ck_to_ckpt(tmp_path):
    shim = tmp_path / PROG
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m slurm_geo "$@"\n')
    shim.chmod(0o755)
    script = tmp_path / "completion.bash"
    script.write_text(CliRunner().invoke(cli, ["completion", "bash"]).output)
    words = f'source {script}; COMP_WORDS=({PROG} ck); COMP_CWORD=1; ' \
            f'_slurm_geo_completion {PROG}; echo "${{COMPREPLY[@]}}"'
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    result = subprocess.run(["bash", "--norc", "-c", words], env=env, capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ckpt"]
