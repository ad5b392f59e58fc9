"""The replicas' etcd client over https to a real member that asks for client
certificates, as the sandbox's members and docs/install.md's do: it verifies with the
configured CA whatever the environment says, and without the client certificate is let in
nowhere."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from cryptography.x509.oid import ExtendedKeyUsageOID

from slurm_geo.ckpt.format.keys import KeyFile
from slurm_geo.federation.model import StateUnavailable
from slurm_geo.federation.state.etcd.kv import ABSENT, EtcdKV, EtcdTLS
from slurm_geo.sandbox import certs
from tests.etcd_server import ETCD, MASTER_KEY, TIMING, free_port, require_etcd
from tests.helpers import eventually


@pytest.fixture
def member(tmp_path: Path) -> Iterator[tuple[str, EtcdTLS]]:
    require_etcd()
    now = datetime.now(UTC)
    ca = certs.make_ca("test CA", now)
    server = certs.issue_server(ca, ["127.0.0.1"], now, usages=certs.MEMBER_USAGES)
    client = certs.issue_server(ca, [certs.ETCD_CLIENT_NAME], now,
                                usages=(ExtendedKeyUsageOID.CLIENT_AUTH,))
    files = {"ca.pem": ca.cert_pem, "server.pem": server.cert_pem, "server.key": server.key_pem,
             "client.pem": client.cert_pem, "client.key": client.key_pem}
    for name, pem in files.items():
        (tmp_path / name).write_bytes(pem)
        (tmp_path / name).chmod(0o600)
    url, peer = (f"https://127.0.0.1:{free_port()}" for _ in range(2))
    log = open(tmp_path / "etcd.log", "wb")  # noqa: SIM115 (the process keeps it)
    process = subprocess.Popen(
        [str(ETCD), "--name", "tls", "--data-dir", str(tmp_path / "data"),
         "--listen-client-urls", url, "--advertise-client-urls", url,
         "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
         "--initial-cluster", f"tls={peer}", *TIMING,
         "--cert-file", str(tmp_path / "server.pem"), "--key-file", str(tmp_path / "server.key"),
         "--client-cert-auth", "--trusted-ca-file", str(tmp_path / "ca.pem"),
         "--peer-cert-file", str(tmp_path / "server.pem"),
         "--peer-key-file", str(tmp_path / "server.key"), "--peer-client-cert-auth",
         "--peer-trusted-ca-file", str(tmp_path / "ca.pem")],
        stdout=log, stderr=subprocess.STDOUT)
    log.close()
    tls = EtcdTLS(tmp_path / "ca.pem", tmp_path / "client.pem", tmp_path / "client.key")
    try:
        yield url, tls
    finally:
        process.terminate()
        process.wait(10)


def test_the_configured_ca_verifies_the_member_even_with_requests_ca_bundle_set(
        member, monkeypatch):
    url, tls = member
    # Debian's bundle, as many hosts export it: requests would let it replace our CA.
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", "/etc/ssl/certs/ca-certificates.crt")
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")  # nothing there: not used
    kv = EtcdKV([url], KeyFile(MASTER_KEY), tls=tls)

    def put_and_read() -> bytes | None:
        try:
            found = kv.get_sealed("k")
            kv.commit([], [kv.put("k", b"v", at=ABSENT if found is None else found.at)], [])
        except StateUnavailable:
            return None
        found = kv.get("k")
        return None if found is None else found.value

    assert eventually(put_and_read, lambda value: value == b"v", timeout_s=20,
                      interval_s=0.2) == b"v"
    kv.close()


def test_without_the_client_certificate_the_member_lets_nobody_in(member):
    url, tls = member
    with_cert = EtcdKV([url], KeyFile(MASTER_KEY), tls=tls)
    eventually(lambda: _answers(with_cert), bool, timeout_s=20, interval_s=0.2)
    without = EtcdKV([url], KeyFile(MASTER_KEY), tls=EtcdTLS(tls.ca_file))
    with pytest.raises(StateUnavailable):
        without.get("k")
    for kv in (with_cert, without):
        kv.close()


def _answers(kv: EtcdKV) -> bool:
    try:
        kv.get("anything")
    except StateUnavailable:
        return False
    return True
