"""The sandbox's TLS relay in front of a plain HTTP server, as it stands in front of
slurmrestd: run as its own process, with a certificate from a test CA."""

from __future__ import annotations

import http.server
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from tests.helpers import eventually
from tests.kit.tls import REPO, free_port, start_relay, stop, write_tls


class Hello(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as slurmrestd

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = f"hello {self.path} on {self.client_address[1]}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


@dataclass
class Relay:
    url: str
    port: int
    ca_file: Path
    process: subprocess.Popen[bytes]


@pytest.fixture
def backend() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hello)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()


@pytest.fixture
def relay(tmp_path: Path, backend: int) -> Iterator[Relay]:
    ca_file, cert, key = write_tls(tmp_path, ["127.0.0.1"])
    port, process = start_relay(cert, key, backend, "--handshake-timeout", "1")
    yield Relay(f"https://127.0.0.1:{port}", port, ca_file, process)
    stop(process)


def test_a_client_that_trusts_the_ca_gets_the_answer_through_the_relay(relay):
    answer = requests.get(f"{relay.url}/slurm/v0.0.38/ping", verify=relay.ca_file, timeout=5)
    assert answer.status_code == 200 and answer.text.startswith("hello /slurm/v0.0.38/ping")


def test_two_requests_on_one_session_share_one_kept_alive_connection(relay):
    with requests.Session() as session:
        first = session.get(f"{relay.url}/a", verify=relay.ca_file, timeout=5).text
        second = session.get(f"{relay.url}/b", verify=relay.ca_file, timeout=5).text
    # The relay opens one upstream connection per client connection: one source port.
    assert first.split(" on ")[1] == second.split(" on ")[1]
    assert first.startswith("hello /a") and second.startswith("hello /b")


def test_a_client_without_the_ca_refuses_the_relays_certificate(relay):
    with pytest.raises(requests.exceptions.SSLError, match="certificate verify failed"):
        requests.get(relay.url, timeout=5)
    code, err = stop(relay.process)
    assert code == 0 and "TLS handshake failed" in err and err.count("\n") == 1


def test_plain_http_to_the_tls_port_gets_no_answer(relay):
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.get(f"http://127.0.0.1:{relay.port}/", timeout=5)
    assert "spoke plain HTTP to the TLS port" in stop(relay.process)[1]


def test_an_upstream_that_is_down_closes_the_client_and_says_so(tmp_path):
    ca_file, cert, key = write_tls(tmp_path, ["127.0.0.1"])
    port, process = start_relay(cert, key, free_port())
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.get(f"https://127.0.0.1:{port}/", verify=ca_file, timeout=5)
    code, err = stop(process)
    assert code == 0 and "cannot reach 127.0.0.1:" in err and "Connection refused" in err


def test_a_client_that_never_starts_tls_is_dropped_after_the_handshake_timeout(relay):
    with socket.create_connection(("127.0.0.1", relay.port), timeout=5) as idle:
        began = time.monotonic()
        assert idle.recv(1) == b""  # closed by the relay
    assert time.monotonic() - began < 4
    assert "TLS handshake failed" in stop(relay.process)[1]


def test_connections_beyond_the_limit_are_closed_at_accept(tmp_path, backend):
    ca_file, cert, key = write_tls(tmp_path, ["127.0.0.1"])
    port, process = start_relay(cert, key, backend, "--max-connections", "1")
    context = ssl.create_default_context(cafile=str(ca_file))

    def connected() -> ssl.SSLSocket | None:
        """A TLS connection, once the relay has let go of start_relay's readiness probe
        (it counts as open until the relay sees it closed)."""
        plain = socket.create_connection(("127.0.0.1", port), timeout=5)
        try:
            return context.wrap_socket(plain, server_hostname="127.0.0.1")
        except (ConnectionResetError, ssl.SSLEOFError):  # how the close reads depends on timing
            plain.close()
            return None

    with eventually(connected, lambda tls: tls is not None, 10):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as second:
            with pytest.raises(OSError):
                context.wrap_socket(second, server_hostname="127.0.0.1")
    code, err = stop(process)
    assert code == 0 and "1 connections already open" in err


def test_the_relay_exits_0_on_sigterm_with_a_connection_open(relay):
    with requests.Session() as session:
        session.get(relay.url, verify=relay.ca_file, timeout=5)  # left open in the pool
        code, err = stop(relay.process)
    assert (code, err) == (0, "")


def test_an_unusable_certificate_is_one_line_and_exit_2(tmp_path, backend):
    (tmp_path / "bad.pem").write_text("not a certificate\n")
    process = subprocess.run(
        [sys.executable, "-m", "slurm_geo.sandbox.tls_relay", "--listen", "127.0.0.1:1",
         "--to", f"127.0.0.1:{backend}", "--cert", str(tmp_path / "bad.pem"),
         "--key", str(tmp_path / "bad.pem")],
        env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, timeout=30)
    said = process.stderr.decode()
    assert process.returncode == 2 and said.count("\n") == 1 and "cannot load --cert" in said
