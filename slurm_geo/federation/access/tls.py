"""The lease and key service's TLS: its certificate and key, and the CA jobs trust.

`server_context` is what the service serves https with, built once at start from
[federation] tls_cert and tls_key. The key is checked as the master key is: a file that
lets group or others in is refused with one line saying to chmod 600 it. `ca_pem` reads
[federation] ca_file, the CA a job verifies the daemon against; a job the daemon submits
elsewhere gets its text in SLURM_GEO_FEDERATION_CA (read at each submission, so a new CA
needs no restart). Every failure is a ConfigError naming the file and the fix.
"""

from __future__ import annotations

import os
import ssl
import stat
from pathlib import Path

from slurm_geo.errors import ConfigError
from slurm_geo.pem import read_ca_pem


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    """TLS 1.2 or later, with the certificate chain in `cert` and its key in `key`."""
    _check_private(key)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except OSError as exc:  # ssl.SSLError included
        raise ConfigError(f"[federation] tls_cert {cert} and tls_key {key}: cannot load them "
                          f"({_why(exc)}); give a PEM certificate chain and its PEM private "
                          "key") from None
    return context


def ca_pem(path: Path) -> str:
    """The PEM text of the CA certificate(s) in `path`, checked to load as trust anchors."""
    return read_ca_pem(path, f"[federation] ca_file {path}")


def _check_private(key: Path) -> None:
    try:
        with open(key, "rb") as handle:
            mode = os.fstat(handle.fileno()).st_mode
    except OSError as exc:
        raise ConfigError(f"[federation] tls_key {key}: cannot read it ({_why(exc)})") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"[federation] tls_key {key}: mode {stat.S_IMODE(mode):04o} lets "
                          "others in; chmod 600 it")


def _why(exc: Exception) -> str:
    return str(getattr(exc, "strerror", None) or getattr(exc, "reason", None) or exc)
