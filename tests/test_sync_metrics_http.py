"""checkpoint-sync's metrics endpoint (docs/checkpoint-sync.md#metrics): it answers anyone
who reaches it, so it names no run and no step, and a crowd of stalled connections costs
it sockets, never threads."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from slurm_geo.sync.metrics import Live, Rollup, SyncCollector, roll_up, serve_metrics
from slurm_geo.sync.state import StateDB, Status

NOW = 1_000_000.0
WEEK = 7 * 24 * 3600


def row(destination: str = "offsite", verified: int | None = 4, seen: float = NOW,
        waiting: float | None = None, last_lag: float | None = 3.0) -> dict[str, Any]:
    return {"run": "secret-run", "destination": destination, "verified": verified,
            "seen": seen, "waiting_since": waiting, "last_lag": last_lag}


@pytest.mark.parametrize("rows, expected", [
    ([], {}),
    ([row()], {"offsite": Rollup(lag=0.0, last_lag=3.0, verified=1, waiting=0)}),
    ([row(waiting=NOW - 50), row(last_lag=9.0), row(verified=None, waiting=NOW - 10,
                                                    last_lag=None)],
     {"offsite": Rollup(lag=50.0, last_lag=9.0, verified=1, waiting=2)}),
    ([row(seen=NOW - WEEK - 1)], {}),  # finished long ago: drops out
    ([row(seen=NOW - WEEK - 1, waiting=NOW - WEEK - 1)],  # still waiting: stays
     {"offsite": Rollup(lag=WEEK + 1, last_lag=3.0, verified=0, waiting=1)}),
    ([row(), row(destination="tape", waiting=NOW - 5)],
     {"offsite": Rollup(0.0, 3.0, 1, 0), "tape": Rollup(5.0, 3.0, 0, 1)}),
])
def test_runs_are_summed_up_per_destination(rows: list[dict[str, Any]],
                                            expected: dict[str, Rollup]) -> None:
    assert roll_up(rows, NOW) == expected  # type: ignore[arg-type]


@pytest.fixture
def state(tmp_path: Path) -> Path:
    """A state database with a verified checkpoint of a run whose name must not leak, and a
    newer one of it still pending."""
    path = tmp_path / "state.db"
    db = StateDB(path)
    try:
        now = time.time()
        first, _ = db.add([{"root": "pfs", "run": "llama-secret-project", "step": step,
                            "destination": "offsite", "sequence": n, "status": "pending",
                            "created_at": now} for n, step in enumerate((100, 200))], now)
        first = db.replica(first)
        db.move(first.id, Status.PENDING, Status.UPLOADING, time.time())
        db.move(first.id, Status.UPLOADING, Status.REPLICATED, time.time())
        db.move(first.id, Status.REPLICATED, Status.VERIFIED, time.time())
    finally:
        db.close()
    return path


@pytest.fixture
def server(state: Path) -> Any:
    collector = SyncCollector(state, lambda: Live(destination_up={"offsite": True}))
    server = serve_metrics(collector, "127.0.0.1", 0)
    yield server
    server.shutdown()
    server.server_close()


def _scrape(server: Any) -> str:
    host, port = server.server_address
    reply = requests.get(f"http://{host}:{port}/metrics", timeout=5)
    reply.raise_for_status()
    return reply.text


def test_unauthenticated_metrics_name_no_run_nor_step(server: Any) -> None:
    text = _scrape(server)
    assert "llama-secret-project" not in text and 'run="' not in text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    offsite = (("destination", "offsite"),)
    assert samples[("slurm_geo_sync_runs", (*offsite, ("state", "waiting")))] == 1
    assert samples[("slurm_geo_sync_replication_lag_seconds", offsite)] >= 0
    assert all(set(dict(labels)) <= {"destination", "status", "direction", "reason",
                                     "result", "state"} for _name, labels in samples)


def test_300_stalled_connections_do_not_make_300_threads_and_metrics_still_answer(
        server: Any) -> None:
    _scrape(server)  # the pool's threads, started
    before = threading.active_count()
    stalled = []
    try:
        for _ in range(300):
            sock = socket.create_connection(server.server_address, timeout=5)
            sock.sendall(b"GET /metr")  # half a request, then nothing
            stalled.append(sock)
        time.sleep(0.5)
        assert threading.active_count() <= before + 2
        started = time.monotonic()
        assert "slurm_geo_sync_replicas" in _scrape(server)
        assert time.monotonic() - started < 2.0
    finally:
        for sock in stalled:
            sock.close()


def test_a_stalled_connection_is_closed_after_its_idle_time(state: Path) -> None:
    from slurm_geo.daemon.httpserver import Limits

    collector = SyncCollector(state, Live)
    server = serve_metrics(collector, "127.0.0.1", 0,
                           Limits(workers=1, queue=1, waiting=8, idle_s=0.3, deadline_s=1.0))
    try:
        sock = socket.create_connection(server.server_address, timeout=5)
        sock.sendall(b"GET /")
        assert sock.recv(1) == b""  # closed by the server, not by us
    finally:
        server.shutdown()
        server.server_close()


def _checkpoints(path: Path, checkpoints: list[tuple[str, int, float | None,
                                                      list[tuple[str, int]]]]) -> None:
    """Replicas (destination, step, verified at or None, transfers as (kind, bytes))."""
    db = StateDB(path)
    try:
        for n, (destination, step, verified_at, transfers) in enumerate(checkpoints):
            [replica_id] = db.add([{"root": "pfs", "run": "r", "step": step,
                                    "destination": destination, "sequence": n,
                                    "status": "pending"}], NOW)
            replica = db.replica(replica_id)
            for kind, nbytes in transfers:
                db.record_transfer(replica, {"object": f"{kind}/x", "kind": kind,
                                             "bytes": nbytes, "started_at": NOW,
                                             "finished_at": NOW + 1})
            if verified_at is not None:
                db.move(replica_id, Status.PENDING, Status.UPLOADING, NOW)
                db.move(replica_id, Status.UPLOADING, Status.REPLICATED, NOW)
                db.move(replica_id, Status.REPLICATED, Status.VERIFIED, verified_at,
                        verified_at=verified_at)
    finally:
        db.close()


MB = 10 ** 6


@pytest.mark.parametrize("checkpoints, last, count, total", [
    ([], {}, {}, {}),
    # one crossing: the newest verified checkpoint put its packs, manifest and key, and
    # nothing came back
    ([("offsite", 10, NOW, [("packs", 400 * MB), ("manifests", MB), ("keys", 100)])],
     {("offsite", "upload"): 401 * MB + 100, ("offsite", "verify"): 0},
     {"offsite": 1}, {("offsite", "upload"): 401 * MB + 100, ("offsite", "verify"): 0}),
    # two crossings (a read-back): the verify direction says so
    ([("offsite", 10, NOW, [("packs", 400 * MB), ("verify", 400 * MB)]),
      ("offsite", 20, NOW + 60, [("packs", 300 * MB), ("verify", 300 * MB)])],
     {("offsite", "upload"): 300 * MB, ("offsite", "verify"): 300 * MB},
     {"offsite": 2}, {("offsite", "upload"): 700 * MB, ("offsite", "verify"): 700 * MB}),
    # the last one verified, not the highest step; one being copied counts nowhere yet
    ([("offsite", 20, NOW, [("packs", 5)]), ("offsite", 10, NOW + 9, [("packs", 7)]),
      ("offsite", 30, None, [("packs", 1000)])],
     {("offsite", "upload"): 7, ("offsite", "verify"): 0},
     {"offsite": 2}, {("offsite", "upload"): 12, ("offsite", "verify"): 0}),
    # per destination
    ([("offsite", 10, NOW, [("packs", 5)]), ("tape", 10, NOW, [("packs", 6)])],
     {("offsite", "upload"): 5, ("offsite", "verify"): 0,
      ("tape", "upload"): 6, ("tape", "verify"): 0},
     {"offsite": 1, "tape": 1},
     {("offsite", "upload"): 5, ("offsite", "verify"): 0,
      ("tape", "upload"): 6, ("tape", "verify"): 0}),
])
def test_wan_bytes_per_verified_checkpoint(tmp_path: Path, checkpoints: Any,
                                           last: dict[Any, int], count: dict[str, int],
                                           total: dict[Any, int]) -> None:
    path = tmp_path / "state.db"
    _checkpoints(path, checkpoints)
    families = {f.name: f for f in SyncCollector(path, Live).collect()}

    def by_labels(name: str) -> dict[Any, float]:
        return {tuple(s.labels.values()) if len(s.labels) > 1 else s.labels["destination"]:
                s.value for s in families[name].samples}

    assert by_labels("slurm_geo_sync_checkpoint_wan_bytes") == last
    assert by_labels("slurm_geo_sync_verified_checkpoints") == count
    assert by_labels("slurm_geo_sync_verified_checkpoint_bytes") == total
