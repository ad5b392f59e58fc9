"""checkpoint-sync's state read from outside (SyncStateReader): rows in, frozen dataclasses
out; and every way a read can fail is SyncStateUnreadable naming the file, never []."""

from __future__ import annotations

import dataclasses
import sqlite3
from pathlib import Path

import pytest

from slurm_geo.sync.reader import (
    CopyTotals,
    ReplicationSample,
    SyncStateMissing,
    SyncStateReader,
    SyncStateUnreadable,
    Transfer,
)
from slurm_geo.sync.state import StateDB, Status

NOW = 1_800_000_000.0


def transfer(kind: str, nbytes: int | None, started: float, finished: float,
             source: str = "file:///pfs", destination: str = "offsite") -> dict:
    return {"object": f"{kind}/x", "kind": kind, "bytes": nbytes, "source": source,
            "source_region": "home", "destination_region": "remote",
            "started_at": started, "finished_at": finished, "destination": destination}


# replica (run, step, status) -> its transfers
REPLICAS = {
    ("llm", 40, "verified"): [transfer("chunks", 300, NOW, NOW + 3),
                              transfer("manifests", 5, NOW + 3, NOW + 4),
                              transfer("verify", 305, NOW + 4, NOW + 6,
                                       source="offsite", destination="file:///pfs")],
    ("llm", 80, "verified"): [transfer("chunks", 200, NOW + 10, NOW + 12)],
    ("llm", 120, "uploading"): [transfer("chunks", None, NOW + 20, NOW + 21)],
    ("other", 40, "verified"): [transfer("chunks", 7, NOW + 30, NOW + 31)],
}


@pytest.fixture
def path(tmp_path) -> Path:
    path = tmp_path / "state.db"
    state = StateDB(path)
    for (run, step, status), transfers in REPLICAS.items():
        [replica_id] = state.add([{"root": "pfs", "run": run, "step": step,
                                   "destination": "offsite", "sequence": step,
                                   "status": status}], NOW)
        replica = state.replica(replica_id)
        for row in transfers:
            state.record_transfer(replica, row)
    state.close()
    return path


def test_replication_samples_are_one_per_replica_and_route_without_verify_reads(path):
    reader = SyncStateReader(path)
    # llm@120 is still uploading (transfer 5): from it on, nothing is a sample yet
    assert reader.replication_samples(0) == [
        ReplicationSample(2, "file:///pfs", "offsite", 305, NOW, NOW + 4),
        ReplicationSample(4, "file:///pfs", "offsite", 200, NOW + 10, NOW + 12)]
    assert reader.replication_samples(4) == []
    state = StateDB(path)
    [uploading] = state.replicas("status = ?", [Status.UPLOADING.value])
    state.move(uploading.id, Status.UPLOADING, Status.REPLICATED, NOW + 22)
    state.close()
    assert reader.replication_samples(4) == [
        ReplicationSample(5, "file:///pfs", "offsite", 0, NOW + 20, NOW + 21),
        ReplicationSample(6, "file:///pfs", "offsite", 7, NOW + 30, NOW + 31)]
    assert reader.replication_samples(6) == []


def test_a_parallel_copy_is_one_sample_of_the_link_not_one_of_each_stream(tmp_path):
    """Two packs at once, each taking the whole attempt's time at half the link's rate:
    while the replica uploads nothing is learned; once it is done, one sample of both."""
    state = StateDB(tmp_path / "state.db")
    [replica_id] = state.add([{"root": "pfs", "run": "r", "step": 1, "destination": "offsite",
                               "sequence": 1, "status": "pending"}], NOW)
    state.move(replica_id, Status.PENDING, Status.UPLOADING, NOW)
    replica = state.replica(replica_id)
    for start in (NOW, NOW):
        state.record_transfer(replica, transfer("packs", 100, start, start + 10))
    reader = SyncStateReader(tmp_path / "state.db")
    assert reader.replication_samples(0) == []
    state.record_transfer(replica, transfer("packs", 100, NOW + 10, NOW + 20))
    state.move(replica_id, Status.UPLOADING, Status.REPLICATED, NOW + 20)
    state.close()
    assert reader.replication_samples(0) == [
        ReplicationSample(3, "file:///pfs", "offsite", 300, NOW, NOW + 20)]


