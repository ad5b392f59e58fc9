"""The sandbox's pid files name their daemon through its execs and never a stranger."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from slurm_geo.sandbox.processes import MARKER_ENV, Daemon, ProcessTable, start_ticks

# Three execs, as a daemon in a site has (nsenter, setpriv, the daemon itself).
EXEC_CHAIN = ["env", "sh", "-c", f"exec {sys.executable} -c 'import time; time.sleep(3)'"]


def test_a_daemon_reads_as_running_from_its_start_through_its_execs(tmp_path):
    table = ProcessTable(tmp_path)
    missed = 0
    for n in range(20):
        name = f"chain-{n}"
        table.start(Daemon(name, EXEC_CHAIN))
        began = time.monotonic()
        while time.monotonic() - began < 0.1:
            missed += table.running_pid(name) is None
        table.stop(name, grace_s=1)
    assert missed == 0


def test_a_pid_file_whose_pid_now_names_another_process_reads_as_stopped(tmp_path):
    table = ProcessTable(tmp_path)
    table.start(Daemon("old", EXEC_CHAIN))
    pid = table.running_pid("old")
    table.stop("old", grace_s=1)
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"],
                                env={MARKER_ENV: str(tmp_path)})
    try:
        table.run_dir.mkdir(exist_ok=True)
        stale_start = psutil.Process(stranger.pid).create_time() - 60
        table.pid_file("old").write_text(f"{stranger.pid} {stale_start!r}\n")
        assert pid is not None
        assert table.running_pid("old") is None
    finally:
        stranger.kill()
        stranger.wait()


def test_a_pid_file_without_a_start_time_is_still_honoured_by_the_marker(tmp_path):
    table = ProcessTable(tmp_path)
    table.start(Daemon("older", EXEC_CHAIN))
    pid = table.running_pid("older")
    time.sleep(0.2)  # past its execs
    table.pid_file("older").write_text(f"{pid}\n")
    try:
        assert table.running_pid("older") == pid
    finally:
        table.stop("older", grace_s=1)
    assert table.running_pid("older") is None


def test_a_running_daemon_still_reads_as_running_after_the_wall_clock_is_stepped(tmp_path):
    """NTP stepping the clock moves every process's wall-clock start time (psutil's
    create_time counts from a boot time derived from the wall clock): the table names its
    daemons by their start in ticks since boot, which no clock moves."""
    table = ProcessTable(tmp_path)
    table.start(Daemon("steady", EXEC_CHAIN))
    try:
        pid, started, ticks = table.pid_file("steady").read_text().split()
        assert int(ticks) == start_ticks(int(pid))
        stepped = float(started) + 3600.0  # as if the clock was stepped an hour since
        table.pid_file("steady").write_text(f"{pid} {stepped!r} {ticks}\n")
        assert table.running_pid("steady") == int(pid)
    finally:
        table.stop("steady", grace_s=1)
    assert table.running_pid("steady") is None


def test_a_pid_file_whose_pid_started_at_another_tick_reads_as_stopped(tmp_path):
    table = ProcessTable(tmp_path)
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"],
                                env={MARKER_ENV: str(tmp_path)})
    try:
        table.run_dir.mkdir(exist_ok=True)
        started = psutil.Process(stranger.pid).create_time()
        ticks = start_ticks(stranger.pid)
        assert ticks is not None
        table.pid_file("old").write_text(f"{stranger.pid} {started!r} {ticks - 1}\n")
        assert table.running_pid("old") is None
        table.pid_file("old").write_text(f"{stranger.pid} {started!r} {ticks}\n")
        assert table.running_pid("old") == stranger.pid
    finally:
        stranger.kill()
        stranger.wait()


def test_start_ticks_reads_a_command_name_with_spaces_and_parentheses(tmp_path):
    odd = tmp_path / "a (b) c"
    odd.symlink_to("/bin/sleep")
    proc = subprocess.Popen([str(odd), "3"])
    try:
        ticks = start_ticks(proc.pid)
        assert ticks is not None and ticks > 0
    finally:
        proc.kill()
        proc.wait()
    assert start_ticks(proc.pid) is None
