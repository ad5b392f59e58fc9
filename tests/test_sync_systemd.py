"""The unit files: `systemd-analyze verify` accepts each one, and checkpoint-sync's unit is
hardened and runs the command line the sandbox runs."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from systemd_units import installed_here, settings

from slurm_geo.sandbox.render import SYNC_PROGRAM, sync_argv
from slurm_geo.site import UNITS as SHIPPED_UNITS

ROOT = Path(__file__).resolve().parent.parent
UNITS = sorted(SHIPPED_UNITS.glob("*.service"))
SYNC_UNIT = SHIPPED_UNITS / "slurm-geo-checkpoint-sync.service"
INSTALLED = Path("/usr/local/bin") / SYNC_PROGRAM


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
@pytest.mark.parametrize("unit", UNITS, ids=[u.name for u in UNITS])
def test_systemd_analyze_verify_accepts_the_unit(unit, tmp_path):
    # --man=no: Documentation= may name pages this host lacks. No running systemd needed.
    result = subprocess.run(["systemd-analyze", "verify", "--man=no",
                             str(installed_here(unit, tmp_path))],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == ""


def test_there_is_a_unit_to_verify():
    assert SYNC_UNIT in UNITS


@pytest.mark.parametrize("key, value", [
    ("Type", "notify"), ("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"),
    ("PrivateTmp", "yes"), ("Restart", "on-failure"), ("ReadWritePaths", "/var/lib/slurm-geo"),
    ("IOSchedulingClass", "idle"),
])
def test_the_sync_unit_is_hardened_and_out_of_trainings_way(key, value):
    assert value in settings(SYNC_UNIT)[key]


def test_watchdog_and_stop_timeouts_leave_room_for_the_daemon():
    from slurm_geo.sync.daemon import STOP_GRACE_S

    unit = settings(SYNC_UNIT)
    assert int(unit["WatchdogSec"][0].rstrip("s")) >= 30
    assert int(unit["TimeoutStopSec"][0].rstrip("s")) > STOP_GRACE_S
    assert unit["ExecReload"] == ["/bin/kill -HUP $MAINPID"]


def test_the_sandbox_runs_the_units_command_line():
    [exec_start] = settings(SYNC_UNIT)["ExecStart"]
    argv = shlex.split(exec_start)
    assert argv[0] == str(INSTALLED)
    assert sync_argv(argv[0], Path("/etc/slurm-geo/config.toml")) == argv
