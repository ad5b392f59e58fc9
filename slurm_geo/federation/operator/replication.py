"""What `slurm-geo federation status` shows: each replica of the federation daemon (does
it answer, does it lead), who leads as etcd says, and each etcd member's health, raft
index and how far it lags. Gathering is I/O; `member_views` and `render` are pure.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from slurm_geo.cells import cell, table
from slurm_geo.config.daemons import FederationConfig
from slurm_geo.federation.model import Replica
from slurm_geo.federation.state.etcd.kv import EtcdKV
from slurm_geo.federation.state.etcd.layout import Layout
from slurm_geo.federation.state.etcd.leadership import replica_from_json
from slurm_geo.lease.protocol import LEADER_PATH

ASK_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class ReplicaView:
    name: str
    site: str
    url: str
    reachable: bool
    leading: bool | None  # what it says of itself; None when it did not answer
    error: str = ""


@dataclass(frozen=True)
class MemberView:
    endpoint: str
    healthy: bool  # it answered, and knows a raft leader
    name: str = ""
    member_id: str = ""
    raft_leader: bool = False
    raft_index: int | None = None
    raft_term: int | None = None
    lag: int | None = None  # raft entries behind the member furthest ahead
    version: str = ""
    error: str = ""


@dataclass(frozen=True)
class ReplicationStatus:
    replicated: bool
    leader: Replica | None
    replicas: list[ReplicaView]
    members: list[MemberView]

    def to_json(self) -> dict[str, Any]:
        return {"replicated": self.replicated,
                "leader": None if self.leader is None else asdict(self.leader),
                "replicas": [asdict(r) for r in self.replicas],
                "etcd": [asdict(m) for m in self.members]}


def replication_status(config: FederationConfig, kv: EtcdKV | None,
                       tls: ssl.SSLContext | None) -> ReplicationStatus:
    """Ask every replica (GET /v1/leader) and, with `kv`, etcd and each of its members."""
    replicas = [ask_replica(r.name, r.site, r.url, tls) for r in config.replicas] \
        or [ask_replica(config.replica, "", config.url, tls)]
    if kv is None:
        leading = [Replica(r.name, r.site, r.url) for r in replicas if r.leading]
        return ReplicationStatus(False, leading[0] if leading else None, replicas, [])
    found = kv.get(Layout(config.etcd_prefix).leader)
    leader = None if found is None else replica_from_json(found.value)
    members = kv.ask_each_member("/cluster/member/list")
    return ReplicationStatus(True, leader, replicas, member_views(
        kv.ask_each_member("/maintenance/status"),
        next((m for _, m in members if isinstance(m, dict)), {})))


def ask_replica(name: str, site: str, url: str, tls: ssl.SSLContext | None) -> ReplicaView:
    try:
        with urllib.request.urlopen(url.rstrip("/") + LEADER_PATH, timeout=ASK_TIMEOUT_S,
                                    context=tls) as response:
            said = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return ReplicaView(name, site, url, True, None, f"answered {exc.code}")
    except (OSError, ValueError) as exc:
        return ReplicaView(name, site, url, False, None, str(exc) or type(exc).__name__)
    return ReplicaView(name, site, url, True, bool(said.get("leading")))


def member_views(statuses: Iterable[tuple[str, dict[str, Any] | str]],
                 member_list: dict[str, Any]) -> list[MemberView]:
    """Each endpoint's /maintenance/status (or why it did not answer), named by the
    member list; the lag is against the highest raft index any member reported."""
    names = {str(m.get("ID", "")): str(m.get("name", ""))
             for m in member_list.get("members", [])}
    views = []
    for endpoint, status in statuses:
        if isinstance(status, str):
            views.append(MemberView(endpoint, False, error=status))
            continue
        member_id = str(status.get("header", {}).get("member_id", ""))
        leader = str(status.get("leader", "0"))
        views.append(MemberView(
            endpoint, leader != "0" and not status.get("errors"), names.get(member_id, ""),
            member_id, leader == member_id, int(status.get("raftIndex", 0)),
            int(status.get("raftTerm", 0)), None, str(status.get("version", "")),
            "; ".join(status.get("errors", []))))
    ahead = max((v.raft_index for v in views if v.raft_index is not None), default=None)
    return [v if v.raft_index is None or ahead is None else
            MemberView(**{**asdict(v), "lag": ahead - v.raft_index}) for v in views]


def render(status: ReplicationStatus) -> str:
    def yes(value: bool | None) -> str:
        return "-" if value is None else ("yes" if value else "no")

    rows = [("REPLICA", "SITE", "URL", "REACHABLE", "LEADS")] + [
        (r.name or "-", r.site or "-", r.url, yes(r.reachable), yes(r.leading))
        for r in status.replicas]
    lines = [table(rows)]
    leader = status.leader
    lines.append("leader: " + ("none (an election is under way, or no replica runs)"
                               if leader is None else f"{cell(leader.name)} at site "
                               f"{cell(leader.site)} ({cell(leader.url)})"))
    if status.replicated:
        lines.append("")
        lines.append(table([("ETCD MEMBER", "ENDPOINT", "HEALTHY", "RAFT LEADER",
                            "RAFT INDEX", "LAG", "ERROR")] + [
            (m.name or "-", m.endpoint, yes(m.healthy), yes(m.raft_leader),
             "-" if m.raft_index is None else str(m.raft_index),
             "-" if m.lag is None else str(m.lag), m.error or "-") for m in status.members]))
    return "\n".join(lines)
