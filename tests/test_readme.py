"""The README's command blocks, run as written (issue 29: its `curl` exited 60 and nothing
noticed). `make drill` and `make test`, its first block, are what CI runs (.ci/run); every
other `sh` block runs here, in bash with `set -e`, against a throw-away sandbox of its own:
the README's commands name no directory, so SLURM_GEO_SANDBOX_DIR points them there.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from slurm_geo.sandbox import Sandbox

README = Path(__file__).resolve().parent.parent / "README.md"
PORT_BASE = 25800  # clear of the suite's sandbox (16800) and the lifecycle test's


def sh_blocks() -> list[str]:
    return re.findall(r"```sh\n(.*?)```", README.read_text(), flags=re.S)


def test_the_first_block_is_what_ci_runs():
    first = sh_blocks()[0]
    commands = [line.split("#")[0].strip() for line in first.splitlines()]
    assert [c for c in commands if c] == ["make drill", "make test"]
    ci = (README.parent / ".ci" / "run").read_text()
    assert ci.index("make drill") < ci.index("make test")


@pytest.fixture
def throwaway():
    root = Path(f"/var/tmp/slurm-geo-readme-{os.getpid()}")
    done = subprocess.run(["python3", "-m", "slurm_geo", "sandbox", "up", "--dir", str(root),
                           "--port-base", str(PORT_BASE)], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    yield root
    Sandbox(root).down(purge=True)


@pytest.mark.slow
@pytest.mark.root(reason="its blocks bring a sandbox up (munge, MariaDB, Slurm): root's")
def test_every_other_block_runs_as_written(throwaway):
    for block in sh_blocks()[1:]:
        done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block],
                              capture_output=True, text=True, timeout=600,
                              env={**os.environ, "SLURM_GEO_SANDBOX_DIR": str(throwaway)})
        assert done.returncode == 0, (block, done.stdout[-2000:], done.stderr[-2000:])
        assert '"pings"' in done.stdout  # the curl through the TLS relay answered