@pytest.mark.parametrize("since, until, ids", [
    (0, NOW + 100, [1, 2, 3, 4, 5, 6]),
    (NOW + 4, NOW + 12, [2, 3]),       # [since, until): 12 is out, 4 is in
    (NOW + 6, NOW + 12.5, [3, 4]),
    (NOW + 100, NOW + 200, []),
])
def test_transfers_finished_in_a_window(path, since, until, ids):
    assert [t.id for t in SyncStateReader(path).transfers_finished(since, until)] == ids


def test_a_transfer_is_the_row_as_recorded(path):
    [verify] = SyncStateReader(path).transfers_finished(NOW + 6, NOW + 7)
    assert verify == Transfer(3, 1, "llm", 40, "verify/x", "verify", 305, "offsite",
                              "file:///pfs", "home", "remote", NOW + 4, NOW + 6)
    [unsized] = SyncStateReader(path).transfers_finished(NOW + 21, NOW + 22)
    assert unsized.bytes == 0  # a NULL byte count is no bytes, as billing counted it
    with pytest.raises(dataclasses.FrozenInstanceError):
        verify.bytes = 1  # type: ignore[misc]


@pytest.mark.parametrize("run, steps", [("llm", [40, 80]), ("other", [40]), ("none", [])])
def test_verified_steps(path, run, steps):
    assert SyncStateReader(path).verified_steps(run) == steps


@pytest.mark.parametrize("run, step, totals", [
    ("llm", None, CopyTotals(505, 7.0, NOW, NOW + 21)),
    ("llm", 40, CopyTotals(305, 4.0, NOW, NOW + 4)),
    ("llm", 80, CopyTotals(200, 2.0, NOW + 10, NOW + 12)),
    ("llm", 999, CopyTotals(0, 0.0, None, None)),
    ("none", None, CopyTotals(0, 0.0, None, None)),
])
def test_copied_leaves_out_verification_reads(path, run, step, totals):
    assert SyncStateReader(path).copied(run, step) == totals


def test_replicas_of_a_run_oldest_first(path):
    replicas = SyncStateReader(path).replicas("llm")
    assert [(r.step, r.status) for r in replicas] == [
        (40, Status.VERIFIED), (80, Status.VERIFIED), (120, Status.UPLOADING)]
    assert len(SyncStateReader(path).replicas()) == 4


def test_job_directories_name_the_jobs_that_registered_them(path):
    from slurm_geo.sync.jobdirs import SourceStatus
    from slurm_geo.sync.state import Source

    state = StateDB(path)
    state.record_sources([
        Source("file:///home/bob/ck", "job", "/home/bob/link", SourceStatus.WATCHED,
               ("onprem:71", "onprem:70"), ("bob",), since=NOW),
        Source("file:///gone", "job", "/gone", SourceStatus.RELEASED, ("onprem:9",), ("eve",)),
        Source("pfs", "root", "file:///pfs", SourceStatus.WATCHED),
        Source("registry", "registry", "/var/lib/slurm-geo/registry.db", SourceStatus.WATCHED)])
    state.close()
    assert SyncStateReader(path).job_directories() == {
        "file:///gone": ("onprem:9",), "file:///home/bob/ck": ("onprem:71", "onprem:70")}


