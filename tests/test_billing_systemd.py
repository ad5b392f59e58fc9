"""The billing timer and its oneshot service: systemd accepts both, and the service runs a
command line slurm-geo understands."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from systemd_units import installed_here, settings

from slurm_geo.site import UNITS

ROOT = Path(__file__).resolve().parent.parent
SERVICE = UNITS / "slurm-geo-billing-ingest.service"
TIMER = UNITS / "slurm-geo-billing-ingest.timer"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_systemd_analyze_verify_accepts_service_and_timer(tmp_path):
    # Verified together: the timer names the service, which must sit beside it.
    units = [installed_here(unit, tmp_path) for unit in (SERVICE, TIMER)]
    result = subprocess.run(["systemd-analyze", "verify", "--man=no", *map(str, units)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == ""


@pytest.mark.parametrize("unit, key, value", [
    (SERVICE, "Type", "oneshot"), (SERVICE, "NoNewPrivileges", "yes"),
    (SERVICE, "ProtectSystem", "strict"), (SERVICE, "ReadWritePaths", "/var/lib/slurm-geo"),
    (SERVICE, "SuccessExitStatus", "51"),
    (TIMER, "Unit", SERVICE.name), (TIMER, "Persistent", "true"),
    (TIMER, "OnCalendar", "hourly"),
])
def test_unit_settings(unit, key, value):
    assert value in settings(unit)[key]


def test_the_service_runs_ingest_then_check_both_alerting():
    """Each line a command slurm-geo accepts; ingest first (check compares what it read)."""
    from slurm_geo.errors import SlurmGeoError  # noqa: F401 - the package imports

    commands = [shlex.split(c) for c in settings(SERVICE)["ExecStart"]]
    assert [argv[1:3] for argv in commands] == [["billing", "ingest"], ["billing", "check"]]
    for argv in commands:
        assert argv[0] == "/usr/local/bin/slurm-geo" and "--alert" in argv
        run = subprocess.run([sys.executable, "-m", "slurm_geo", *argv[1:], "--help"],
                             capture_output=True, text=True, timeout=30)
        assert run.returncode == 0, run.stderr
    assert "--check-budgets" in commands[0]
