"""Two replicas of the federation daemon on one etcd, in this process: the clusters and
stores of tests/kit/federation.py's Site (FakeSlurm, directory stores, a fake
munged), each replica with its own Federation and lease service on a port of its own,
their state shared in etcd under a prefix of the test's. `tick` runs a round of each, as
their daemons' loops would: only the leader's decides."""

from __future__ import annotations

import json
import socket
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_geo.ckpt.format.keys import KeyFile
from slurm_geo.config.model import SiteConfig, parse_config
from slurm_geo.daemon.httpserver import BoundedHTTPServer
from slurm_geo.federation.access.authn import Authenticator
from slurm_geo.federation.daemon.entry import run_round
from slurm_geo.federation.daemon.service import Metrics, serve
from slurm_geo.federation.decide.bandwidth import BandwidthModel
from slurm_geo.federation.engine.core import Federation
from slurm_geo.federation.state.etcd.leadership import Leadership
from slurm_geo.federation.state.open import open_federation_state
from slurm_geo.federation.wiring import Wiring
from slurm_geo.lease.protocol import LEADER_PATH
from slurm_geo.registry import RegistryReader
from tests.kit.federation import KEY, TTL, Site

LEADER_TTL_S = 2  # [federation] leader_ttl_s's least: failovers in seconds
SITES = {"home-a": "home", "control-b": "control"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Daemon:
    """One replica, as its process would hold it."""

    name: str
    config: SiteConfig
    federation: Federation
    server: BoundedHTTPServer
    metrics: Metrics

    @property
    def url(self) -> str:
        assert self.config.federation is not None
        return self.config.federation.url

    @property
    def leadership(self) -> Leadership:
        leadership = self.federation.wiring.leadership
        assert leadership is not None
        return leadership

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.leadership.resign()
        self.federation.state.close()


@dataclass
class ReplicatedSite(Site):
    etcd_url: str = ""
    prefix: str = ""
    ports: dict[str, int] = field(default_factory=lambda: {n: free_port() for n in SITES})

    def federation_table(self) -> dict[str, Any]:
        return {"lease_ttl_s": TTL, "outage_after": 2, "failback_stable_s": 5,
                "margin_s": 60, "leader_ttl_s": LEADER_TTL_S,
                "etcd_endpoints": [self.etcd_url], "etcd_prefix": self.prefix,
                "replica": "home-a", "listen_port": self.ports["home-a"],
                "replicas": [{"name": name, "site": site,
                              "url": f"http://127.0.0.1:{self.ports[name]}"}
                             for name, site in SITES.items()]}

    def config_of(self, name: str) -> SiteConfig:
        return parse_config({**self.raw, "federation": {
            **self.raw["federation"], "replica": name, "listen_port": self.ports[name]}})

    def restart(self) -> None:
        """Both replicas started afresh (nothing of theirs in memory); none leads yet."""
        for daemon in getattr(self, "daemons", {}).values():
            daemon.close()
        self.daemons = {name: self._start(name) for name in SITES}
        self.use("home-a")

    def _start(self, name: str) -> Daemon:
        config = self.config_of(name)
        assert config.federation is not None
        opened = open_federation_state(config.federation, KeyFile(KEY), clock=self.clock)
        clients = {"onprem": self.onprem, "rented": self.rented}
        wiring = Wiring(config, config.federation, KeyFile(KEY), dict(clients), self.stores,
                        self.stores, opened.state, opened.audit, self.clock,
                        RegistryReader(self.registry_path, missing_ok=True),
                        leadership=opened.leadership)
        federation = Federation(wiring, dict(clients), BandwidthModel(),
                                Authenticator(opened.state.identities, self.munged,
                                              self.clock))
        metrics = Metrics()
        server = serve(federation, metrics, "127.0.0.1", self.ports[name])
        return Daemon(name, config, federation, server, metrics)

    def use(self, name: str) -> None:
        """Site's helpers (lease, key, credentials, kinds) go to replica `name`."""
        self.federation = self.daemons[name].federation
        self.state = self.federation.state

    def tick(self, rounds: int = 1, seconds: float = 1.0) -> None:
        """A round of each replica's loop; the leader probes first, as its probe thread
        would have."""
        for _ in range(rounds):
            for daemon in self.daemons.values():
                if daemon.federation.leading_term() is not None:
                    daemon.federation.probe_all()
                run_round(daemon.federation, daemon.metrics)
            self.clock.advance(seconds)

    def close(self) -> None:
        for daemon in self.daemons.values():
            daemon.close()

    def config_file(self, name: str) -> Path:
        """Replica `name`'s config as a TOML file, for the commands. Its clusters are the
        fakes' names, which no Slurm command reaches: it gives up on them in a second."""
        clusters = {cluster: {**table, "timeout_s": 1}
                    for cluster, table in self.raw["clusters"].items()}
        raw = {**self.raw, "clusters": clusters,
               "federation": {**self.raw["federation"], "replica": name,
                              "listen_port": self.ports[name],
                              "key_file": str(self.tmp / "master.key")}}
        path = self.tmp / f"{name}.toml"
        path.write_text(toml(raw))
        return path


def toml(tables: dict[str, Any]) -> str:
    """The TOML of a site config dict (tables of tables, arrays of tables, plain values)."""
    lines: list[str] = []

    def emit(prefix: str, table: dict[str, Any]) -> None:
        plain = {k: v for k, v in table.items() if not isinstance(v, dict)
                 and not (isinstance(v, list) and v and isinstance(v[0], dict))}
        if prefix:
            lines.append(f"[{prefix}]")
        lines.extend(f"{key} = {json.dumps(value)}" for key, value in plain.items())
        for key, value in table.items():
            if isinstance(value, dict):
                emit(f"{prefix}.{key}" if prefix else key, value)
            elif isinstance(value, list) and value and isinstance(value[0], dict):
                for row in value:
                    lines.append(f"[[{prefix}.{key}]]")
                    lines.extend(f"{k} = {json.dumps(v)}" for k, v in row.items())
    emit("", tables)
    return "\n".join(lines) + "\n"


def process_config(tmp_path: Path, etcd_url: str, prefix: str, ports: dict[str, int],
                   name: str, lease_ttl_s: float | None = None) -> Path:
    """The site config of replica `name` run as its own `slurm-geo-federation` process, on
    the etcd at `etcd_url`: keys every release knows. Clusters no process here reaches."""
    (tmp_path / "pfs").mkdir(exist_ok=True)
    clusters = {cluster: {"region": region, "access": "cli", "store": "pfs", "timeout_s": 1,
                          "slurm_conf": str(tmp_path / f"{cluster}.conf")}
                for cluster, region in (("onprem", "home"), ("rented", "eu"))}
    federation: dict[str, Any] = {
        "key_file": str(tmp_path / "master.key"), "probe_interval_s": 1,
        "leader_ttl_s": LEADER_TTL_S, "etcd_endpoints": [etcd_url], "etcd_prefix": prefix,
        "replica": name, "listen_port": ports[name],
        "replicas": [{"name": n, "site": site, "url": f"http://127.0.0.1:{ports[n]}"}
                     for n, site in SITES.items()]}
    if lease_ttl_s is not None:
        federation["lease_ttl_s"] = lease_ttl_s
    path = tmp_path / f"{name}.toml"
    path.write_text(toml({
        "site": {"home_cluster": "onprem"}, "clusters": clusters,
        "stores": {"pfs": {"url": f"file://{tmp_path / 'pfs'}", "region": "home"}},
        "federation": federation}))
    return path


def says(port: int) -> dict | None:
    """A replica process's answer to GET /v1/leader, or None while it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{LEADER_PATH}",
                                    timeout=2) as response:
            return json.loads(response.read())
    except OSError:
        return None
