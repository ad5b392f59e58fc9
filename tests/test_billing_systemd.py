"""The billing timer and its oneshot service: systemd accepts both, and the service runs a
command line slurm-geo understands."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SERVICE = ROOT / "systemd" / "slurm-geo-billing-ingest.service"
TIMER = ROOT / "systemd" / "slurm-geo-billing-ingest.timer"


def settings(unit: Path) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in unit.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";", "[")):
            key, value = line.split("=", 1)
            found.setdefault(key.strip(), []).append(value.strip())
    return found


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_systemd_analyze_verify_accepts_service_and_timer(tmp_path):
    program = Path("/usr/local/bin/slurm-geo")
    if not program.exists():
        program = Path(sys.executable).parent / "slurm-geo"
        if not program.exists():
            pytest.skip("slurm-geo is not installed (pip install -e .)")
    for unit in (SERVICE, TIMER):
        (tmp_path / unit.name).write_text(
            unit.read_text().replace("/usr/local/bin/slurm-geo", str(program)))
    result = subprocess.run(["systemd-analyze", "verify", "--man=no",
                             str(tmp_path / SERVICE.name), str(tmp_path / TIMER.name)],
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


def test_the_service_runs_a_command_slurm_geo_accepts():
    from slurm_geo.errors import SlurmGeoError  # noqa: F401 - the package imports

    [command] = settings(SERVICE)["ExecStart"]
    argv = shlex.split(command)
    assert argv[0] == "/usr/local/bin/slurm-geo"
    run = subprocess.run([sys.executable, "-m", "slurm_geo", *argv[1:], "--help"],
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    assert "--check-budgets" in run.stdout
