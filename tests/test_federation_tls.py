"""The lease and key service over https with a site CA made as the sandbox makes its own:
a lease granted to a job that trusts the CA, refused by one trusting another, nothing for
plain http on the TLS port; the daemon's key and CA files checked at start; the CA handed
to a job the daemon submits elsewhere."""

from __future__ import annotations

import socket
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pytest
from lease_site import free_port, start

from slurm_geo.ckpt.format.keys import create_master_key_file
from slurm_geo.errors import ConfigError
from slurm_geo.federation.access.tls import ca_pem, server_context
from slurm_geo.federation.act.resubmit import Incoming, ScriptOptions, resubmission
from slurm_geo.federation.daemon import entry
from slurm_geo.lease.client import FederatedRun, FederationUnreachable, post, tls_context
from slurm_geo.lease.protocol import (
    ENV_FEDERATION_CA,
    ENV_FEDERATION_URL,
    ENV_LEASE_SECRET,
    LEASE_PATH,
    LeaseRequest,
)
from slurm_geo.sandbox.certs import Issued, issue_server, make_ca
from tests.kit.federation import Site, lose_home
from tests.kit.site import cluster, write_site

LEASE = LeaseRequest("run-a", "rented", 77, 0, 1, None).to_json()


def write_pair(directory: Path, name: str, issued: Issued) -> tuple[Path, Path]:
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    cert.write_bytes(issued.cert_pem)
    key.write_bytes(issued.key_pem)
    key.chmod(0o600)
    return cert, key


@pytest.fixture(scope="module")
def site_ca() -> Issued:
    return make_ca("test site CA", datetime.now(UTC))


@pytest.fixture
def https_site(tmp_path, site_ca):
    server = issue_server(site_ca, ["127.0.0.1", "localhost"], datetime.now(UTC))
    cert, key = write_pair(tmp_path, "federation", server)
    site = start(tmp_path, tls=server_context(cert, key))
    yield site
    site.close()


def test_a_job_trusting_the_site_ca_gets_its_lease_over_https(https_site, site_ca):
    assert https_site.url.startswith("https://127.0.0.1:")
    run = FederatedRun(https_site.placement(ca=site_ca.cert_pem.decode()))
    run.acquire(give_up_after_s=10)
    assert run.may_train()
    run.release(None)
    assert [e.kind for e in https_site.entries("lease")] == ["lease"]


def test_a_job_trusting_another_ca_refuses_the_daemon(https_site):
    other = make_ca("someone else's CA", datetime.now(UTC))
    answer = post(https_site.url + LEASE_PATH, *https_site.signed(LEASE_PATH, LEASE),
                  tls_context(other.cert_pem.decode()))
    assert answer.status is None and "CERTIFICATE_VERIFY_FAILED" in answer.body["reason"]
    run = FederatedRun(https_site.placement(ca=other.cert_pem.decode()))
    with pytest.raises(FederationUnreachable):
        run.acquire(give_up_after_s=0.5)
    assert https_site.entries("lease") == []


def test_plain_http_to_the_tls_port_gets_nothing_and_the_service_goes_on(https_site, site_ca):
    plain = https_site.url.replace("https://", "http://")
    answer = post(plain + LEASE_PATH, *https_site.signed(LEASE_PATH, LEASE))
    assert answer.status is None, answer.body
    assert post(https_site.url + LEASE_PATH, *https_site.signed(LEASE_PATH, LEASE),
                tls_context(site_ca.cert_pem.decode())).status == 200


def test_a_tls_client_that_never_finishes_its_handshake_holds_no_worker(https_site, site_ca):
    host, port = https_site.server.server_address[:2]
    stalled = [socket.create_connection((host, port)) for _ in range(20)]
    try:
        for sock in stalled:
            sock.sendall(b"\x16\x03\x01")  # the first bytes of a ClientHello, then nothing
        assert post(https_site.url + LEASE_PATH, *https_site.signed(LEASE_PATH, LEASE),
                    tls_context(site_ca.cert_pem.decode())).status == 200
    finally:
        for sock in stalled:
            sock.close()


def test_a_tls_key_others_may_read_is_refused_in_one_line(tmp_path, site_ca):
    cert, key = write_pair(tmp_path, "federation",
                           issue_server(site_ca, ["127.0.0.1"], datetime.now(UTC)))
    key.chmod(0o640)
    with pytest.raises(ConfigError) as error:
        server_context(cert, key)
    assert str(error.value) == f"[federation] tls_key {key}: mode 0640 lets others in; " \
        "chmod 600 it"


def test_a_certificate_that_does_not_load_is_named(tmp_path, site_ca):
    cert, key = write_pair(tmp_path, "federation",
                           issue_server(site_ca, ["127.0.0.1"], datetime.now(UTC)))
    cert.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match=r"tls_cert .* cannot load them"):
        server_context(cert, key)
    with pytest.raises(ConfigError, match="cannot read it"):
        server_context(cert, tmp_path / "absent.key")


