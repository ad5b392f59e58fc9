"""The daemon's HTTP endpoint: training leases, run keys and Prometheus metrics.

    POST /v1/lease   {run, cluster, job_id, restart, generation, last_step, release}
                     -> 200 {verdict: grant|wait, action: train|release, ...} | 409 fenced
    POST /v1/key     {token} -> 200 {run, data_key} | 403
    GET  /metrics    Prometheus text format
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from slurm_geo.errors import SlurmGeoError
from slurm_geo.federation.core import Federation, Reply
from slurm_geo.federation.leases import LeaseRequest
from slurm_geo.slurm import SlurmError

log = logging.getLogger("slurm_geo.federation")
MAX_BODY = 64 * 1024


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

    def observe(self, federation: Federation) -> None:
        for cluster, health in federation.state.health().items():
            self.cluster_up.labels(cluster).set(1 if health.status == "up" else 0)
        for cluster, count in federation.nodes_available.items():
            self.nodes.labels(cluster).set(count)
        counts: dict[str, int] = {}
        for job in federation.state.jobs():
            counts[job.status.value] = counts.get(job.status.value, 0) + 1
        for status, count in counts.items():
            self.jobs.labels(status).set(count)
        self.ticks.inc()
        self.last_tick.set_to_current_time()


def serve(federation: Federation, metrics: Metrics, address: str, port: int
          ) -> ThreadingHTTPServer:
    """Start the endpoint on a daemon thread; the caller shuts it down."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path != "/metrics":
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
                body = self._body()
                if self.path == "/v1/lease":
                    reply = federation.lease(_lease_request(body))
                elif self.path == "/v1/key":
                    reply = federation.key(str(body["token"]))
                else:
                    reply = Reply(404, {"reason": "not found"})
            except (KeyError, TypeError, ValueError) as exc:
                reply = Reply(400, {"reason": f"malformed request: {exc}"})
            except (SlurmError, SlurmGeoError) as exc:
                reply = Reply(503, {"reason": str(exc)})
            self._send(reply)

        def _body(self) -> dict[str, Any]:
            length = int(self.headers.get("Content-Length", "0"))
            if not 0 < length <= MAX_BODY:
                raise ValueError("body missing or too large")
            body = json.loads(self.rfile.read(length))
            if not isinstance(body, dict):
                raise ValueError("body is not a JSON object")
            return body

        def _send(self, reply: Reply) -> None:
            data = json.dumps(reply.body).encode()
            self.send_response(reply.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            log.debug("http %s", format % args)

    server = ThreadingHTTPServer((address, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="federation-http", daemon=True).start()
    return server


def _lease_request(body: dict[str, Any]) -> LeaseRequest:
    last_step = body.get("last_step")
    return LeaseRequest(run=str(body["run"]), cluster=str(body["cluster"]),
                        job_id=int(body["job_id"]), restart=int(body.get("restart", 0)),
                        generation=int(body["generation"]),
                        last_step=None if last_step is None else int(last_step),
                        release=bool(body.get("release", False)))