def test_a_state_from_before_sources_has_no_job_directories(tmp_path):
    path = tmp_path / "state.db"
    StateDB(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute("DROP TABLE sources")
    assert SyncStateReader(path).job_directories() == {}


def test_the_reader_never_writes_or_creates(path, tmp_path):
    before = path.read_bytes()
    SyncStateReader(path).transfers_finished(0, NOW + 100)
    assert path.read_bytes() == before
    with pytest.raises(SyncStateMissing):
        SyncStateReader(tmp_path / "nowhere" / "state.db").verified_steps("llm")
    assert not (tmp_path / "nowhere").exists()


def test_a_missing_file_is_an_error_unless_the_caller_says_nothing_yet(tmp_path):
    absent = tmp_path / "state.db"
    with pytest.raises(SyncStateMissing, match=f"{absent}: there is no such file; is "
                       r"checkpoint-sync running on this host\? \(see \[sync\] state"):
        SyncStateReader(absent).transfers_finished(0, 1)
    quiet = SyncStateReader(absent, missing_ok=True)
    assert quiet.replication_samples(0) == [] and quiet.verified_steps("r") == []
    assert quiet.copied("r") == CopyTotals(0, 0.0, None, None)
    assert not absent.exists()


def _damaged(path: Path) -> None:
    path.write_bytes(b"this is not an SQLite database, just text\n" * 200)


def _empty_database(path: Path) -> None:
    sqlite3.connect(path).close()
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE unrelated (x)")


def _renamed_column(path: Path) -> None:
    StateDB(path).close()
    with sqlite3.connect(path) as db:
        db.execute("ALTER TABLE transfers RENAME COLUMN bytes TO size")
        db.execute("ALTER TABLE replicas RENAME COLUMN status TO state")


def _unknown_status(path: Path) -> None:
    state = StateDB(path)
    state.add([{"root": "pfs", "run": "r", "step": 1, "destination": "offsite",
                "sequence": 1, "status": "pending"}], NOW)
    state.db.execute("UPDATE replicas SET status = 'teleported'")
    state.db.conn.commit()
    state.close()


READS = {
    "replication_samples": lambda r: r.replication_samples(0),
    "transfers_finished": lambda r: r.transfers_finished(0, NOW),
    "verified_steps": lambda r: r.verified_steps("r"),
    "copied": lambda r: r.copied("r"),
    "replicas": lambda r: r.replicas("r"),
}


@pytest.mark.parametrize("read", READS.values(), ids=READS.keys())
@pytest.mark.parametrize("make, message", [
    (_damaged, "file is not a database: the file is damaged or is another database"),
    (_empty_database, "no such table: "),
    (_renamed_column, "no such column: "),
])
def test_an_unreadable_state_raises_never_returns_nothing(tmp_path, read, make, message):
    path = tmp_path / "state.db"
    make(path)
    for missing_ok in (False, True):  # "nothing yet" is only for a file not there
        with pytest.raises(SyncStateUnreadable) as caught:
            read(SyncStateReader(path, missing_ok=missing_ok))
        text = str(caught.value)
        assert text.startswith(f"cannot read checkpoint-sync's state {path}: ")
        assert message in text and "\n" not in text


def test_a_schema_mismatch_names_the_fix(tmp_path):
    path = tmp_path / "state.db"
    _renamed_column(path)
    with pytest.raises(SyncStateUnreadable, match="run the same slurm-geo version"):
        SyncStateReader(path).transfers_finished(0, NOW)


def test_a_status_this_version_does_not_know_is_unreadable(tmp_path):
    path = tmp_path / "state.db"
    _unknown_status(path)
    with pytest.raises(SyncStateUnreadable, match="'teleported' is not a valid Status"):
        SyncStateReader(path).replicas()


def test_a_lock_held_past_the_timeout_is_unreadable(tmp_path):
    path = tmp_path / "state.db"
    StateDB(path).close()
    with sqlite3.connect(path) as db:  # out of WAL: a writer's lock now blocks readers
        db.execute("PRAGMA journal_mode = DELETE")
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(SyncStateUnreadable, match="database is locked .*more than 0.05 s"):
            SyncStateReader(path, timeout_s=0.05).transfers_finished(0, NOW)
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def test_a_directory_in_place_of_the_file_is_an_error(tmp_path):
    (tmp_path / "state.db").mkdir()
    with pytest.raises(SyncStateUnreadable):
        SyncStateReader(tmp_path / "state.db", missing_ok=True).verified_steps("r")
