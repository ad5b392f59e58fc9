"""Prometheus metrics, read from the state database at scrape time (a custom Collector).

Nothing is counted in memory: counters are sums over the database, so they survive
restarts and agree with `slurm-geo sync status`. Per-run series cover runs seen in the last
`RUN_WINDOW_S` or still waiting for a replica, so finished runs drop out.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from slurm_geo.sync.state import Status

RUN_WINDOW_S = 7 * 24 * 3600
PREFIX = "slurm_geo_sync"

METRIC_NAMES = (
    f"{PREFIX}_replicas", f"{PREFIX}_queue_depth", f"{PREFIX}_replication_lag_seconds",
    f"{PREFIX}_last_lag_seconds", f"{PREFIX}_verified_step", f"{PREFIX}_transferred_bytes",
    f"{PREFIX}_failures", f"{PREFIX}_destination_up", f"{PREFIX}_last_scan_timestamp_seconds",
    f"{PREFIX}_scrubbed_bytes", f"{PREFIX}_scrub_full_pass_timestamp_seconds",
    f"{PREFIX}_scrub_findings",
)

_PER_RUN = """
WITH runs AS (
  SELECT run, destination, MAX(CASE WHEN status = 'verified' THEN step END) AS verified,
         MAX(discovered_at) AS seen
  FROM replicas WHERE status != 'skipped' GROUP BY run, destination)
SELECT runs.run, runs.destination, runs.verified, runs.seen,
  (SELECT MIN(COALESCE(r.created_at, r.discovered_at)) FROM replicas r
    WHERE r.run = runs.run AND r.destination = runs.destination
      AND r.status NOT IN ('verified', 'skipped') AND r.step > COALESCE(runs.verified, -1))
    AS waiting_since,
  (SELECT r.lag_s FROM replicas r WHERE r.run = runs.run
      AND r.destination = runs.destination AND r.step = runs.verified
      AND r.status = 'verified' LIMIT 1) AS last_lag
