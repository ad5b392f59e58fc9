"""The daemon's HTTP endpoint: training leases, run keys and Prometheus metrics.

    POST /v1/lease   LeaseRequest -> 200 LeaseReply (grant | wait) | 409 (fenced)
    POST /v1/key     KeyRequest -> 200 KeyReply | 403 | 409 | 503
    POST /v1/owner   OwnerRequest -> 200 | 401 | 403 | 404 | 409 | 503 (federation.ownerverbs)
    GET  /v1/leader  who this replica is, whether it leads, who does
    GET  /metrics    Prometheus text format
Each POST's credential headers go with its raw body to the lease service, which answers
401 or 403 to a request it does not authenticate (slurm_geo.lease.signing). A replica
that does not lead answers every POST with the way to the leader (federation.followers),
and so does one deposed while answering (NotLeader: nothing was granted).
A body that is not a request of the protocol gets 400 with the reason; the bodies are
slurm_geo.lease.protocol's, specified in docs/federation.md ("Lease protocol"). The server
(daemon.httpserver) bounds threads, waits and queues; refusals are audited at most
once per source address per interval (federation.refusals); docs/security.md.
"""

from __future__ import annotations

import json
import logging
import ssl
import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from slurm_geo.daemon.httpserver import (
    DEFAULT_LIMITS,
    BoundedHTTPServer,
    Limits,
    PrereadHandler,
)
from slurm_geo.errors import SlurmGeoError
from slurm_geo.federation.access.refusals import REFUSED, Refusal, RefusalAudit
from slurm_geo.federation.daemon.followers import follower_reply, leader_status, retry_after_s
from slurm_geo.federation.engine.core import Federation
from slurm_geo.federation.engine.leaseservice import Reply
from slurm_geo.federation.model import (
    ClusterStatus,
    FederationStateError,
    JobStatus,
    NotLeader,
    Replica,
)
from slurm_geo.federation.operator import ownerverbs
from slurm_geo.lease.protocol import (
    KEY_PATH,
    LEADER_PATH,
    LEASE_PATH,
    MAX_BODY_BYTES,
    METRICS_PATH,
    OWNER_PATH,
    KeyRequest,
    LeaseRequest,
    OwnerRequest,
    ProtocolError,
)
from slurm_geo.lease.signing import Credentials
from slurm_geo.slurm import SlurmError

log = logging.getLogger("slurm_geo.federation")
SERVICE_PATHS = (LEASE_PATH, KEY_PATH, OWNER_PATH)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.cluster_up = Gauge("slurm_geo_federation_cluster_up",
                                "1 while the cluster answers its probes", ["cluster"],
                                registry=self.registry)
        self.nodes = Gauge("slurm_geo_federation_nodes_available",
                           "Nodes that can take work, at the last probe that answered",
                           ["cluster"], registry=self.registry)
        self.jobs = Gauge("slurm_geo_federation_jobs", "Logical jobs by status", ["status"],
                          registry=self.registry)
        self.ticks = Counter("slurm_geo_federation_ticks", "Rounds of the daemon loop",
                             registry=self.registry)
        self.last_tick = Gauge("slurm_geo_federation_last_tick_timestamp_seconds",
                               "When the daemon loop last finished a round",
                               registry=self.registry)
        self.leading = Gauge("slurm_geo_federation_leader",
                             "1 while this replica leads (a daemon alone always does)",
                             registry=self.registry)
        self.awaiting_approval = Gauge(
            "slurm_geo_federation_moves_awaiting_approval",
            "Jobs whose move waits for a person's `slurm-geo approve`", registry=self.registry)
        self.replies = Counter(
            "slurm_geo_federation_lease_replies", "Replies of the lease and key service, by "
            "path and HTTP status (5xx: the service could not answer)", ["path", "code"],
            registry=self.registry)

    def replied(self, path: str, status: int) -> None:
        """Counted for the service's own paths only: any other path a client sends would
        make a series of its own."""
        if path in SERVICE_PATHS:
            self.replies.labels(path, str(status)).inc()

    def observe(self, federation: Federation) -> None:
        """Every gauge is set afresh each round: a status no job holds any more reads 0,
        a cluster no probe answered drops out of nodes_available."""
        for cluster, health in federation.state.health().items():
            self.cluster_up.labels(cluster).set(1 if health.status is ClusterStatus.UP else 0)
        self.nodes.clear()
        for cluster, count in federation.health.nodes_available.items():
            self.nodes.labels(cluster).set(count)
        counts = {status.value: 0 for status in JobStatus}
        awaiting = 0
        for job in federation.state.jobs():
            counts[job.status.value] += 1
            awaiting += bool(job.awaiting_approval) and not job.status.is_final()
        for status, count in counts.items():
            self.jobs.labels(status).set(count)
        self.awaiting_approval.set(awaiting)
        self.ticks.inc()
        self.last_tick.set_to_current_time()


