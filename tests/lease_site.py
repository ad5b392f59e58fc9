"""A federation daemon's lease and key service on a real port, with no Slurm behind it: a
site of two clusters and directory stores, and one logical job already moved to `rented`
as generation 1 (Slurm job 77, key token "secret-token", lease secret SECRET). Requests
are lease protocol 2's: generation 1 signs with its secret (`signed` for a raw body)."""

from __future__ import annotations

import json
import socket
import ssl
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_geo.ckpt import LocalDirStore
from slurm_geo.config.model import parse_config
from slurm_geo.daemon.httpserver import DEFAULT_LIMITS, BoundedHTTPServer, Limits
from slurm_geo.federation.access.authn import Authenticator
from slurm_geo.federation.daemon.service import Metrics, serve
from slurm_geo.federation.decide.bandwidth import BandwidthModel
from slurm_geo.federation.engine.core import Federation
from slurm_geo.federation.model import JobStatus, LogicalJob, token_digest
from slurm_geo.federation.state.audit import AuditLog
from slurm_geo.federation.state.sqlite import FederationState
from slurm_geo.federation.wiring import Wiring
from slurm_geo.lease.client import Placement
from slurm_geo.lease.munge import FakeMunge
from slurm_geo.lease.signing import MungeSigner, SecretSigner, secret_bytes
from slurm_geo.slurm import Owner

KEY = bytes(range(32))
TTL = 1.0
SECRET = "5e" * 32  # generation 1's, as the daemon minted it
ALICE = Owner("alice", 2001, 2001)  # whose job onprem-5 is


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class LeaseSite:
    federation: Federation
    server: BoundedHTTPServer
    url: str
    stores: dict[str, LocalDirStore]
    munged: FakeMunge

    def placement(self, generation: int = 1, cluster: str = "rented", job_id: int = 77,
                  token: str = "", restart: int = 0, store_url: str = "file:///x",
                  ca: str = "") -> Placement:
        return Placement("run-a", cluster, job_id, restart, generation, None, self.url,
                         store_url, "", token, logical_job="onprem-5", lease_secret=SECRET,
                         federation_ca=ca)

    def signed(self, path: str, body: dict[str, Any], generation: int = 1
               ) -> tuple[bytes, dict[str, str]]:
        """`body`'s bytes and the headers its sender proves itself with: generation 1 its
        secret, generation 0 (the home job, alice's) MUNGE."""
        data = json.dumps(body).encode()
        signer = SecretSigner("onprem-5", 1, secret_bytes(SECRET)) if generation \
            else MungeSigner(self.munged.as_uid(ALICE.uid))
        return data, signer.headers("POST", path, data)

    def entries(self, *kinds: str) -> list[Any]:
        return [e for e in self.federation.audit.entries() if not kinds or e.kind in kinds]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start(tmp_path: Path, *, tls: ssl.SSLContext | None = None,
          limits: Limits = DEFAULT_LIMITS, munged: FakeMunge | None = None,
          **federation: Any) -> LeaseSite:
    (tmp_path / "pfs").mkdir()
    (tmp_path / "away").mkdir()
    port = free_port()
    site = parse_config({
        "site": {"home_cluster": "onprem"},
        "clusters": {
            "onprem": {"region": "home", "access": "cli", "slurm_conf": "/x", "store": "pfs"},
            "rented": {"region": "eu", "access": "cli", "slurm_conf": "/y", "store": "away"},
        },
        "stores": {"pfs": {"url": f"file://{tmp_path / 'pfs'}", "region": "home"},
                   "away": {"url": f"file://{tmp_path / 'away'}", "region": "eu"}},
        "federation": {"state": str(tmp_path / "fed.db"), "audit_path": str(tmp_path / "a.db"),
                       "listen_port": port, "lease_ttl_s": TTL, **federation},
    })
    assert site.federation is not None
    stores = {"pfs": LocalDirStore(tmp_path / "pfs"), "away": LocalDirStore(tmp_path / "away")}
    state = FederationState(site.federation.state)
    wiring = Wiring(site, site.federation, KEY, {}, stores, stores, state,
                    AuditLog(site.federation.audit_path))
    munged = munged or FakeMunge()
    federation_ = Federation(wiring, {}, BandwidthModel(),
                             Authenticator(state.identities, munged, time.time))
    now = time.time()
    state.add_job(LogicalJob(logical_job="onprem-5", run="run-a", home="onprem",
                             script="#!/bin/bash\n", spec={}, directives={}, generation=0,
                             cluster="onprem", job_id=5, resume_step=None, status=JobStatus.RUNNING,
                             created_at=now, updated_at=now, owner=ALICE))
    state.begin_generation("onprem-5", 0, "rented", None, now)
    state.identities.put_secret("onprem-5", 1, SECRET)
    state.submitted("onprem-5", 1, 77, token_digest("secret-token"), now)
    metrics = Metrics()
    server = serve(federation_, metrics, "127.0.0.1", port, tls=tls, limits=limits)
    metrics.observe(federation_)
    url = f"https://127.0.0.1:{port}" if tls is not None else site.federation.url
    return LeaseSite(federation_, server, url, stores, munged)
