"""The sandbox's site CA and the certificates it issues, made at `up` and kept after.

A site gives the federation daemon a certificate from a CA its jobs trust, and puts
slurmrestd behind a TLS reverse proxy whose certificate its clients trust through
[clusters.NAME] ca_file (docs/install.md); the sandbox plays that CA, and its
`tls_relay` that proxy. `make_ca` and `issue_server` are pure over their inputs (the
clock is passed in) and return PEM. `ensure_site_tls` writes the CA's key and certificate
and the daemon's, `ensure_rest_tls` the relay's, `ensure_etcd_tls` the etcd members' and
their clients' (docs/sandbox.md, "etcd: a member per site"), each for the hosts it is
given: a
certificate is issued again only when it is missing, names other hosts, does not chain to
the CA, or does not match its key (a crash between writing the two). Keys are written
0600 (never readable by others, not even while being written), certificates 0644 (jobs of
any user read the CA). An existing CA is kept, so jobs holding its certificate keep
trusting the daemon across `up`s.

EC P-256 keys and SHA-256 signatures; the extensions are those Python's strict X.509
checks (VERIFY_X509_STRICT, the default from 3.13) ask for: a critical basicConstraints
and keyUsage on the CA, key identifiers on both, a subjectAltName on the server's.
"""

from __future__ import annotations

import ipaddress
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from slurm_geo.atomic import write_if_changed
from slurm_geo.sandbox.etcd_members import EtcdCluster
from slurm_geo.sandbox.layout import SandboxLayout

CA_DAYS = 3650
SERVER_DAYS = 3650  # a sandbox lives as long as its directory; delete tls/ to renew
SERVER_HOSTS = ("127.0.0.1", "localhost")  # the daemon's default: jobs on this host only
SPKI = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
MEMBER_USAGES = (ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH)
ETCD_CLIENT_NAME = "slurm-geo-etcd-client"  # the name in the members' clients' certificate
ETCD_ROOT_NAME = "root"  # etcd's administrator, by its certificate's common name
PASSWORD_BYTES = 32
Write = Callable[[Path, bytes, int], object]


@dataclass(frozen=True)
class Issued:
    """A private key and its certificate, PEM."""

    key_pem: bytes
    cert_pem: bytes


