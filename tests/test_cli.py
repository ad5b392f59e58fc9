"""The command line: help everywhere, no heavy imports at start, no tracebacks for mistakes."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "boto3", "botocore", "requests", "slurm_geo.slurm")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slurm_geo", *args], capture_output=True,
                          text=True, timeout=60, check=False)


@pytest.mark.parametrize("args", [
    [], ["sandbox"], ["sandbox", "up"], ["sandbox", "down"], ["sandbox", "status"],
    ["sandbox", "env"], ["sandbox", "demo"],
])
def test_every_command_has_help(args):
    result = run(*args, "--help")
    assert result.returncode == 0
    assert "Usage:" in result.stdout


def test_help_imports_nothing_heavy():
    code = ("import sys; sys.argv = ['slurm-geo', '--help']\n"
            "from slurm_geo.cli import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            f"print(sorted(m for m in sys.modules if m.startswith({HEAVY!r})))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, check=True)
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_unknown_sandbox_cluster_is_one_line_without_traceback(tmp_path):
    (tmp_path / "rented").mkdir()
    result = run("sandbox", "env", "--dir", str(tmp_path), "elsewhere")
    assert result.returncode == 4
    assert result.stderr.strip() == (
        "slurm-geo: error: no sandbox cluster 'elsewhere'; choose one of: onprem, rented")


def test_env_before_up_says_to_run_up(tmp_path):
    result = run("sandbox", "env", "--dir", str(tmp_path), "rented")
    assert result.returncode == 4
    assert "run `slurm-geo sandbox up`" in result.stderr
    assert "Traceback" not in result.stderr


def test_unknown_command_is_a_usage_error():
    result = run("teleport")
    assert result.returncode == 2
    assert "No such command 'teleport'" in result.stderr
