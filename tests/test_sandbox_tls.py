"""The sandbox's site CA, the federation daemon's certificate and the slurmrestd relay's,
made at `up` without running anything else, and the site config that serves https with
them."""

from __future__ import annotations

import os
import tomllib
from datetime import UTC, datetime

from cryptography import x509

from slurm_geo.config.model import parse_config
from slurm_geo.federation.access.tls import ca_pem, server_context
from slurm_geo.sandbox.certs import (
    ensure_etcd_tls,
    ensure_rest_tls,
    ensure_site_tls,
    subject_alt_names,
)
from slurm_geo.sandbox.layout import SandboxLayout
from slurm_geo.sandbox.render import site_config
from slurm_geo.sandbox.sites import Site

NOW = datetime(2030, 1, 2, tzinfo=UTC)


def test_the_sandbox_makes_its_ca_and_the_daemons_certificate_once(tmp_path):
    layout = SandboxLayout(tmp_path / "box", 20000)
    assert ensure_site_tls(layout, NOW)
    files = (layout.ca_cert, layout.ca_key, layout.federation_cert, layout.federation_key)
    made = [path.read_bytes() for path in files]
    assert not ensure_site_tls(layout, NOW)  # a second `up` keeps them
    assert [path.read_bytes() for path in files] == made
    assert {path.name: oct(path.stat().st_mode & 0o777) for path in files} == {
        "site-ca.pem": "0o644", "site-ca.key": "0o600",
        "federation.pem": "0o644", "federation.key": "0o600"}
    os.remove(layout.federation_cert)  # a lost server certificate: the same CA issues one
    assert ensure_site_tls(layout, NOW)
    assert layout.ca_cert.read_bytes() == made[0] and layout.federation_cert.read_bytes() != made[2]


def test_the_sandbox_certificate_names_127_0_0_1_and_chains_to_its_ca(tmp_path):
    layout = SandboxLayout(tmp_path / "box", 20000)
    ensure_site_tls(layout, NOW)
    cert = x509.load_pem_x509_certificate(layout.federation_cert.read_bytes())
    ca = x509.load_pem_x509_certificate(layout.ca_cert.read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert cert.issuer == ca.subject
    cert.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_the_sandbox_config_serves_https_with_its_ca(tmp_path):
    layout = SandboxLayout(tmp_path / "box", 20000)
    config = parse_config(tomllib.loads(site_config(layout))).federation
    assert config is not None
    assert config.url == f"https://{layout.address(Site.HOME)}:20050"
    assert (config.tls_cert, config.tls_key, config.ca_file) == (
        layout.federation_cert, layout.federation_key, layout.ca_cert)
    ensure_site_tls(layout)
    assert config.tls_cert is not None and config.tls_key is not None
    server_context(config.tls_cert, config.tls_key)  # what the daemon loads at start
    assert config.ca_file is not None and ca_pem(config.ca_file)


def test_a_new_host_list_reissues_the_daemons_certificate_under_the_same_ca(tmp_path):
    layout = SandboxLayout(tmp_path / "box", 20000)
    ensure_site_tls(layout, NOW)
    ca, first = layout.ca_cert.read_bytes(), layout.federation_cert.read_bytes()
    hosts = ("127.0.0.1", "localhost", "10.77.1.2")
    assert ensure_site_tls(layout, NOW, hosts=hosts)  # the daemon now serves the home site
    assert layout.ca_cert.read_bytes() == ca and layout.federation_cert.read_bytes() != first
    assert subject_alt_names(layout.federation_cert.read_bytes()) == [
        "127.0.0.1", "10.77.1.2", "localhost"]
    again = layout.federation_cert.read_bytes()
    assert not ensure_site_tls(layout, NOW, hosts=("10.77.1.2", "LOCALHOST", "127.0.0.1"))
    assert layout.federation_cert.read_bytes() == again  # the same names in another order
    assert ensure_site_tls(layout, NOW)  # and back to the default
    assert subject_alt_names(layout.federation_cert.read_bytes()) == ["127.0.0.1", "localhost"]


def test_the_relays_certificate_names_the_remote_site_and_chains_to_the_site_ca(tmp_path):
    layout = SandboxLayout(tmp_path / "box", 20000)
    ensure_site_tls(layout, NOW)
    ca = layout.ca_cert.read_bytes()
    assert ensure_rest_tls(layout, ["10.77.2.2"], NOW)
    assert not ensure_rest_tls(layout, ["10.77.2.2"], NOW)
    assert layout.ca_cert.read_bytes() == ca
    assert oct(layout.rest_key.stat().st_mode & 0o777) == "0o600"
    assert oct(layout.rest_cert.stat().st_mode & 0o777) == "0o644"
    cert = x509.load_pem_x509_certificate(layout.rest_cert.read_bytes())
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca))
    assert subject_alt_names(layout.rest_cert.read_bytes()) == ["10.77.2.2"]
    server_context(layout.rest_cert, layout.rest_key)  # a key that matches the certificate