def make_ca(common_name: str, now: datetime, days: int = CA_DAYS) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    usage = x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                          content_commitment=False, key_encipherment=False,
                          data_encipherment=False, key_agreement=False, encipher_only=False,
                          decipher_only=False)
    cert = (_valid(x509.CertificateBuilder(), now, days)
            .subject_name(name).issuer_name(name).public_key(key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(usage, critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256()))
    return Issued(_key_pem(key), cert.public_bytes(serialization.Encoding.PEM))


def issue_server(ca: Issued, hosts: Sequence[str], now: datetime,
                 days: int = SERVER_DAYS,
                 usages: Sequence[x509.ObjectIdentifier] = (ExtendedKeyUsageOID.SERVER_AUTH,),
                 common_name: str | None = None) -> Issued:
    """A certificate for `hosts` (IP addresses or DNS names), signed by `ca`, for the
    extended key `usages` (a server's; an etcd peer's is its peers' client too), its
    subject's common name `common_name` (the first host when None; "": none, as etcd's
    JSON gateway, with auth on, refuses a client certificate that names one)."""
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError("the sandbox CA key is not an EC key")
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
    key = ec.generate_private_key(ec.SECP256R1())
    cn = hosts[0] if common_name is None else common_name
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)] if cn else [])
    usage = x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False,
                          content_commitment=False, key_encipherment=False,
                          data_encipherment=False, key_agreement=True, encipher_only=False,
                          decipher_only=False)
    cert = (_valid(x509.CertificateBuilder(), now, days)
            .subject_name(subject)
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .add_extension(x509.SubjectAlternativeName([_general_name(h) for h in hosts]),
                           critical=not cn)  # RFC 5280: critical when the subject is empty
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(usage, critical=True)
            .add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return Issued(_key_pem(key), cert.public_bytes(serialization.Encoding.PEM))


def ensure_site_tls(layout: SandboxLayout, now: datetime | None = None,
                    write: Write = write_if_changed, *,
                    hosts: Sequence[str] = SERVER_HOSTS) -> bool:
    """Make the site CA where it is missing, and the federation daemon's certificate for
    `hosts` (IP addresses or DNS names) where it is missing or no longer fits; True when
    something was written."""
    now = now or datetime.now(UTC)
    ca, made_ca = _site_ca(layout, now, write)
    made_server = _ensure_server(ca, layout.federation_cert, layout.federation_key, hosts,
                                 now, write)
    return made_ca or made_server


def ensure_rest_tls(layout: SandboxLayout, hosts: Sequence[str],
                    now: datetime | None = None, write: Write = write_if_changed) -> bool:
    """Make the certificate of the TLS relay in front of slurmrestd, for `hosts` (the
    addresses clients put in rest_url), where it is missing or no longer fits, and the
    site CA with it if need be; True when something was written."""
    now = now or datetime.now(UTC)
    ca, made_ca = _site_ca(layout, now, write)
    return _ensure_server(ca, layout.rest_cert, layout.rest_key, hosts, now, write) or made_ca


def ensure_etcd_tls(layout: SandboxLayout, now: datetime | None = None,
                    write: Write = write_if_changed) -> bool:
    """Make the etcd members' certificates (for their clients, and of a CA of their own
    for their peers), the replicas' client certificate and password and the
    administrator's certificate, where missing or no longer fitting; True when something
    was written."""
    now = now or datetime.now(UTC)
    ca, made_ca = _site_ca(layout, now, write)
    return ensure_etcd_certs(ca, layout.etcd_cluster, now, write) or made_ca


def ensure_etcd_certs(ca: Issued, cluster: EtcdCluster, now: datetime,
                      write: Write = write_if_changed) -> bool:
    """`cluster`'s certificates into its files: each member's for its clients, of `ca`
    (a client's usage too where its JSON gateway serves the replicas, whose gRPC it
    reaches with that certificate; a server's alone at the rented site, which serves no
    client); each member's for its peers, of the peer CA, which no client port trusts; the
    replicas' (a client's, naming no user) and the administrator's (user root), of `ca`.
    So no file at the rented site lets its holder in as a client anywhere."""
    files = cluster.files
    if files is None:
        raise ValueError("this etcd cluster is plain http: give it EtcdFiles")
    peer_ca, made = _ca_at(files.peer_ca, files.peer_ca_key, "slurm-geo sandbox etcd peer CA",
                           now, write)
    client = (ExtendedKeyUsageOID.CLIENT_AUTH,)
    for member in cluster.members:
        usages = MEMBER_USAGES if member in cluster.client_members else (
            ExtendedKeyUsageOID.SERVER_AUTH,)
        made |= _ensure_server(ca, files.member_cert(member.site), files.member_key(member.site),
                               [member.address], now, write, usages=usages)
        made |= _ensure_server(peer_ca, files.peer_cert(member.site),
                               files.peer_key(member.site), [member.address], now, write,
                               usages=MEMBER_USAGES)
    made |= _ensure_server(ca, files.client_cert, files.client_key, [ETCD_CLIENT_NAME], now,
                           write, usages=client, common_name="")
    made |= _ensure_server(ca, files.root_cert, files.root_key, [ETCD_ROOT_NAME], now, write,
                           usages=client)
    if not files.password.exists():
        write(files.password, secrets.token_hex(PASSWORD_BYTES).encode() + b"\n", 0o600)
        made = True
    return made


def subject_alt_names(cert_pem: bytes) -> list[str]:
    """The IP addresses and DNS names a certificate is for, as text."""
    names = x509.load_pem_x509_certificate(cert_pem).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    return ([str(ip) for ip in names.get_values_for_type(x509.IPAddress)]
            + names.get_values_for_type(x509.DNSName))


def _ca_at(cert: Path, key: Path, name: str, now: datetime, write: Write
           ) -> tuple[Issued, bool]:
    """The CA in `cert` and `key`, made where missing; True when made."""
    if cert.exists() and key.exists():
        return Issued(key.read_bytes(), cert.read_bytes()), False
    ca = make_ca(name, now)
    write(key, ca.key_pem, 0o600)
    write(cert, ca.cert_pem, 0o644)
    return ca, True


def _site_ca(layout: SandboxLayout, now: datetime, write: Write) -> tuple[Issued, bool]:
    layout.tls_dir.mkdir(mode=0o755, parents=True, exist_ok=True)  # jobs of any user read it
    if layout.ca_cert.exists() and layout.ca_key.exists():
        return Issued(layout.ca_key.read_bytes(), layout.ca_cert.read_bytes()), False
    ca = make_ca("slurm-geo sandbox site CA", now)
    write(layout.ca_key, ca.key_pem, 0o600)
    write(layout.ca_cert, ca.cert_pem, 0o644)
    return ca, True


def _ensure_server(ca: Issued, cert: Path, key: Path, hosts: Sequence[str], now: datetime,
                   write: Write, usages: Sequence[x509.ObjectIdentifier] = (
                       ExtendedKeyUsageOID.SERVER_AUTH,),
                   common_name: str | None = None) -> bool:
    if cert.exists() and key.exists() and _fits(ca, key.read_bytes(), cert.read_bytes(),
                                                 hosts, usages, common_name):
        return False
    server = issue_server(ca, hosts, now, usages=usages, common_name=common_name)
    write(key, server.key_pem, 0o600)
    write(cert, server.cert_pem, 0o644)
    return True


def _fits(ca: Issued, key_pem: bytes, cert_pem: bytes, hosts: Sequence[str],
          usages: Sequence[x509.ObjectIdentifier] | None = None,
          common_name: str | None = None) -> bool:
    """Whether a certificate names exactly `hosts`, was issued by `ca`, and matches its key
    (and, when given, is for exactly `usages` and has `common_name`, "" for none)."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca.cert_pem))
        key = serialization.load_pem_private_key(key_pem, password=None)
        names = subject_alt_names(cert_pem)
    except (ValueError, TypeError, InvalidSignature, x509.ExtensionNotFound):
        return False  # unreadable, another CA's, or without names: issue it again
    same_key = key.public_key().public_bytes(*SPKI) == cert.public_key().public_bytes(*SPKI)
    return (same_key and {_canonical(n) for n in names} == {_canonical(h) for h in hosts}
            and (usages is None or set(_usages(cert)) == set(usages))
            and (common_name is None or _common_name(cert) == common_name))


def _usages(cert: x509.Certificate) -> list[x509.ObjectIdentifier]:
    try:
        return list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    except x509.ExtensionNotFound:
        return []


def _common_name(cert: x509.Certificate) -> str:
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""


def _canonical(host: str) -> str:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host.lower()


def _valid(builder: x509.CertificateBuilder, now: datetime, days: int
           ) -> x509.CertificateBuilder:
    return (builder.serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(hours=1))  # a node whose clock runs behind
            .not_valid_after(now + timedelta(days=days)))


def _general_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


# --- the S3 server's (slurm_geo.sandbox.seaweed) ------------------------------------------

INTERNAL_HOSTS = ("127.0.0.1", "localhost")  # where a SeaweedFS server's parts meet


def site_ca(layout: SandboxLayout, now: datetime | None = None,
            write: Write = write_if_changed) -> Issued:
    """The site CA, made where missing."""
    return _site_ca(layout, now or datetime.now(UTC), write)[0]


def ensure_issued(ca: Issued, cert: Path, key: Path, hosts: Sequence[str],
                  now: datetime | None = None, write: Write = write_if_changed) -> bool:
    """A server certificate of `ca` for `hosts` into `cert` and `key`, where missing or no
    longer fitting; True when something was written."""
    return _ensure_server(ca, cert, key, hosts, now or datetime.now(UTC), write)


def ensure_internal_pki(ca_cert: Path, ca_key: Path, cert: Path, key: Path,
                        now: datetime | None = None, write: Write = write_if_changed) -> bool:
    """A CA of its own for a server's internal parts (all files 0600: nobody else needs
    even its certificate) and one certificate of it, server and client, that the parts
    present to each other; made where missing or no longer fitting."""
    now = now or datetime.now(UTC)
    made_ca = not (ca_cert.exists() and ca_key.exists())
    if made_ca:
        fresh = make_ca("slurm-geo S3 server internal CA", now)
        write(ca_key, fresh.key_pem, 0o600)
        write(ca_cert, fresh.cert_pem, 0o600)
    ca = Issued(ca_key.read_bytes(), ca_cert.read_bytes())
    if cert.exists() and key.exists() and _fits(ca, key.read_bytes(), cert.read_bytes(),
                                                 INTERNAL_HOSTS):
        return made_ca
    issued = issue_server(ca, INTERNAL_HOSTS, now, usages=MEMBER_USAGES)
    write(key, issued.key_pem, 0o600)
    write(cert, issued.cert_pem, 0o600)
    return True
