"""Two `slurm-geo-federation` processes, replicas on one real etcd, as systemd runs them:
one leads, the other redirects; SIGTERM to the leader makes it resign on its way out, and
the other leads at its next campaign (measured, printed). Started and stopped by pid."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.etcd_server import MASTER_KEY, EtcdMember, fresh_prefix
from tests.helpers import eventually
from tests.replica_site import LEADER_TTL_S, SITES, free_port, process_config, says

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def daemons(tmp_path: Path, etcd: EtcdMember
            ) -> Iterator[tuple[dict[str, subprocess.Popen[bytes]], dict[str, int]]]:
    key = tmp_path / "master.key"
    key.write_bytes(MASTER_KEY)
    key.chmod(0o600)
    prefix, ports = fresh_prefix(), {name: free_port() for name in SITES}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("NOTIFY_SOCKET", None)
    started: dict[str, subprocess.Popen[bytes]] = {}
    for name in SITES:
        log = open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115 (the process keeps it)
        started[name] = subprocess.Popen(
            [sys.executable, "-m", "slurm_geo.federation.daemon.entry", "--config",
             str(process_config(tmp_path, etcd.client_url, prefix, ports, name))],
            stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
    yield started, ports
    for process in started.values():
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(10)


@pytest.mark.slow
def test_sigterm_to_the_leading_daemon_hands_the_lead_to_the_other(daemons, tmp_path):
    processes, ports = daemons
    answers = eventually(lambda: {name: says(port) for name, port in ports.items()},
                         lambda a: all(a.values()) and any(v["leading"] for v in a.values()),
                         timeout_s=30, interval_s=0.1)
    (leader,) = [name for name, said in answers.items() if said["leading"]]
    other = next(name for name in SITES if name != leader)
    assert answers[other]["leader"]["name"] == leader and not answers[other]["leading"]
    log = tmp_path / f"{leader}.log"
    eventually(log.read_text, lambda text: "event=leading" in text, timeout_s=10,
               interval_s=0.1)  # its first round as leader
    os.kill(processes[leader].pid, signal.SIGTERM)
    stopped = time.monotonic()
    assert processes[leader].wait(30) == 0
    eventually(lambda: says(ports[other]), lambda a: a is not None and a["leading"],
               timeout_s=4 * LEADER_TTL_S, interval_s=0.05)
    print(f"\n{other} leads {time.monotonic() - stopped:.2f} s after SIGTERM to {leader} "
          f"(leader_ttl_s {LEADER_TTL_S}; it resigned on its way out)")
    said = log.read_text()
    assert "event=stopped" in said and "Traceback" not in said
    eventually((tmp_path / f"{other}.log").read_text, lambda text: "event=leading" in text,
               timeout_s=10, interval_s=0.1)  # and it decides: its first round as leader
