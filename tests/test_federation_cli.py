"""`slurm-geo status`, `plan` and `approve` as a user meets them: one line and an exit
code for each mistake, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from slurm_geo.federation.model import JobStatus, LogicalJob
from slurm_geo.federation.state import FederationState

CONFIG = """
[site]
home_cluster = "onprem"
[clusters.onprem]
region = "home"
access = "cli"
slurm_conf = "/nonexistent/slurm.conf"
store = "pfs"
[stores.pfs]
url = "file://{root}/pfs"
region = "home"
[federation]
state = "{root}/fed.db"
audit_path = "{root}/audit.db"
"""


def slurm_geo(*args: str, config) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "slurm_geo", *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "SLURM_GEO_CONFIG":
                                                      str(config)})


def test_status_lists_logical_jobs_and_shows_one(tmp_path):
    config = tmp_path / "config.toml"
    config.write_text(CONFIG.format(root=tmp_path))
    now = time.time()
    state = FederationState(tmp_path / "fed.db")
    state.add_job(LogicalJob("onprem-7", "run-x", "onprem", "#!/bin/bash\n", {}, {}, 0,
                             "onprem", 7, None, JobStatus.RUNNING, None, None, now, now))
    state.close()
    listing = slurm_geo("status", config=config)
    assert listing.returncode == 0, listing.stderr
    assert "onprem-7" in listing.stdout and "onprem:7" in listing.stdout
    one = slurm_geo("status", "onprem-7", "--json", config=config)
    assert one.returncode == 0, one.stderr
    assert '"run": "run-x"' in one.stdout and '"generation": 0' in one.stdout


def test_an_unknown_job_is_one_line_and_exit_2(tmp_path):
    config = tmp_path / "config.toml"
    config.write_text(CONFIG.format(root=tmp_path))
    result = slurm_geo("status", "onprem-404", config=config)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "slurm-geo: error: no logical job 'onprem-404' in the federation state; "
        "`slurm-geo status` without an argument lists them"]


def test_a_config_without_federation_says_what_to_add(tmp_path):
    config = tmp_path / "config.toml"
    config.write_text(CONFIG.format(root=tmp_path).split("[federation]")[0])
    result = slurm_geo("status", config=config)
    assert result.returncode == 3
    assert "has no [federation] table" in result.stderr
    assert "Traceback" not in result.stderr
