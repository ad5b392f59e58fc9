"""A TLS relay in front of a test's HTTP server, with a CA and a certificate of its own
(the REST and relay tests use it)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from slurm_geo.sandbox.certs import Issued, issue_server, make_ca

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def write_tls(tmp_path: Path, hosts: list[str]) -> tuple[Path, Path, Path]:
    ca = make_ca("test CA", datetime.now(UTC))
    server: Issued = issue_server(ca, hosts, datetime.now(UTC))
    paths = tmp_path / "ca.pem", tmp_path / "relay.pem", tmp_path / "relay.key"
    for path, pem in zip(paths, (ca.cert_pem, server.cert_pem, server.key_pem), strict=True):
        path.write_bytes(pem)
    paths[2].chmod(0o600)
    return paths


def start_relay(cert: Path, key: Path, upstream: int,
                *extra: str) -> tuple[int, subprocess.Popen[bytes]]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "slurm_geo.sandbox.tls_relay", "--listen", f"127.0.0.1:{port}",
         "--to", f"127.0.0.1:{upstream}", "--cert", str(cert), "--key", str(key), *extra],
        env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return port, process
        except OSError:
            assert process.poll() is None, process.communicate()[1].decode()
            time.sleep(0.05)
    process.kill()
    raise AssertionError("the relay did not listen within 10 s")


def stop(process: subprocess.Popen[bytes]) -> tuple[int, str]:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        _, err = process.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    return process.returncode, err.decode()
