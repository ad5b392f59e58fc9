"""`sandbox up` after a code change: the daemons running from the site Python are started
again on the new slurm_geo; nothing else is touched."""

from __future__ import annotations

from slurm_geo.sandbox.layout import SandboxLayout
from slurm_geo.sandbox.lifecycle import _stop_old_code
from slurm_geo.sandbox.processes import Daemon


class Table:
    def __init__(self, running: set[str]):
        self.running = set(running)
        self.stopped: list[str] = []

    def running_pid(self, name):
        return 1 if name in self.running else None

    def stop(self, name):
        self.stopped.append(name)
        self.running.discard(name)


def test_only_running_daemons_of_the_site_python_are_stopped_last_stage_first(tmp_path):
    layout = SandboxLayout(tmp_path)
    python = str(layout.site_python)
    stages = [[Daemon("munged", ["munged"]), Daemon("relay", [python, "-I", "-m", "x"])],
              [Daemon("slurmctld", ["slurmctld"])],
              [Daemon("checkpoint-sync", [python, "-I", "-m", "y"]),
               Daemon("federation", [python, "-I", "-m", "z"])]]
    table = Table({"munged", "relay", "slurmctld", "federation"})
    said: list[str] = []
    _stop_old_code(layout, table, stages, said.append)
    assert table.stopped == ["federation", "relay"]  # checkpoint-sync was not running
    assert table.running == {"munged", "slurmctld"}
    assert said == ["restarting federation (slurm_geo changed)",
                    "restarting relay (slurm_geo changed)"]


def test_a_daemon_inherits_the_search_path_and_locale_of_whoever_ran_up_and_nothing_else():
    from slurm_geo.sandbox.processes import DEFAULT_PATH, daemon_environment

    shell = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PWD": "/work/main",
             "AWS_SECRET_ACCESS_KEY": "x", "PYTHONPATH": "/home/alice", "HOME": "/root"}
    assert daemon_environment(shell) == {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    assert daemon_environment({}) == {"PATH": DEFAULT_PATH}