def serve(federation: Federation, metrics: Metrics, address: str, port: int, *,
          tls: ssl.SSLContext | None = None, limits: Limits = DEFAULT_LIMITS) -> BoundedHTTPServer:
    """Start the endpoint on a daemon thread (https with `tls`); the caller shuts it down.
    Every refusal is audited, at most once per source address per refusal interval."""
    refusals = RefusalAudit(federation.audit.append, federation.clock,
                            federation.config.refusal_audit_interval_s)
    retry_s = retry_after_s(federation.config.leader_ttl_s)

    class Handler(PrereadHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path == LEADER_PATH:
                self._send(_leader_reply(federation))
                return
            if self.path != METRICS_PATH:
                self._send(Reply(404, {"reason": "not found"}))
                return
            body = generate_latest(metrics.registry)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:  # noqa: N802
            try:
                if self.path in SERVICE_PATHS and federation.leading_term() is None:
                    self._send(follower_reply(federation.leader(), self.path, retry_s))
                    return
                body, raw = self._body()
                credentials = Credentials.from_headers(self.headers, "POST", self.path, raw)
                if self.path == LEASE_PATH:
                    reply = federation.lease(LeaseRequest.from_json(body), credentials)
                elif self.path == KEY_PATH:
                    reply = federation.key(KeyRequest.from_json(body), credentials)
                elif self.path == OWNER_PATH:
                    reply = ownerverbs.answer(federation, OwnerRequest.from_json(body),
                                              credentials)
                else:
                    reply = Reply(404, {"reason": "not found"})
            except NotLeader as exc:  # deposed while answering: its write was refused
                reply = follower_reply(exc.leader, self.path, retry_s)
            except (ProtocolError, ValueError, RecursionError) as exc:  # deep JSON: recursion
                reply = Reply(400, {"reason": f"malformed request: {exc}"})
            except (SlurmError, SlurmGeoError) as exc:
                reply = Reply(503, {"reason": str(exc)})
            self._send(reply)

        def _body(self) -> tuple[dict[str, Any], bytes]:
            length = int(self.headers.get("Content-Length", "0"))
            if not 0 < length <= MAX_BODY_BYTES:
                raise ValueError("body missing or too large")
            raw = self.rfile.read(length)
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("body is not a JSON object")
            return body, raw

        def _send(self, reply: Reply) -> None:
            metrics.replied(self.path, reply.status)
            if 400 <= reply.status < 500:
                self._audit_refusal(reply.status, str(reply.body.get("reason", "")),
                                    reply.refusal)
            data = json.dumps(reply.body).encode()
            self.send_response(reply.status)
            for name, value in reply.headers.items():
                self.send_header(name, value)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def send_error(self, code: int, message: str | None = None,
                       explain: str | None = None) -> None:
            """http.server's own refusals (a request line or header it cannot parse, a
            method it does not serve) are refusals too."""
            if 400 <= code < 500:
                self._audit_refusal(code, message or "", None)
            super().send_error(code, message, explain)

        def _audit_refusal(self, status: int, reason: str, refusal: Refusal | None) -> None:
            path = getattr(self, "path", "") if self.command else ""
            try:
                refusals.refused(self.client_address[0], status, path, refusal or Refusal(
                    REFUSED, None, f"refused {self.command or 'a request'} {path}".rstrip()
                    + f" ({status})", reason))
            except FederationStateError as exc:  # a follower writes no audit entry
                log.debug("refusal not audited: %s", exc)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            log.debug("http %s", format % args)

    server = BoundedHTTPServer(address, port, Handler, tls=tls, limits=limits)
    threading.Thread(target=server.serve_forever, name="federation-http", daemon=True).start()
    return server


def _leader_reply(federation: Federation) -> Reply:
    me = federation.config.this_replica
    try:
        leader = federation.leader()
    except SlurmGeoError as exc:  # etcd does not answer: this replica cannot say
        return Reply(503, {"reason": str(exc)})
    return Reply(200, leader_status(Replica(me.name, me.site, me.url),
                                    federation.leading_term(), leader,
                                    federation.config.replicated))
