"""The state database: schema, compare-and-set moves, recovery after a crash, requeue."""

from __future__ import annotations

import sqlite3
import threading

import pytest

from slurm_geo.sync.state import (
    IllegalTransition,
    StaleStatus,
    StateDB,
    Status,
    SyncError,
)

NOW = 1_800_000_000.0


def discovered(*steps, run="r", destination="offsite", status="pending"):
    return [{"root": "pfs", "run": run, "step": s, "destination": destination,
             "sequence": i, "status": status} for i, s in enumerate(steps)]


@pytest.fixture
def state(tmp_path):
    db = StateDB(tmp_path / "sync" / "state.db")
    yield db
    db.close()


def test_schema_is_wal_with_one_row_per_checkpoint_and_destination(state, tmp_path):
    assert state.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    ids = state.add(discovered(100, 200), NOW)
    again = state.add(discovered(100) + discovered(100, destination="elsewhere"), NOW)
    assert len(ids) == 2 and len(again) == 1
    assert [(r.step, r.destination) for r in state.replicas()] == [
        (100, "elsewhere"), (100, "offsite"), (200, "offsite")]
    replica = state.replica(ids[0])
    assert (replica.status, replica.attempts, replica.discovered_at) == (Status.PENDING, 0, NOW)


def test_moves_follow_the_lifecycle_and_counters_add_up(state):
    [rid] = state.add(discovered(100), NOW)
    state.move(rid, Status.PENDING, Status.UPLOADING, NOW + 1, attempts=("+", 1))
    state.move(rid, Status.UPLOADING, Status.REPLICATED, NOW + 2, bytes=123)
    with pytest.raises(IllegalTransition):
        state.move(rid, Status.REPLICATED, Status.PENDING, NOW + 3)
    state.move(rid, Status.REPLICATED, Status.VERIFIED, NOW + 4, verified_at=NOW + 4)
    replica = state.replica(rid)
    assert (replica.status, replica.attempts, replica.bytes) == (Status.VERIFIED, 1, 123)


def test_a_move_from_a_status_the_row_no_longer_has_is_refused(state):
    [rid] = state.add(discovered(100), NOW)
    state.move(rid, Status.PENDING, Status.UPLOADING, NOW)
    with pytest.raises(StaleStatus):
        state.move(rid, Status.PENDING, Status.SKIPPED, NOW)   # the planner was too late
    assert state.replica(rid).status is Status.UPLOADING


def test_unknown_statuses_and_columns_never_reach_the_table(state):
    with pytest.raises(ValueError):
        state.add(discovered(100, status="done"), NOW)
    [rid] = state.add(discovered(100), NOW)
    with pytest.raises(ValueError, match="no column"):
        state.update(rid, Status.PENDING, NOW, colour="red")


def test_recovery_puts_interrupted_uploads_back_and_counts_them(state):
    ids = state.add(discovered(100, 200, 300), NOW)
    for rid in ids[:2]:
        state.move(rid, Status.PENDING, Status.UPLOADING, NOW, attempts=("+", 1))
    state.update(ids[1], Status.UPLOADING, NOW, charged=4)   # its fifth attempt
    recovered = state.recover_interrupted(NOW + 5, max_attempts=5)
    assert sorted(r.step for r in recovered) == [100, 200]
    first, second, third = (state.replica(i) for i in ids)
    assert (first.status, first.charged, first.failures) == (Status.PENDING, 1, 1)
    assert second.status is Status.FAILED
    assert third.status is Status.PENDING and third.charged == 0


def test_requeue_gives_failed_and_corrupted_a_fresh_budget(state):
    ids = state.add(discovered(100, 200, 300), NOW)
    for rid, end in zip(ids, (Status.FAILED, Status.CORRUPTED, Status.VERIFIED), strict=True):
        state.move(rid, Status.PENDING, Status.UPLOADING, NOW)
        if end is Status.FAILED:
            state.move(rid, Status.UPLOADING, Status.FAILED, NOW, charged=5, last_error="x")
        else:
            state.move(rid, Status.UPLOADING, Status.REPLICATED, NOW)
            state.move(rid, Status.REPLICATED, end, NOW)
    requeued = state.requeue("r", None, NOW + 10)
    assert sorted((r.step, r.status) for r in requeued) == [
        (100, Status.FAILED), (200, Status.CORRUPTED)]
    again = state.replica(ids[0])
    assert (again.status, again.charged, again.last_error) == (Status.PENDING, 0, None)
    assert state.replica(ids[2]).status is Status.VERIFIED
    assert state.requeue("r", None, NOW) == []


def test_newest_verified_never_offers_a_corrupted_replica(state):
    ids = state.add(discovered(100, 200), NOW)
    for rid, end in zip(ids, (Status.VERIFIED, Status.CORRUPTED), strict=True):
        state.move(rid, Status.PENDING, Status.UPLOADING, NOW)
        state.move(rid, Status.UPLOADING, Status.REPLICATED, NOW)
        state.move(rid, Status.REPLICATED, end, NOW)
    assert state.newest_verified("r", "offsite") == 100
    assert state.newest_verified("other", "offsite") is None


def test_transfers_record_bytes_and_regions_for_billing(state):
    [rid] = state.add(discovered(100), NOW)
    replica = state.replica(rid)
    for name, size, kind in (("packs/ab/ab", 1000, "packs"), ("manifests/r/1", 50, "manifests"),
                             ("manifests/r/1", 1050, "verify")):
        state.record_transfer(replica, {"object": name, "kind": kind, "bytes": size,
                                        "source": "pfs", "source_region": "home",
                                        "destination_region": "remote",
                                        "started_at": NOW, "finished_at": NOW + 1})
    assert state.transferred_bytes(rid) == 1050       # verification reads are not uploads
    rows = state.transfers(rid)
    assert [r["kind"] for r in rows] == ["packs", "manifests", "verify"]
    assert rows[0]["destination"] == "offsite" and rows[0]["source_region"] == "home"


def test_a_writer_waits_for_another_connections_transaction(state):
    [rid] = state.add(discovered(100), NOW)
    holding = threading.Event()

    def hold_the_write_lock():
        other = StateDB(state.path)
        other.db.execute("BEGIN IMMEDIATE")
        holding.set()
        threading.Event().wait(0.5)
        other.db.conn.commit()
        other.close()

    thread = threading.Thread(target=hold_the_write_lock)
    thread.start()
    holding.wait(5)
    state.move(rid, Status.PENDING, Status.UPLOADING, NOW)   # waits, does not fail
    thread.join()
    assert state.replica(rid).status is Status.UPLOADING


def test_readonly_needs_an_existing_database(tmp_path, state):
    with pytest.raises(SyncError, match="no sync state database"):
        StateDB(tmp_path / "absent.db", readonly=True)
    state.add(discovered(100), NOW)
    reader = StateDB(state.path, readonly=True)
    assert [r.step for r in reader.replicas()] == [100]
    with pytest.raises(sqlite3.OperationalError):
        reader.add(discovered(200), NOW)
    reader.close()