def test_the_ca_file_must_hold_a_pem_certificate(tmp_path, site_ca):
    good = tmp_path / "ca.pem"
    good.write_bytes(site_ca.cert_pem)
    assert ca_pem(good) == site_ca.cert_pem.decode()
    bad = tmp_path / "bad.pem"
    bad.write_text("hello\n")
    with pytest.raises(ConfigError, match=r"ca_file .*bad.pem: not a PEM CA certificate"):
        ca_pem(bad)
    with pytest.raises(ConfigError, match="cannot read it"):
        ca_pem(tmp_path / "absent.pem")


def test_a_job_submitted_elsewhere_is_told_the_ca(site_ca):
    pem = site_ca.cert_pem.decode()
    incoming = Incoming("onprem-9", 1, "run-a", None, "https://fed.example:9852", "t",
                        "file:///x", federation_ca=pem, lease_secret="5e" * 32)
    spec = resubmission("#!/bin/bash\ntrue\n", ScriptOptions(), incoming, ())
    assert spec.environment[ENV_FEDERATION_CA] == pem
    env = {"SLURM_CLUSTER_NAME": "rented", "SLURM_JOB_ID": "7", **spec.environment}
    run = FederatedRun.from_environment("run-a", env)
    assert (run.placement.federation_ca, run.placement.lease_secret) == (pem, "5e" * 32)
    without = Incoming("onprem-9", 1, "run-a", None, "http://127.0.0.1:9852", "t", "file:///x")
    assert ENV_FEDERATION_CA not in resubmission("#!/bin/bash\n", ScriptOptions(), without,
                                                 ()).environment


def test_a_job_the_daemon_moves_is_told_the_site_ca(tmp_path, site_ca):
    site = Site(tmp_path)
    ca = tmp_path / "site-ca.pem"
    ca.write_bytes(site_ca.cert_pem)
    assert site.config.federation is not None
    federation = replace(site.config.federation, ca_file=ca,
                         public_url="https://fed.example:9852")
    site.config = replace(site.config, federation=federation)
    site.restart()
    site.home_job_training()
    site.checkpoint("away", 20)
    lose_home(site)
    site.tick()
    (_, spec), = site.rented.submitted
    assert spec.environment[ENV_FEDERATION_CA] == site_ca.cert_pem.decode()
    assert spec.environment[ENV_FEDERATION_URL] == "https://fed.example:9852"
    # Beside the CA, the secret it signs with: the one the daemon stored for generation 1.
    logical = site.state.jobs()[0].logical_job
    assert spec.environment[ENV_LEASE_SECRET] == site.state.identities.secret(logical, 1)


def test_a_ca_that_is_not_pem_stops_the_job_with_one_line():
    env = {"SLURM_CLUSTER_NAME": "rented", "SLURM_JOB_ID": "7", "SLURM_GEO_GENERATION": "1",
           "SLURM_GEO_FEDERATION_URL": "https://fed.example", "SLURM_GEO_STORE": "file:///x",
           "SLURM_GEO_KEY_TOKEN": "t", "SLURM_GEO_LOGICAL_JOB": "onprem-9",
           "SLURM_GEO_LEASE_SECRET": "5e" * 32, ENV_FEDERATION_CA: "garbage"}
    with pytest.raises(ConfigError, match="SLURM_GEO_FEDERATION_CA .* is not a PEM"):
        FederatedRun.from_environment("run-a", env)


def test_the_daemon_will_not_start_with_a_tls_key_others_may_read(tmp_path, site_ca, capsys):
    cert, key = write_pair(tmp_path, "federation",
                           issue_server(site_ca, ["127.0.0.1"], datetime.now(UTC)))
    key.chmod(0o644)
    create_master_key_file(tmp_path / "master.key")
    (tmp_path / "pfs").mkdir()
    config = write_site(
        tmp_path, clusters={"onprem": cluster(slurm_conf="/etc/slurm/slurm.conf")},
        federation={"state": tmp_path / "fed.db", "audit_path": tmp_path / "audit.db",
                    "key_file": tmp_path / "master.key", "listen_port": free_port(),
                    "tls_cert": cert, "tls_key": key})
    assert entry.main(["--config", str(config)]) == 3
    assert capsys.readouterr().err == (f"slurm-geo-federation: error: [federation] tls_key "
                                       f"{key}: mode 0644 lets others in; chmod 600 it\n")


def test_a_reload_refuses_a_ca_file_that_is_not_pem_and_takes_a_good_one(tmp_path, site_ca):
    site = Site(tmp_path)
    assert site.config.federation is not None
    bad, good = tmp_path / "bad.pem", tmp_path / "ca.pem"
    bad.write_text("hello\n")
    good.write_bytes(site_ca.cert_pem)

    def changed(**settings):
        return lambda: replace(site.config, federation=replace(site.config.federation,
                                                               **settings))
    assert not entry.reload_config(site.federation, changed(ca_file=bad))
    assert entry.reload_config(site.federation, changed(ca_file=good, tls_cert=good,
                                                        tls_key=good))
    config = site.federation.config
    assert (config.ca_file, config.tls_cert, config.tls_key) == (good, None, None)
