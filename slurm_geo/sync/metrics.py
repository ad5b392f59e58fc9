"""Prometheus metrics, read from the state database at scrape time (a custom Collector).

Nothing is counted in memory: counters are sums over the database, so they survive
restarts and agree with `slurm-geo sync status` (the count of skipped unsafe files is the
exception: since the start). The endpoint answers whoever reaches it, without
authentication, so no series names a run or a step: what concerns runs is summed up per
destination, over the runs seen in the last `RUN_WINDOW_S` or still waiting for a
replica; `slurm-geo sync status` names them to root.
"""

from __future__ import annotations

import math
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from slurm_geo.daemon.httpserver import BoundedHTTPServer, Limits, PrereadHandler
from slurm_geo.sync.scrub import NO_REPORT, REPORT_MARK
from slurm_geo.sync.state import Status

RUN_WINDOW_S = 7 * 24 * 3600
METRICS_PATH = "/metrics"
# A scrape every 15 s from one or two Prometheus servers: two threads, a few waiting.
METRICS_LIMITS = Limits(workers=2, queue=8, waiting=256, idle_s=5.0, deadline_s=10.0)
PREFIX = "slurm_geo_sync"

METRIC_NAMES = (
    f"{PREFIX}_replicas", f"{PREFIX}_queue_depth", f"{PREFIX}_replication_lag_seconds",
    f"{PREFIX}_last_lag_seconds", f"{PREFIX}_runs", f"{PREFIX}_transferred_bytes",
    f"{PREFIX}_failures", f"{PREFIX}_destination_up", f"{PREFIX}_last_scan_timestamp_seconds",
    f"{PREFIX}_scrubbed_bytes", f"{PREFIX}_scrub_full_pass_timestamp_seconds",
    f"{PREFIX}_scrub_findings", f"{PREFIX}_unsafe_files_skipped", f"{PREFIX}_world_bytes",
    f"{PREFIX}_worlds", f"{PREFIX}_world_staging_lag_seconds",
    f"{PREFIX}_scrub_report_age_seconds",
    f"{PREFIX}_checkpoint_wan_bytes", f"{PREFIX}_verified_checkpoints",
    f"{PREFIX}_verified_checkpoint_bytes",
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


DIRECTIONS = ("upload", "verify")
_DIRECTION = "CASE WHEN t.kind = 'verify' THEN 'verify' ELSE 'upload' END"
_VERIFIED_BYTES = f"""
SELECT r.destination, {_DIRECTION} AS direction, SUM(t.bytes) AS n
FROM transfers t JOIN replicas r ON r.id = t.replica_id
WHERE r.verified_at IS NOT NULL GROUP BY 1, 2 ORDER BY 1, 2
"""
# Each destination's replica verified last (SQLite: the bare id is MAX's row's), both
# directions named even when nothing was read back.
_LAST_VERIFIED_BYTES = f"""
WITH last AS (SELECT destination, id, MAX(verified_at) FROM replicas
              WHERE verified_at IS NOT NULL GROUP BY destination),
     directions(direction) AS (VALUES ('upload'), ('verify'))
SELECT last.destination, directions.direction,
  (SELECT SUM(t.bytes) FROM transfers t WHERE t.replica_id = last.id
     AND {_DIRECTION} = directions.direction) AS n
FROM last, directions ORDER BY 1, 2
"""


@dataclass
class Rollup:
    """One destination's runs, summed up (no run named)."""

    lag: float = 0.0
    last_lag: float = 0.0
    verified: int = 0
    waiting: int = 0


def roll_up(rows: Iterable[sqlite3.Row], now: float) -> dict[str, Rollup]:
    """Each destination's runs seen in the last RUN_WINDOW_S or still waiting, summed up."""
    found: dict[str, Rollup] = {}
    for row in rows:
        waiting = row["waiting_since"]
        if row["seen"] < now - RUN_WINDOW_S and waiting is None:
            continue
        rollup = found.setdefault(row["destination"], Rollup())
        if waiting is None:
            rollup.verified += 1
        else:
            rollup.waiting += 1
            rollup.lag = max(rollup.lag, now - waiting)
        if row["verified"] is not None:
            rollup.last_lag = max(rollup.last_lag, row["last_lag"] or 0.0)
    return found


@dataclass
class Live:
    """What only the running daemon knows; updated by its main loop."""

    destination_up: dict[str, bool] = field(default_factory=dict)
    last_scan: float | None = None
    skipped_files: int = 0  # refused in job directories (slurm_geo.sync.ownedfiles)


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
            yield from self._per_checkpoint(conn)
            yield from self._scrub(conn)
            live = self._live()
            yield from self._worlds(conn, live.destination_up, self._clock())
        finally:
            conn.close()
        yield from self._live_metrics(live)

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
        """Per destination, never per run: the endpoint answers whoever reaches it, and a
        run's name and steps are its owner's (`slurm-geo sync status`, root, names them)."""
        lag = GaugeMetricFamily(
            f"{PREFIX}_replication_lag_seconds", "The longest any run's newest checkpoint "
            "has waited for a verified replica; 0 when every newest one is verified.",
            labels=["destination"])
        last = GaugeMetricFamily(f"{PREFIX}_last_lag_seconds", "The longest creation to "
                                 "verification among the runs' newest verified replicas.",
                                 labels=["destination"])
        runs = GaugeMetricFamily(f"{PREFIX}_runs", "Runs whose newest checkpoint has a "
                                 "verified replica (verified) or waits for one (waiting).",
                                 labels=["destination", "state"])
        for destination, rollup in sorted(roll_up(conn.execute(_PER_RUN), now).items()):
            lag.add_metric([destination], rollup.lag)
            last.add_metric([destination], rollup.last_lag)
            runs.add_metric([destination, "verified"], rollup.verified)
            runs.add_metric([destination, "waiting"], rollup.waiting)
        yield from (lag, last, runs)

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

    def _per_checkpoint(self, conn: sqlite3.Connection) -> Iterator[Metric]:
        """What each verified checkpoint cost the WAN, from `transfers`: the newest one's
        bytes put and read back, and both summed over every verified checkpoint with
        their count (their ratio: bytes per checkpoint; one crossing: upload about its
        stored bytes, verify about 0)."""
        last = GaugeMetricFamily(
            f"{PREFIX}_checkpoint_wan_bytes", "Bytes put to the destination (upload) and "
            "read back from it (verify) for the checkpoint verified there last.",
            labels=["destination", "direction"])
        count = CounterMetricFamily(
            f"{PREFIX}_verified_checkpoints", "Checkpoints verified at the destination "
            "(each once, however often scrubbed or repaired since).", labels=["destination"])
        moved = CounterMetricFamily(
            f"{PREFIX}_verified_checkpoint_bytes", "Bytes put (upload) and read back "
            "(verify) for the checkpoints verified at the destination.",
            labels=["destination", "direction"])
        verified = {row["destination"]: row["n"] for row in conn.execute(
            "SELECT destination, COUNT(*) AS n FROM replicas WHERE verified_at IS NOT NULL "
            "GROUP BY destination ORDER BY 1")}
        sums = {(destination, direction): 0 for destination in verified
                for direction in DIRECTIONS}
        sums.update(((row["destination"], row["direction"]), row["n"] or 0)
                    for row in conn.execute(_VERIFIED_BYTES))
        for destination, n in verified.items():
            count.add_metric([destination], n)
        for (destination, direction), n in sums.items():
            moved.add_metric([destination, direction], n)
        for row in conn.execute(_LAST_VERIFIED_BYTES):
            last.add_metric([row["destination"], row["direction"]], row["n"] or 0)
        yield from (last, count, moved)

    def _scrub(self, conn: sqlite3.Connection) -> Iterator[Metric]:
        scrubbed = CounterMetricFamily(
            f"{PREFIX}_scrubbed_bytes", "Bytes the scrub read from the destination: whole "
            "replicas read back (scrub_at here), or the scrub-here report and each replica's "
            "key and manifest (destination).", labels=["destination"])
        findings = CounterMetricFamily(
            f"{PREFIX}_scrub_findings", "Verified replicas the scrub found damaged "
            "(corrupted), and those of them copied and verified again (repaired).",
            labels=["destination", "result"])
        full_pass = GaugeMetricFamily(
            f"{PREFIX}_scrub_full_pass_timestamp_seconds", "Every verified replica has "
            "been checked whole (verified or scrubbed) since this time: the last full pass "
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
        yield self._report_age(conn)

    def _report_age(self, conn: sqlite3.Connection) -> Metric:
        """How old the newest `scrub-here` report read from each destination is
        ([sync] scrub_at = "destination"): a growing age says scrub-here no longer runs."""
        age = GaugeMetricFamily(
            f"{PREFIX}_scrub_report_age_seconds", "Age of the newest scrub report "
            "(slurm-geo sync scrub-here) read from the destination: now minus when that "
            "scrub finished, by the destination's clock; +Inf when the last scrub turn found "
            "none there.", labels=["destination"])
        now = self._clock()
        for row in conn.execute("SELECT key, value FROM meta WHERE key LIKE ? ORDER BY key",
                                [f"{REPORT_MARK}:%"]):
            try:
                finished = -math.inf if row["value"] == NO_REPORT else float(row["value"])
            except ValueError:
                continue
            age.add_metric([row["key"].partition(":")[2]], max(0.0, now - finished))
        return age

    def _worlds(self, conn: sqlite3.Connection, destinations: Iterable[str], now: float
                ) -> Iterator[Metric]:
        """The runs' worlds (docs/checkpoint-sync.md, "A run's world"), summed up per
        destination: the pack bytes of the pinned snapshots there and still to copy, the
        runs whose world is whole there, not yet, or kept from there by residency, and
        the staging lag of the one that has waited longest (no series names a run)."""
        staged = GaugeMetricFamily(
            f"{PREFIX}_world_bytes", "Pack bytes of the runs' pinned world snapshots at the "
            "destination (staged) and still to copy there (pending).",
            labels=["destination", "state"])
        worlds = GaugeMetricFamily(
            f"{PREFIX}_worlds", "Runs with a world record whose world is whole and verified "
            "at the destination (complete), not yet (incomplete), or never while a root's "
            "data class may not reside in its region (refused).",
            labels=["destination", "state"])
        lag = GaugeMetricFamily(
            f"{PREFIX}_world_staging_lag_seconds", "Seconds the oldest world record not yet "
            "whole at the destination has waited since checkpoint-sync first read it (0: "
            "every world there is whole or refused).", labels=["destination"])
        found: dict[str, list[float]] = {d: [0, 0, 0, 0, 0, 0.0] for d in destinations}
        try:
            rows = list(conn.execute(
                "SELECT destination, SUM(bytes_there) AS there, SUM(MAX(bytes_total - "
                "bytes_there, 0)) AS pending, SUM(complete) AS complete, COUNT(*) AS n, "
                "SUM(refused IS NOT NULL AND NOT complete) AS refused, MIN(CASE WHEN NOT "
                "complete AND refused IS NULL THEN record_seen_at END) AS oldest FROM "
                "worlds WHERE record_sha256 IS NOT NULL GROUP BY destination"))
        except sqlite3.OperationalError:
            rows = []  # a state the daemon has not opened since worlds were added
        for row in rows:
            complete, refused = row["complete"] or 0, row["refused"] or 0
            oldest = row["oldest"]
            found[row["destination"]] = [row["there"] or 0, row["pending"] or 0, complete,
                                         (row["n"] or 0) - complete - refused, refused,
                                         0.0 if oldest is None else max(0.0, now - oldest)]
        for destination, (there, pending, complete, incomplete, refused, waited) \
                in sorted(found.items()):
            staged.add_metric([destination, "staged"], there)
            staged.add_metric([destination, "pending"], pending)
            worlds.add_metric([destination, "complete"], complete)
            worlds.add_metric([destination, "incomplete"], incomplete)
            worlds.add_metric([destination, "refused"], refused)
            lag.add_metric([destination], waited)
        yield from (staged, worlds, lag)

    def _live_metrics(self, live: Live) -> Iterator[Metric]:
        up = GaugeMetricFamily(f"{PREFIX}_destination_up", "1 while the destination answers, "
                               "0 during an outage.", labels=["destination"])
        for destination, is_up in sorted(live.destination_up.items()):
            up.add_metric([destination], 1.0 if is_up else 0.0)
        yield up
        yield CounterMetricFamily(f"{PREFIX}_unsafe_files_skipped", "Files of job "
                                  "directories not read: links, and files not their "
                                  "owner's.", value=live.skipped_files)
        if live.last_scan is not None:
            yield GaugeMetricFamily(f"{PREFIX}_last_scan_timestamp_seconds",
                                    "When the roots were last scanned.", value=live.last_scan)


def serve_metrics(collector: SyncCollector, address: str, port: int,
                  limits: Limits = METRICS_LIMITS) -> BoundedHTTPServer:
    """Serve `collector` alone (no process-wide default registry) on address:port, over
    the federation daemon's bounded server (`slurm_geo.daemon.httpserver`): one thread
    reads every connection, a stalled one costs a socket, never a thread, and `limits`
    bound the rest. Returns the server; its shutdown() and server_close() stop it."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)  # type: ignore[arg-type]

    class Handler(PrereadHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path.partition("?")[0] not in ("/", METRICS_PATH):
                self.send_error(404)
                return
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            """No line per scrape."""

    server = BoundedHTTPServer(address, port, Handler, limits=limits)
    threading.Thread(target=server.serve_forever, name="sync-metrics", daemon=True).start()
    return server