FROM runs
"""


@dataclass
class Live:
    """What only the running daemon knows; updated by its main loop."""

    destination_up: dict[str, bool] = field(default_factory=dict)
    last_scan: float | None = None


class SyncCollector:
    def __init__(self, state_path: Path, live: Callable[[], Live],
                 clock: Callable[[], float] = time.time):
        self._path = state_path
        self._live = live
        self._clock = clock

    def describe(self) -> list[Metric]:
        return []  # collected at scrape time only

    def collect(self) -> Iterator[Metric]:
        conn = sqlite3.connect(f"file:{self._path}?mode=ro", uri=True, timeout=5)
        conn.row_factory = sqlite3.Row
        try:
            yield from self._statuses(conn)
            yield from self._runs(conn, self._clock())
            yield from self._totals(conn)
            yield from self._scrub(conn)
        finally:
            conn.close()
        yield from self._live_metrics(self._live())

    def _statuses(self, conn: sqlite3.Connection) -> Iterator[Metric]:
        replicas = GaugeMetricFamily(f"{PREFIX}_replicas", "Replicas by status.",
                                     labels=["destination", "status"])
        queue = GaugeMetricFamily(f"{PREFIX}_queue_depth", "Replicas pending, uploading or "
                                  "awaiting verification.", labels=["destination"])
        counts: dict[str, dict[str, int]] = {}
        for row in conn.execute("SELECT destination, status, COUNT(*) AS n FROM replicas "
                                "GROUP BY destination, status"):
            counts.setdefault(row["destination"], {})[row["status"]] = row["n"]
        active = {Status.PENDING.value, Status.UPLOADING.value, Status.REPLICATED.value}
        for destination, by_status in sorted(counts.items()):
            for status in Status:
                replicas.add_metric([destination, status.value], by_status.get(status.value, 0))
            queue.add_metric([destination], sum(n for s, n in by_status.items() if s in active))
        yield replicas
        yield queue

    def _runs(self, conn: sqlite3.Connection, now: float) -> Iterator[Metric]:
        lag = GaugeMetricFamily(
            f"{PREFIX}_replication_lag_seconds", "How long the run's newest checkpoint has "
            "waited for a verified replica; 0 when the newest is verified.",
            labels=["run", "destination"])
        last = GaugeMetricFamily(f"{PREFIX}_last_lag_seconds", "Creation to verification "
                                 "of the newest verified replica.", labels=["run", "destination"])
        step = GaugeMetricFamily(f"{PREFIX}_verified_step", "Newest verified step: what a "
                                 "resume at the destination gets.", labels=["run", "destination"])
        for row in conn.execute(_PER_RUN):
            waiting = row["waiting_since"]
            if row["seen"] < now - RUN_WINDOW_S and waiting is None:
                continue
            labels = [row["run"], row["destination"]]
            lag.add_metric(labels, 0.0 if waiting is None else max(0.0, now - waiting))
            if row["verified"] is not None:
                step.add_metric(labels, row["verified"])
                last.add_metric(labels, row["last_lag"] or 0.0)
        yield from (lag, last, step)

    def _totals(self, conn: sqlite3.Connection) -> Iterator[Metric]:
        moved = CounterMetricFamily(
            f"{PREFIX}_transferred_bytes", "Bytes put to the destination (upload) and read "
            "back from it (verify).", labels=["destination", "direction"])
        for row in conn.execute(
                "SELECT r.destination, CASE WHEN t.kind = 'verify' THEN 'verify' ELSE 'upload' "
                "END AS direction, SUM(t.bytes) AS n FROM transfers t JOIN replicas r "
                "ON r.id = t.replica_id GROUP BY 1, 2 ORDER BY 1, 2"):
            moved.add_metric([row["destination"], row["direction"]], row["n"] or 0)
        failures = CounterMetricFamily(
            f"{PREFIX}_failures", "Failed attempts (fault), attempts cut by an unreachable "
            "store (outage), and replicas that failed verification (corruption).",
            labels=["destination", "reason"])
        for row in conn.execute("SELECT destination, SUM(failures) AS fault, SUM(outages) "
                                "AS outage, SUM(corruptions) AS corruption FROM replicas "
                                "GROUP BY destination ORDER BY destination"):
            for reason in ("fault", "outage", "corruption"):
                failures.add_metric([row["destination"], reason], row[reason] or 0)
        yield moved
        yield failures

    def _scrub(self, conn: sqlite3.Connection) -> Iterator[Metric]:
        scrubbed = CounterMetricFamily(
            f"{PREFIX}_scrubbed_bytes", "Bytes the scrub read back from the destination, "
            "re-reading verified replicas.", labels=["destination"])
        findings = CounterMetricFamily(
            f"{PREFIX}_scrub_findings", "Verified replicas the scrub found damaged "
            "(corrupted), and those of them copied and verified again (repaired).",
            labels=["destination", "result"])
        full_pass = GaugeMetricFamily(
            f"{PREFIX}_scrub_full_pass_timestamp_seconds", "Every verified replica has "
            "been read whole (verified or scrubbed) since this time: the last full pass "
            "ended after it.", labels=["destination"])
        for row in conn.execute(
                "SELECT destination, SUM(scrubbed_bytes) AS bytes, SUM(scrub_findings) AS "
                "corrupted, SUM(repairs) AS repaired, MIN(CASE WHEN status = 'verified' THEN "
                "MAX(COALESCE(scrubbed_at, 0), COALESCE(verified_at, 0)) END) AS oldest "
                "FROM replicas GROUP BY destination ORDER BY destination"):
            scrubbed.add_metric([row["destination"]], row["bytes"] or 0)
            for result in ("corrupted", "repaired"):
                findings.add_metric([row["destination"], result], row[result] or 0)
            if row["oldest"] is not None:
                full_pass.add_metric([row["destination"]], row["oldest"])
        yield from (scrubbed, findings, full_pass)

    def _live_metrics(self, live: Live) -> Iterator[Metric]:
        up = GaugeMetricFamily(f"{PREFIX}_destination_up", "1 while the destination answers, "
                               "0 during an outage.", labels=["destination"])
        for destination, is_up in sorted(live.destination_up.items()):
            up.add_metric([destination], 1.0 if is_up else 0.0)
        yield up
        if live.last_scan is not None:
            yield GaugeMetricFamily(f"{PREFIX}_last_scan_timestamp_seconds",
                                    "When the roots were last scanned.", value=live.last_scan)


def serve_metrics(collector: SyncCollector, address: str, port: int) -> Any:
    """Serve `collector` alone (no process-wide default registry) on address:port; returns
    the server, whose shutdown() stops it."""
    from prometheus_client import start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)  # type: ignore[arg-type]
    server, _thread = start_http_server(port, addr=address, registry=registry)
    return server
