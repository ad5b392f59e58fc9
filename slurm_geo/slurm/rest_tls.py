"""TLS to slurmrestd: the site CA a cluster's ca_file names, and what a TLS failure means.

slurmrestd speaks no TLS; a site puts it behind a reverse proxy (nginx, haproxy) whose
certificate the REST backend checks against [clusters.NAME] ca_file or the system's CAs.
`check_ca_file` refuses an unusable ca_file at connect with one ConfigError line.
`certificate_problem` digs what TLS said out of the exceptions requests and urllib3 wrap
it in, and `certificate_fix` says what to do about it; both are pure.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from slurm_geo.pem import read_ca_pem

# OpenSSL's verify messages for a chain that ends at no CA this client trusts.
UNTRUSTED_ISSUER = ("self-signed", "self signed", "unable to get local issuer",
                    "unable to get issuer", "unable to verify the first certificate")


def check_ca_file(cluster: str, ca_file: Path) -> None:
    """Refuse a ca_file that cannot be read or holds no PEM certificate, with one line: at
    connect, so a bad one stops a command or the daemon's start, not a call much later."""
    read_ca_pem(ca_file, f"[clusters.{cluster}] ca_file {ca_file}",
                "give the PEM file of the CA that signs slurmrestd's certificate, readable by "
                "this user")


def certificate_problem(exc: BaseException) -> str:
    """What TLS said, from the exception requests raised around it. Pure."""
    seen: list[BaseException] = []
    todo = [exc]
    while todo and len(seen) < 20:  # urllib3 nests it in MaxRetryError and SSLError
        current = todo.pop(0)
        if isinstance(current, ssl.SSLCertVerificationError):
            return f"certificate verify failed: {str(current.verify_message).rstrip('.')}"
        if isinstance(current, ssl.SSLError) and current.reason:
            return str(current.reason)
        seen.append(current)
        nested = [*current.args, current.__cause__, current.__context__,
                  getattr(current, "reason", None)]
        todo += [e for e in nested if isinstance(e, BaseException) and e not in seen]
    return str(exc)[:200]


def certificate_fix(cluster: str, problem: str, ca_file: Path | None) -> str:
    """What to do about a TLS failure with the cluster's slurmrestd. Pure."""
    if "mismatch" in problem:
        return ("the certificate is not for the host in rest_url: write the name or address "
                "it is for, or reissue it for this one")
    if any(marker in problem for marker in UNTRUSTED_ISSUER) and ca_file is not None:
        return (f"ca_file {ca_file} does not sign it: set ca_file in [clusters.{cluster}] to "
                "the CA that does")
    if any(marker in problem for marker in UNTRUSTED_ISSUER):
        return (f"it is not signed by a CA in the system store: set ca_file = \"PATH\" in "
                f"[clusters.{cluster}] to the PEM file of the site CA that signs it")
    if problem.startswith("certificate verify failed"):
        return "fix or reissue slurmrestd's certificate"
    return ("check that rest_url names the TLS proxy in front of slurmrestd (slurmrestd "
            "speaks no TLS itself) and that the proxy is up")
