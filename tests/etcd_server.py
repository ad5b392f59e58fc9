"""Real etcd members for the tests: each its own data directory and loopback ports,
started and stopped by pid (never by name), healthy before a test gets it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import pytest
import requests

from slurm_geo.ckpt.format.keys import KeyFile, MasterKeys
from slurm_geo.federation.model import Replica
from slurm_geo.federation.state.etcd.kv import EtcdKV, EtcdTLS
from slurm_geo.federation.state.etcd.layout import Layout
from slurm_geo.federation.state.etcd.leadership import Leadership
from slurm_geo.federation.state.etcd.state import EtcdFederationState
from slurm_geo.sandbox import certs
from slurm_geo.sandbox.etcd_members import (
    MEMBER_SITES,
    REPLICA_USER,
    EtcdCluster,
    EtcdFiles,
    ensure_auth,
)
from slurm_geo.sandbox.etcd_members import EtcdMember as SandboxMember

ETCD = Path("/usr/bin/etcd")
# Elections in a quarter of etcd's default time: loopback answers in microseconds.
TIMING = ("--heartbeat-interval", "50", "--election-timeout", "500")
HEALTHY_WITHIN_S = 20.0


def require_etcd() -> None:
    if not ETCD.exists():
        pytest.skip("etcd is not installed: apt-get install etcd-server etcd-client")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class EtcdMember:
    name: str
    root: Path
    client_port: int = field(default_factory=free_port)
    peer_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def client_url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def data_dir(self) -> Path:
        return self.root / self.name

    def start(self, initial_cluster: str) -> None:
        log = open(self.root / f"{self.name}.log", "ab")  # noqa: SIM115 (the process keeps it)
        self.process = subprocess.Popen(
            [str(ETCD), "--name", self.name, "--data-dir", str(self.data_dir),
             "--listen-client-urls", self.client_url, "--advertise-client-urls", self.client_url,
             "--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls", self.peer_url,
             "--initial-cluster", initial_cluster, "--initial-cluster-state", "new",
             "--initial-cluster-token", f"slurm-geo-tests-{os.getpid()}", *TIMING],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def healthy(self) -> bool:
        try:
            reply = requests.get(self.client_url + "/health", timeout=1)
        except requests.RequestException:
            return False
        return reply.ok and reply.json().get("health") == "true"

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """SIGKILL: the member is lost as a crashed machine is."""
        if self.process is None or self.process.poll() is not None:
            return
        os.kill(self.process.pid, sig)
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(10)


def start_cluster(root: Path, size: int) -> list[EtcdMember]:
    """`size` members on loopback, healthy (a leader elected), or fail with their logs."""
    require_etcd()
    members = [EtcdMember(f"m{i}", root) for i in range(size)]
    initial = ",".join(f"{m.name}={m.peer_url}" for m in members)
    for member in members:
        member.start(initial)
    deadline = time.monotonic() + HEALTHY_WITHIN_S
    while not all(m.healthy() for m in members):
        if time.monotonic() > deadline or any(m.process and m.process.poll() is not None
                                              for m in members):
            logs = {m.name: (root / f"{m.name}.log").read_text()[-2000:] for m in members}
            stop_cluster(members)
            raise RuntimeError(f"etcd did not become healthy in {HEALTHY_WITHIN_S:g} s: {logs}")
        time.sleep(0.05)
    return members


def stop_cluster(members: list[EtcdMember]) -> None:
    for member in members:
        member.stop()


def data_bytes(member: EtcdMember) -> bytes:
    """Every byte of the member's data directory (its WAL and its bbolt database)."""
    return b"".join(path.read_bytes() for path in sorted(member.data_dir.rglob("*"))
                    if path.is_file())


# --- slurm-geo replicas on these members ----------------------------------------------------

MASTER_KEY = bytes(range(32))


def fresh_prefix() -> str:
    """A prefix of its own for one test on a shared member."""
    return f"/slurm-geo-tests/{uuid.uuid4().hex}"


def open_replica(endpoints: list[str], prefix: str, name: str, *, ttl_s: int = 60,
                 site: str = "onprem", master_key: bytes = MASTER_KEY,
                 master_keys: MasterKeys | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 tls: EtcdTLS | None = None) -> EtcdFederationState:
    """A federation daemon's state on etcd, as a fresh process opens it (nothing on disk):
    the endpoints, the prefix and the master key (`master_keys`: a key file followed).
    It leads only once it campaigns."""
    kv = EtcdKV(endpoints, KeyFile(master_key) if master_keys is None else master_keys,
                tls=tls or EtcdTLS())
    layout = Layout(prefix)
    leadership = Leadership(kv, layout, Replica(name, site, f"https://{name}.example:9852"),
                            ttl_s=ttl_s, clock=clock)
    return EtcdFederationState(kv, layout, leadership)


# --- the sandbox's cluster, on loopback: its certificates, command lines and auth -----------

SANDBOX_PREFIX = "/slurm-geo/federation"


@dataclass
class SecureCluster:
    """Three members as the sandbox runs them (sandbox.etcd_members: its certificates, its
    command lines, auth on), each on its own loopback address, no namespaces."""

    cluster: EtcdCluster
    processes: list[subprocess.Popen[bytes]]

    @property
    def files(self) -> EtcdFiles:
        assert self.cluster.files is not None
        return self.cluster.files

    def replica_tls(self) -> EtcdTLS:
        files = self.files
        return EtcdTLS(files.ca, files.client_cert, files.client_key, REPLICA_USER,
                       files.password)

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(10)


def start_sandbox_cluster(root: Path, prefix: str = SANDBOX_PREFIX) -> SecureCluster:
    """The sandbox's three members on 127.0.0.1-3, healthy and with auth on."""
    require_etcd()
    files = EtcdFiles(root / "tls" / "site-ca.pem", root / "tls")
    files.directory.mkdir(mode=0o755)
    ca = certs.make_ca("test site CA", datetime.now(UTC))
    files.ca.write_bytes(ca.cert_pem)
    members = tuple(SandboxMember(site, "", f"127.0.0.{i + 1}", free_port(), free_port(),
                                  root / "etcd" / site.value, secure=True)
                    for i, site in enumerate(MEMBER_SITES))
    cluster = EtcdCluster(f"slurm-geo-tests-{uuid.uuid4().hex[:8]}", members, files)
    certs.ensure_etcd_certs(ca, cluster, datetime.now(UTC))
    processes = []
    for member in members:
        log = open(root / f"{member.name}.log", "ab")  # noqa: SIM115 (the process keeps it)
        # On one host a member reaches 127.0.0.2 and .3 from 127.0.0.1, which the IP in
        # the peer certificate it presents does not name: only the sandbox's own network
        # namespaces give each member its address as the source. Without this, members .2
        # and .3 reached no peer, and the cluster was healthy only through .1's own
        # connections (20 s was not always enough in CI).
        processes.append(subprocess.Popen([*cluster.argv(member, str(ETCD)), *TIMING,
                                           "--experimental-peer-skip-client-san-verification"],
                                          stdout=log, stderr=subprocess.STDOUT))
        log.close()
    secure = SecureCluster(cluster, processes)
    deadline = time.monotonic() + HEALTHY_WITHIN_S
    while not all(cluster.is_healthy(member) for member in members):
        if time.monotonic() > deadline:
            logs = {m.name: (root / f"{m.name}.log").read_text()[-2000:] for m in members}
            secure.stop()
            raise RuntimeError(f"etcd did not become healthy in {HEALTHY_WITHIN_S:g} s: {logs}")
        time.sleep(0.05)
    ensure_auth(cluster, prefix)
    return secure
