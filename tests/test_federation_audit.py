"""The audit log: appends chain, verify finds every kind of tampering at the right seq.
The chain itself is tested on SQLite and on etcd (the `open_log` fixture); tampering with
SQLite's file here, with etcd's keys in test_federation_etcd.py."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from slurm_geo.federation.state.audit import (
    GENESIS,
    AuditError,
    AuditLog,
    canonical_json,
    entry_hash,
    utc_iso,
)
from slurm_geo.federation.state.etcd.audit import EtcdAuditLog
from tests.etcd_server import EtcdMember, fresh_prefix, open_replica
from tests.kit.audit import T0, Log, audit_clock, fill


@pytest.fixture(params=["sqlite", "etcd"])
def open_log(request: pytest.FixtureRequest, tmp_path: Path
             ) -> Iterator[Callable[[Callable[[], float]], Log]]:
    """`open_log(clock)`: the one log of the test, on SQLite or on etcd (its leader)."""
    if request.param == "sqlite":
        yield lambda clock: AuditLog(tmp_path / "a.db", clock=clock)
        return
    etcd: EtcdMember = request.getfixturevalue("etcd")
    replica = open_replica([etcd.client_url], fresh_prefix(), "onprem-a")
    assert replica.leadership.campaign()
    yield lambda clock: EtcdAuditLog(replica.kv, replica.layout, replica.leadership,
                                     clock=clock)
    replica.leadership.resign()
    replica.close()


def filled(path: Path, n: int = 6) -> AuditLog:
    log = AuditLog(path, clock=audit_clock())
    fill(log, n)
    return log


def attack(path: Path, *statements: tuple[str, tuple]) -> None:
    """What a tamperer with write access does: drop the triggers, then edit rows."""
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("DROP TRIGGER audit_no_update")
    db.execute("DROP TRIGGER audit_no_delete")
    for sql, args in statements:
        db.execute(sql, args)
    db.close()


def test_appends_chain_from_genesis_and_verify(open_log):
    log = fill(open_log(audit_clock()), 3)
    first, second, third = log.entries()
    assert (first.seq, first.prev_hash, first.time) == (1, GENESIS, "2026-11-29T18:00:01.500000Z")
    assert second.prev_hash == first.hash and third.prev_hash == second.hash
    assert log.head() == (3, third.hash)
    assert log.verify() == log.verify(expected_head=(3, third.hash))
    report = log.verify()
    assert (report.ok, report.entries, report.first_bad_seq, report.head) == (
        True, 3, None, (3, third.hash))
    assert first.detail == {"bytes": 10**9, "checkpoint": {"run": "llm", "step": 100},
                            "clusters": ["onprem", "rented"]}


def test_entries_are_selected_by_job_kind_and_sequence(open_log):
    log = fill(open_log(audit_clock()), 4)
    log.append("transfer", "onprem:1", "copied", "a move")
    assert [e.seq for e in log.entries(kind="transfer")] == [5]
    assert [e.seq for e in log.entries(kind="decision", logical_job="onprem:1")] == [1, 3]
    assert [e.seq for e in log.entries(kind="decision", since_seq=2)] == [3, 4]
    assert log.entries(kind="requeue") == []


def test_the_hash_is_sha256_of_the_canonical_fields(open_log):
    entry = open_log(lambda: T0).append(
        "transfer", None, "copied", "replication", b=2, a=1.5)
    text = ('{"detail":{"a":1.5,"b":2},"kind":"transfer","logical_job":null,'
            '"prev_hash":"' + GENESIS + '","seq":1,"time":"2026-11-29T18:00:00.000000Z",'
            '"what":"copied","why":"replication"}')
    assert entry.hash == hashlib.sha256(text.encode()).hexdigest()
    assert entry.hash == entry_hash(1, utc_iso(T0), "transfer", None, "copied",
                                    "replication", {"a": 1.5, "b": 2}, GENESIS)


def test_an_empty_log_verifies(open_log):
    log = open_log(audit_clock())
    assert log.head() == (0, GENESIS)
    assert log.verify().ok and log.verify().entries == 0
    assert log.verify(expected_head=(0, GENESIS)).ok


def test_triggers_refuse_update_and_delete(tmp_path):
    filled(tmp_path / "a.db", 2).close()
    db = sqlite3.connect(tmp_path / "a.db")
    for sql in ("UPDATE audit SET why = 'x' WHERE seq = 1", "DELETE FROM audit WHERE seq = 2"):
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            db.execute(sql)
    db.close()


@pytest.mark.parametrize("column, value", [
    ("what", "stay on onprem"),
    ("why", "because"),
    ("kind", "requeue"),
    ("time", "2026-11-29T17:00:00.000000Z"),
    ("logical_job", "rented:7"),
    ("detail", '{"bytes":1,"checkpoint":{"run":"llm","step":400},"clusters":["onprem"]}'),
    ("prev_hash", GENESIS),
])
def test_an_edited_field_is_found_at_its_seq(tmp_path, column, value):
    path = tmp_path / "a.db"
    filled(path).close()
    attack(path, (f"UPDATE audit SET {column} = ? WHERE seq = 4", (value,)))
    report = AuditLog(path, readonly=True).verify()
    assert (report.ok, report.first_bad_seq, report.entries) == (False, 4, 6)
    assert "entry 4 does not match its hash" in report.problem


def test_detail_rewritten_in_another_json_spelling_is_found(tmp_path):
    path = tmp_path / "a.db"
    filled(path).close()
    row = sqlite3.connect(path).execute("SELECT detail FROM audit WHERE seq = 2").fetchone()
    attack(path, ("UPDATE audit SET detail = ? WHERE seq = 2",
                  (json.dumps(json.loads(row[0]), indent=1),)))
    report = AuditLog(path).verify()
    assert report.first_bad_seq == 2 and "canonical" in report.problem


def test_a_rewritten_entry_with_a_recomputed_hash_breaks_the_next_link(tmp_path):
    path = tmp_path / "a.db"
    log = filled(path)
    old = log.entries(since_seq=2)[0]
    forged = entry_hash(3, old.time, old.kind, old.logical_job, "nothing happened", old.why,
                        old.detail, old.prev_hash)
    attack(path, ("UPDATE audit SET what = 'nothing happened', hash = ? WHERE seq = 3",
                  (forged,)))
    report = log.verify()
    assert (report.ok, report.first_bad_seq) == (False, 3)
    assert "entry 4 does not link to entry 3" in report.problem


def test_a_deleted_row_is_a_gap(tmp_path):
    path = tmp_path / "a.db"
    log = filled(path)
    attack(path, ("DELETE FROM audit WHERE seq = 3", ()))
    report = log.verify()
    assert (report.ok, report.first_bad_seq, report.entries) == (False, 3, 5)
    assert "entry 3 is missing (the next is 4)" in report.problem


def test_deleting_the_first_rows_is_found(tmp_path):
    path = tmp_path / "a.db"
    log = filled(path)
    attack(path, ("DELETE FROM audit WHERE seq <= 2", ()))
    assert log.verify().first_bad_seq == 1


def test_swapped_rows_are_found(tmp_path):
    path = tmp_path / "a.db"
    log = filled(path)
    attack(path, ("UPDATE audit SET seq = -1 WHERE seq = 2", ()),
           ("UPDATE audit SET seq = 2 WHERE seq = 5", ()),
           ("UPDATE audit SET seq = 5 WHERE seq = -1", ()))
    report = log.verify()
    assert (report.ok, report.first_bad_seq) == (False, 2)


def test_a_cut_tail_is_only_found_with_a_head_kept_elsewhere(tmp_path):
    path = tmp_path / "a.db"
    log = filled(path)
    kept = log.head()
    attack(path, ("DELETE FROM audit WHERE seq >= 5", ()))
    assert log.verify().ok                                  # the chain alone cannot tell
    report = log.verify(expected_head=kept)
    assert (report.ok, report.first_bad_seq) == (False, 5)
    assert "entries 5 to 6 were cut off" in report.problem


def test_a_cut_tail_with_new_appends_differs_from_the_kept_head(tmp_path):
    path = tmp_path / "a.db"
    log = filled(path)
    kept = log.head()
    attack(path, ("DELETE FROM audit WHERE seq >= 5", ()))
    for _ in range(3):
        log.append("decision", "onprem:1", "stay", "fine")
    report = log.verify(expected_head=kept)
    assert (report.ok, report.first_bad_seq) == (False, 6)
    assert log.verify(expected_head=log.head()).ok


def _append_many(path: str, worker: int, n: int) -> None:
    log = AuditLog(Path(path))
    for i in range(n):
        log.append("transfer", f"job-{worker}", f"chunk {i}", "replication", worker=worker)
    log.close()


def test_concurrent_appends_from_two_processes_keep_one_chain(tmp_path):
    path = tmp_path / "a.db"
    AuditLog(path).close()
    ctx = multiprocessing.get_context("fork")
    workers = [ctx.Process(target=_append_many, args=(str(path), w, 60)) for w in (1, 2)]
    for p in workers:
        p.start()
    for p in workers:
        p.join(60)
        assert p.exitcode == 0
    log = AuditLog(path)
    report = log.verify()
    assert (report.ok, report.entries) == (True, 120)
    assert [e.seq for e in log.entries()] == list(range(1, 121))
    assert len(log.entries(logical_job="job-1")) == 60


HOSTILE = ["'; DROP TABLE audit; --", 'job "quoted"', "new\nline", "tab\tand \\ back",
           "ünïcødé ☃", "%s %(x)s {0}"]


@pytest.mark.parametrize("name", HOSTILE)
def test_names_are_stored_verbatim(open_log, name):
    log = open_log(audit_clock())
    log.append(name, name, name, name, **{name: name})
    (entry,) = log.entries(logical_job=name)
    assert (entry.kind, entry.logical_job, entry.what, entry.why) == (name,) * 4
    assert entry.detail == {name: name}
    assert log.verify().ok


def test_entries_filter_by_job_and_seq(open_log):
    log = fill(open_log(audit_clock()))
    assert [e.seq for e in log.entries(logical_job="onprem:1")] == [1, 3, 5]
    assert [e.seq for e in log.entries(since_seq=4)] == [5, 6]
    assert [e.seq for e in log.entries("onprem:0", since_seq=2)] == [4, 6]


def test_detail_must_be_json(open_log):
    log = open_log(audit_clock())
    with pytest.raises(TypeError):
        log.append("decision", None, "x", "y", when=object())
    with pytest.raises(ValueError):
        log.append("decision", None, "x", "y", ratio=float("nan"))
    with pytest.raises(ValueError):
        log.append("", None, "x", "y")
    assert log.head() == (0, GENESIS)          # nothing half-written
    assert canonical_json({"b": [1, 2], "a": "é"}) == '{"a":"\\u00e9","b":[1,2]}'


def test_readonly_open_of_something_that_is_not_a_log(tmp_path):
    with pytest.raises(AuditError, match="no audit log at"):
        AuditLog(tmp_path / "absent.db", readonly=True)
    (tmp_path / "junk.db").write_bytes(b"not sqlite at all" * 100)
    with pytest.raises(AuditError, match="cannot open audit log"):
        AuditLog(tmp_path / "junk.db", readonly=True)
    sqlite3.connect(tmp_path / "other.db").execute("CREATE TABLE t (x)")
    with pytest.raises(AuditError, match="not an audit log"):
        AuditLog(tmp_path / "other.db", readonly=True)
    assert not (tmp_path / "absent.db").exists()
