"""Where each record of the federation state lives in etcd, under one prefix (the table
in docs/federation.md, "Replicated state on etcd"). Pure.

Every name in a key is percent-quoted (only RFC 3986's unreserved characters stay), so a
job named `a/b` is one component and every key is ASCII; generations and audit sequence
numbers are zero-padded, so key order is numeric order. Key names are not sealed: the
rented site's etcd member sees job and cluster names, generations and the SHA-256 of
each key token, never a token, a secret or a script (those are in the sealed values).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import quote

from slurm_geo.config.daemons import DEFAULT_ETCD_PREFIX, check_etcd_prefix

_DIGEST = re.compile(r"[0-9a-f]{64}")


def component(name: str) -> str:
    return quote(name, safe="")


@dataclass(frozen=True)
class Layout:
    prefix: str = DEFAULT_ETCD_PREFIX

    def __post_init__(self) -> None:
        check_etcd_prefix(self.prefix)

    @property
    def leader(self) -> str:
        return f"{self.prefix}/leader"

    @property
    def version(self) -> str:
        """The layout's version (federation.etcd.version)."""
        return f"{self.prefix}/layout-version"

    def job(self, logical_job: str) -> str:
        return f"{self.jobs}{component(logical_job)}"

    @property
    def jobs(self) -> str:
        return f"{self.prefix}/jobs/"

    def incarnation(self, logical_job: str, generation: int) -> str:
        return f"{self.incarnations_of(logical_job)}{generation:010d}"

    def incarnations_of(self, logical_job: str) -> str:
        return f"{self.incarnations}{component(logical_job)}/"

    @property
    def incarnations(self) -> str:
        return f"{self.prefix}/incarnations/"

    def lease(self, logical_job: str) -> str:
        return f"{self.leases}{component(logical_job)}"

    @property
    def leases(self) -> str:
        return f"{self.prefix}/leases/"

    def token(self, token_sha256: str) -> str:
        if not _DIGEST.fullmatch(token_sha256):
            raise ValueError("a token is stored by its SHA-256 (64 lowercase hex digits)")
        return f"{self.tokens}{token_sha256}"

    @property
    def tokens(self) -> str:
        return f"{self.prefix}/tokens/"

    def secret(self, logical_job: str, generation: int) -> str:
        return f"{self.prefix}/secrets/{component(logical_job)}/{generation:010d}"

    def run_owner(self, run: str) -> str:
        return f"{self.prefix}/run-owners/{component(run)}"

    def health(self, cluster: str) -> str:
        return f"{self.healths}{component(cluster)}"

    @property
    def healths(self) -> str:
        return f"{self.prefix}/health/"

    @property
    def bandwidth(self) -> str:
        return f"{self.prefix}/bandwidth"

    @property
    def daemon(self) -> str:
        return f"{self.prefix}/daemon"

    def audit_entry(self, seq: int) -> str:
        return f"{self.audit_entries}{seq:012d}"

    @property
    def audit_entries(self) -> str:
        return f"{self.prefix}/audit/"

    @property
    def audit_head(self) -> str:
        return f"{self.prefix}/audit-head"