def test_a_certificate_left_by_another_ca_or_without_its_key_is_issued_again(tmp_path):
    layout = SandboxLayout(tmp_path / "box", 20000)
    ensure_rest_tls(layout, ["10.77.2.2"], NOW)  # the CA is made with it when missing
    first = layout.rest_cert.read_bytes()
    layout.ca_cert.unlink()  # a lost CA: a new one, and nothing the old one signed is kept
    assert ensure_site_tls(layout, NOW) and ensure_rest_tls(layout, ["10.77.2.2"], NOW)
    cert = x509.load_pem_x509_certificate(layout.rest_cert.read_bytes())
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(layout.ca_cert.read_bytes()))
    assert layout.rest_cert.read_bytes() != first
    layout.rest_key.write_bytes(layout.federation_key.read_bytes())  # a crash between the two
    assert ensure_rest_tls(layout, ["10.77.2.2"], NOW)
    server_context(layout.rest_cert, layout.rest_key)


def test_each_etcd_member_gets_a_certificate_for_its_site_and_its_clients_one_of_their_own(
        tmp_path):
    """What each file is for (table): no file at the rented site is a client certificate
    a member's client port trusts; peers are of a CA of their own."""
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    server, client = ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH
    layout = SandboxLayout(tmp_path / "box", 20000)
    assert ensure_etcd_tls(layout, NOW)
    assert not ensure_etcd_tls(layout, NOW)  # a second `up` keeps them
    files = layout.etcd_cluster.files
    site_ca = x509.load_pem_x509_certificate(layout.ca_cert.read_bytes())
    peer_ca = x509.load_pem_x509_certificate(files.peer_ca.read_bytes())
    address = {site: layout.address(site) for site in Site}
    table = [  # file, its CA, its names, its usages, its common name ("": none)
        *((files.member_cert(site), site_ca, [address[site]], {server, client},
           address[site]) for site in (Site.HOME, Site.CONTROL)),
        (files.member_cert(Site.REMOTE), site_ca, [address[Site.REMOTE]], {server},
         address[Site.REMOTE]),
        *((files.peer_cert(site), peer_ca, [address[site]], {server, client}, address[site])
          for site in (Site.HOME, Site.CONTROL, Site.REMOTE)),
        (files.client_cert, site_ca, ["slurm-geo-etcd-client"], {client}, ""),
        (files.root_cert, site_ca, ["root"], {client}, "root"),
    ]
    for path, ca, names, wanted, common_name in table:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
        cert.verify_directly_issued_by(ca)
        assert subject_alt_names(path.read_bytes()) == names, path
        assert set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) \
            == wanted, path
        found = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        assert (found[0].value if found else "") == common_name, path
        assert oct(path.with_suffix(".key").stat().st_mode & 0o777) == "0o600", path
    assert oct(files.password.stat().st_mode & 0o777) == "0o600"
    assert oct(files.peer_ca_key.stat().st_mode & 0o777) == "0o600"
    remote = [files.member_cert(Site.REMOTE), files.peer_cert(Site.REMOTE)]
    assert not [path for path in remote if client in set(
        x509.load_pem_x509_certificate(path.read_bytes()).extensions.get_extension_for_class(
            x509.ExtendedKeyUsage).value) and x509.load_pem_x509_certificate(
            path.read_bytes()).issuer == site_ca.subject]
