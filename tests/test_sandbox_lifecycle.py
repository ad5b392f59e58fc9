"""`slurm-geo sandbox up|status|env|down` on a second, throw-away sandbox of its own."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from slurm_geo.ckpt.stores.s3store import S3Store, S3Unavailable, make_s3_client
from slurm_geo.cli import main
from slurm_geo.errors import SandboxError
from slurm_geo.sandbox import Sandbox
from slurm_geo.sandbox.layout import S3_BUCKET, S3_PREFIX
from slurm_geo.sandbox.processes import Daemon, has_marker
from slurm_geo.sandbox.sites import Site
from tests.helpers import eventually

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

PORT_BASE = 17800


def slurm_geo(*args: str):
    return subprocess.run([sys.executable, "-m", "slurm_geo", *args], capture_output=True,
                          text=True, timeout=300, check=False)


def read_or_none(store: S3Store, name: str) -> bytes | None:
    try:
        return store.get(name)
    except S3Unavailable as exc:
        if exc.permanent:
            raise
        return None


def succeeded(*args: str) -> bool:
    result = slurm_geo(*args)
    assert result.returncode == 0, result.stderr
    return True


def marked(root: Path) -> list[int]:
    return [pid for pid in psutil.pids() if has_marker(pid, root)]


@pytest.fixture(scope="module")
def throwaway():
    # Not under tmp_path: slurmrestd runs as nobody and must reach the config files.
    root = Path(f"/var/tmp/slurm-geo-lifecycle-{os.getpid()}")
    yield root
    Sandbox(root).down(purge=True)


def test_up_twice_env_down_and_up_again(throwaway):
    """One throw-away sandbox through its whole life (each `up` costs ~15 s): a second `up`
    restarts nothing; `down` ends what the daemons spawned too, removes the sites and
    leaves nothing listening or routed; the S3 server's objects survive to the next `up`."""
    first = slurm_geo("sandbox", "up", "--dir", str(throwaway), "--port-base", str(PORT_BASE))
    assert first.returncode == 0, first.stderr
    pids = {row["name"]: row["pid"] for row in status(throwaway)}
    box = Sandbox(throwaway)
    offsite = S3Store(S3_BUCKET, S3_PREFIX, make_s3_client(
        box.layout.s3_endpoint, "us-east-1", access_key_id=box.s3_env()["AWS_ACCESS_KEY_ID"],
        secret_access_key=box.s3_env()["AWS_SECRET_ACCESS_KEY"],
        ca_file=box.s3_env()["AWS_CA_BUNDLE"]))
    offsite.put("keys/kept", b"written before down")

    again = slurm_geo("sandbox", "up", "--dir", str(throwaway))
    assert again.returncode == 0, again.stderr
    assert "starting" not in again.stderr
    rows = status(throwaway)
    assert {row["name"]: row["pid"] for row in rows} == pids
    assert all(row["up"] for row in rows)

    env = slurm_geo("sandbox", "env", "--dir", str(throwaway), "onprem").stdout
    nodes = subprocess.run(["bash", "-c", f"{env}\nsinfo --noheader --format=%D "
                            "--partition=batch"], capture_output=True, text=True, timeout=30)
    assert nodes.stdout.strip() == "2"
    daemons = set(marked(throwaway))
    subprocess.run(["bash", "-c", f"{env}\nsbatch --wrap 'sleep 600'"], check=True,
                   capture_output=True, timeout=30)
    eventually(lambda: set(marked(throwaway)) - daemons, bool)  # slurmstepd is up

    down = slurm_geo("sandbox", "down", "--dir", str(throwaway))
    assert down.returncode == 0, down.stderr
    assert marked(throwaway) == []
    assert not any(row["up"] for row in status(throwaway, expect_rc=1))
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                check=True).stdout
    assert box.layout.network_prefix not in namespaces
    home, remote = box.layout.address(Site.HOME), box.layout.address(Site.REMOTE)
    # The sites are gone, and with them every daemon's address: nothing answers there,
    # and nothing addressed there leaves the machine (the range's blackhole route).
    for host, port in ((home, PORT_BASE + 10), (remote, PORT_BASE + 25),
                       ("127.0.0.1", PORT_BASE + 30), (remote, PORT_BASE + 40)):
        with socket.socket() as sock:
            sock.settimeout(2)
            assert sock.connect_ex((host, port)) != 0, f"{host}:{port} still open"
    route = subprocess.run(["ip", "route", "get", home], capture_output=True, text=True,
                           check=False)
    assert route.returncode != 0 or "blackhole" in route.stdout or "unreachable" in \
        route.stdout, route.stdout

    assert succeeded("sandbox", "up", "--dir", str(throwaway))
    # Right after a start the S3 server may answer 500 until its volumes are registered.
    assert eventually(lambda: read_or_none(offsite, "keys/kept"), bool, 30) == \
        b"written before down"
    offsite.delete("keys/kept")
    assert succeeded("sandbox", "down", "--dir", str(throwaway))


def status(root: Path, expect_rc: int = 0) -> list[dict]:
    result = slurm_geo("sandbox", "status", "--json", "--dir", str(root))
    assert result.returncode == expect_rc, result.stderr
    return json.loads(result.stdout)


def test_busy_port_is_one_clear_line(tmp_path):
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", 18830))  # MariaDB's, in the machine's namespace
        squatter.listen()
        root = Path("/var/tmp") / f"slurm-geo-busy-{os.getpid()}"
        try:
            result = slurm_geo("sandbox", "up", "--dir", str(root), "--port-base", "18800")
        finally:
            Sandbox(root).down(purge=True)

    assert result.returncode == 4
    assert result.stderr.count("\n") == 1
    assert "port 18830" in result.stderr and "in use" in result.stderr
    assert "Traceback" not in result.stderr


def test_up_without_root_says_so(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(sys, "argv", ["slurm-geo", "sandbox", "up", "--dir", "/nonexistent"])

    with pytest.raises(SystemExit) as exited:
        main()

    assert exited.value.code == 4
    err = capsys.readouterr().err
    assert "must run as root" in err and "Traceback" not in err
    assert not Path("/nonexistent").exists()


HANGS_ON_FIRST_START = """
import pathlib, sys, time
seen = pathlib.Path(sys.argv[1])
if seen.exists():
    pathlib.Path(sys.argv[2]).touch()
else:
    seen.touch()
time.sleep(600)
"""


@pytest.mark.parametrize("second_start_comes_up", [True, False])
def test_daemon_hung_at_start_is_started_once_more(tmp_path, monkeypatch,
                                                   second_start_comes_up):
    monkeypatch.setattr("slurm_geo.sandbox.lifecycle.STAGE_TIMEOUT_S", 1)
    ready = tmp_path / ("ready" if second_start_comes_up else "never-made/ready")
    daemon = Daemon("toy", [sys.executable, "-c", HANGS_ON_FIRST_START, str(tmp_path / "seen"),
                            str(ready)], ready_path=ready)
    sandbox = Sandbox(tmp_path / "sandbox")
    messages: list[str] = []
    try:
        if second_start_comes_up:
            sandbox._start_stage([daemon], messages.append)
            assert ready.exists()
        else:
            with pytest.raises(SandboxError, match="toy exited before it answered, started twice"):
                sandbox._start_stage([daemon], messages.append)
    finally:
        sandbox.processes.stop_all([["toy"]], grace_s=1)

    assert sum("not answering" in m for m in messages) == 1
    assert "hung at start; its threads wait in" in sandbox.processes.log_file("toy").read_text()
