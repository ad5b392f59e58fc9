"""CA bundles the project reads (the federation daemon's and a REST cluster's ca_file):
one check that a file holds PEM certificates that load as trust anchors, and one
ConfigError line, naming the setting, when it does not."""

from __future__ import annotations

import ssl
from pathlib import Path

from slurm_geo.errors import ConfigError

PEM_CERTIFICATE = "-----BEGIN CERTIFICATE-----"


def read_ca_pem(path: Path, where: str, fix: str = "") -> str:
    """The PEM text of the CA certificate(s) in `path`; `where` names the setting in the
    error, and `fix`, when given, ends it."""
    ending = f"; {fix}" if fix else ""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: cannot read it ({_why(exc)}){ending}") from None
    try:
        if PEM_CERTIFICATE not in text:
            raise ValueError("no PEM certificate in it")
        ssl.create_default_context(cadata=text)
    except (ssl.SSLError, ValueError) as exc:
        raise ConfigError(f"{where}: not a PEM CA certificate ({_why(exc)}){ending}") from None
    return text


def _why(exc: Exception) -> str:
    return str(getattr(exc, "strerror", None) or getattr(exc, "reason", None) or exc)
