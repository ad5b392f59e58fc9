"""The REST backend with slurmrestd behind TLS, as a site runs it: a stub slurmrestd (plain
HTTP, as slurmrestd speaks) behind the sandbox's TLS relay, its certificate from a test CA.
Trusted through ca_file it answers; any TLS failure is one CertificateRejected line naming
the cluster, the URL and the fix, never an outage."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from slurm_geo.config.tables import ClusterConfig
from slurm_geo.errors import ConfigError
from slurm_geo.slurm import CertificateRejected, ControllerUnreachable, connect
from slurm_geo.slurm.rest_tls import certificate_fix
from tests.kit.tls import start_relay, stop, write_tls

PING = {"pings": [{"hostname": "h", "ping": "UP", "status": 0}], "errors": []}


@dataclass
class Slurmrestd:
    port: int
    seen: list[dict[str, str]] = field(default_factory=list)


def stub_slurmrestd(seen: list[dict[str, str]]) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            seen.append({"path": self.path, **dict(self.headers)})
            doc: dict[str, Any] = ({"paths": {"/slurm/v0.0.38/ping": {}}}
                                   if self.path == "/openapi/v3" else PING)
            body = json.dumps(doc).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass
    return Handler


@pytest.fixture
def slurmrestd() -> Iterator[Slurmrestd]:
    seen: list[dict[str, str]] = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), stub_slurmrestd(seen))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield Slurmrestd(int(server.server_address[1]), seen)
    server.shutdown()
    server.server_close()


@dataclass
class Site:
    url: str
    ca_file: Path
    token_file: Path


@pytest.fixture
def site(tmp_path: Path, slurmrestd: Slurmrestd) -> Iterator[Site]:
    ca_file, cert, key = write_tls(tmp_path, ["127.0.0.1"])
    port, relay = start_relay(cert, key, slurmrestd.port)
    token_file = tmp_path / "geo.jwt"
    token_file.write_text("jwt-of-geo\n")
    token_file.chmod(0o600)
    yield Site(f"https://127.0.0.1:{port}", ca_file, token_file)
    stop(relay)


def cluster(site: Site, ca_file: Path | None) -> ClusterConfig:
    return ClusterConfig(name="rented", region="eu", access="rest", rest_url=site.url,
                         rest_user="geo", token_file=site.token_file, ca_file=ca_file,
                         timeout_s=5.0)


def rejected(client: Any) -> str:
    with pytest.raises(CertificateRejected) as raised:
        client.ping()
    assert not isinstance(raised.value, ControllerUnreachable)
    message = str(raised.value)
    assert "\n" not in message and "cluster 'rented'" in message
    return message


def test_slurmrestd_behind_tls_answers_a_client_trusting_its_ca(site, slurmrestd):
    client = connect(cluster(site, site.ca_file))
    assert client.ping() >= 0
    assert client.ping() >= 0  # on the same kept-alive connection, through the relay
    assert [s["path"] for s in slurmrestd.seen] == ["/openapi/v3", "/slurm/v0.0.38/ping",
                                                    "/slurm/v0.0.38/ping"]
    assert slurmrestd.seen[-1]["X-SLURM-USER-TOKEN"] == "jwt-of-geo"


def test_without_ca_file_the_certificate_is_refused_with_the_fix(site):
    message = rejected(connect(cluster(site, None)))
    assert f"TLS with slurmrestd at {site.url} refused" in message
    assert "self-signed certificate" in message or "local issuer" in message
    assert 'set ca_file = "PATH" in [clusters.rented]' in message


def test_the_ca_bundle_of_the_environment_does_not_override_ca_file(site, monkeypatch,
                                                                    tmp_path):
    """requests lets REQUESTS_CA_BUNDLE win over a Session's `verify`: the backend gives
    ca_file with each request, where it wins."""
    (tmp_path / "other").mkdir()
    other_ca, _, _ = write_tls(tmp_path / "other", ["127.0.0.1"])
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(other_ca))
    assert connect(cluster(site, site.ca_file)).ping() >= 0
    message = rejected(connect(cluster(site, other_ca)))
    assert f"ca_file {other_ca} does not sign it" in message


def test_a_certificate_for_another_host_says_so(tmp_path, slurmrestd, site):
    (tmp_path / "elsewhere").mkdir()
    ca_file, cert, key = write_tls(tmp_path / "elsewhere", ["10.77.2.2"])
    port, relay = start_relay(cert, key, slurmrestd.port)
    try:
        message = rejected(connect(cluster(Site(f"https://127.0.0.1:{port}", ca_file,
                                                site.token_file), ca_file)))
    finally:
        stop(relay)
    assert "mismatch" in message and "not for the host in rest_url" in message


def test_https_to_a_slurmrestd_without_tls_says_to_check_the_proxy(site, slurmrestd):
    plain = Site(f"https://127.0.0.1:{slurmrestd.port}", site.ca_file, site.token_file)
    message = rejected(connect(cluster(plain, site.ca_file)))
    assert "slurmrestd speaks no TLS itself" in message


@pytest.mark.parametrize("content, says", [
    (None, "cannot read it (No such file or directory)"),
    ("not a certificate\n", "not a PEM CA certificate (no PEM certificate in it)"),
    ("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
     "not a PEM CA certificate"),
], ids=["missing", "not PEM", "broken PEM"])
def test_an_unusable_ca_file_is_one_config_error_line_at_connect(site, tmp_path, content,
                                                                  says):
    ca_file = tmp_path / "site-ca.pem"
    if content is not None:
        ca_file.write_text(content)
    with pytest.raises(ConfigError) as raised:
        connect(cluster(site, ca_file))
    message = str(raised.value)
    assert "\n" not in message and f"[clusters.rented] ca_file {ca_file}: {says}" in message
    assert "the CA that signs slurmrestd's certificate" in message


@pytest.mark.parametrize("problem, ca_file, fix", [
    ("certificate verify failed: self-signed certificate in certificate chain", None,
     "set ca_file"),
    ("certificate verify failed: unable to get local issuer certificate", Path("/ca.pem"),
     "ca_file /ca.pem does not sign it"),
    ("certificate verify failed: IP address mismatch, certificate is not valid for "
     "'127.0.0.1'.", Path("/ca.pem"), "not for the host in rest_url"),
    ("certificate verify failed: certificate has expired", None, "reissue"),
    ("WRONG_VERSION_NUMBER", None, "the TLS proxy in front of slurmrestd"),
], ids=["no ca_file", "another CA", "another host", "expired", "no TLS there"])
def test_each_tls_failure_gets_its_fix(problem, ca_file, fix):
    assert fix in certificate_fix("rented", problem, ca_file)
