"""The federation daemon's audit log: append-only, hash-chained, in SQLite (WAL).

Every decision, transfer and requeue is one entry: what happened, why, and a JSON detail
(checkpoint run and step, clusters, bytes...). Entry `seq` (1, 2, 3...) carries

    hash = sha256(canonical JSON of {"seq", "time", "kind", "logical_job", "what", "why",
                                     "detail", "prev_hash"}).hexdigest()

where canonical JSON is `json.dumps(..., sort_keys=True, separators=(",", ":"),
ensure_ascii=True)`, `detail` is the entry's detail object, and `prev_hash` is the hash
of entry seq - 1 (64 zeros for entry 1). The stored `detail` column is the same canonical
text of the detail object.

Appends are one `BEGIN IMMEDIATE` transaction each, so processes appending at once are
serialised by SQLite and the chain stays linear. Triggers abort every UPDATE and DELETE;
someone who edits the file itself (or drops the triggers) is caught by `verify`, which
recomputes every hash, checks that seq runs 1, 2, 3... without gaps and that each entry
names its predecessor's hash.

What the chain alone cannot show: that entries were cut off the *end*, or that the whole
chain after some entry was rewritten with every hash recomputed. Keep `head()` somewhere
the writer of this file cannot change (another host, the daemon's logs) and pass it as
`verify(expected_head=...)`: the log must still hold that entry with that hash.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from slurm_geo.closing import Closing
from slurm_geo.errors import SlurmGeoError
from slurm_geo.exitcodes import ExitCode
from slurm_geo.sqlite_tx import immediate_transaction, open_database

GENESIS = "0" * 64
BUSY_TIMEOUT_S = 30.0
SCHEMA_VERSION = 1

DECISION = "decision"
TRANSFER = "transfer"
REQUEUE = "requeue"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS audit (
    seq INTEGER PRIMARY KEY, time TEXT NOT NULL, kind TEXT NOT NULL, logical_job TEXT,
    what TEXT NOT NULL, why TEXT NOT NULL, detail TEXT NOT NULL,
    prev_hash TEXT NOT NULL, hash TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS audit_by_job ON audit (logical_job, seq);
CREATE TRIGGER IF NOT EXISTS audit_no_update BEFORE UPDATE ON audit
    BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END;
CREATE TRIGGER IF NOT EXISTS audit_no_delete BEFORE DELETE ON audit
    BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END;
"""
_COLUMNS = "seq, time, kind, logical_job, what, why, detail, prev_hash, hash"


class AuditError(SlurmGeoError):
    """The audit log cannot be opened or read."""

    exit_code = ExitCode.AUDIT


class AuditChainBroken(AuditError):
    """`verify` found an altered, missing or reordered entry."""

    exit_code = ExitCode.AUDIT_CHAIN_BROKEN


@dataclass(frozen=True)
class Entry:
    seq: int
    time: str
    kind: str
    logical_job: str | None
    what: str
    why: str
    detail: Mapping[str, Any]
    prev_hash: str
    hash: str

    @property
    def unix_time(self) -> float:
        return datetime.fromisoformat(self.time).timestamp()

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "time": self.time, "kind": self.kind,
                "logical_job": self.logical_job, "what": self.what, "why": self.why,
                "detail": dict(self.detail), "prev_hash": self.prev_hash, "hash": self.hash}


@dataclass(frozen=True)
class VerifyReport:
    """`first_bad_seq`: the first entry found altered or missing (None when ok); `head`:
    the last entry as stored (0 and 64 zeros for an empty log)."""

    ok: bool
    entries: int
    first_bad_seq: int | None = None
    problem: str = ""
    head: tuple[int, str] = (0, GENESIS)


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False)


def entry_hash(seq: int, time: str, kind: str, logical_job: str | None, what: str, why: str,
               detail: Mapping[str, Any], prev_hash: str) -> str:
    fields = {"seq": seq, "time": time, "kind": kind, "logical_job": logical_job,
              "what": what, "why": why, "detail": detail, "prev_hash": prev_hash}
    return hashlib.sha256(canonical_json(fields).encode("ascii")).hexdigest()


def utc_iso(unix_s: float) -> str:
    """`2026-11-29T18:00:00.000000Z`: how entry times are written."""
    return datetime.fromtimestamp(unix_s, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class AuditLog(Closing):
    """One audit database. `clock` gives Unix seconds; `readonly` never creates or writes
    (for `slurm-geo audit`), and raises AuditError when `path` is not an audit log."""

    def __init__(self, path: Path, *, clock: Callable[[], float] = time.time,
                 readonly: bool = False):
        self.path = Path(path)
        self._clock = clock
        self._lock = threading.Lock()
        self._db = self._connect(readonly)
        try:
            self._refuse_newer()  # before anything changes the file
            if not readonly:
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=FULL")
                self._db.executescript(_SCHEMA)
                self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            elif self._db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND "
                                  "name = 'audit'").fetchone() is None:
                raise AuditError(f"{self.path} is not an audit log (no audit table)")
        except sqlite3.DatabaseError as exc:
            self._db.close()
            raise AuditError(f"cannot open audit log {self.path}: {exc}") from None
        except AuditError:
            self._db.close()
            raise

    def _refuse_newer(self) -> None:
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise AuditError(f"the audit log {self.path} is schema version {version}, "
                             f"written by a newer slurm-geo (this one reads {SCHEMA_VERSION}); "
                             "upgrade slurm-geo on this host")

    def _connect(self, readonly: bool) -> sqlite3.Connection:
        try:
            db = open_database(self.path, readonly=readonly, timeout_s=BUSY_TIMEOUT_S,
                               isolation_level=None, check_same_thread=False,
                               missing=lambda: AuditError(
                                   f"no audit log at {self.path}; give --db PATH or check "
                                   "[federation] audit_path"))
        except (OSError, sqlite3.Error) as exc:
            raise AuditError(f"cannot open audit log {self.path}: {exc}") from None
        db.row_factory = sqlite3.Row
        return db

    def close(self) -> None:
        self._db.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        # One connection, shared by a daemon's threads.
        with self._lock, immediate_transaction(self._db) as db:
            yield db

    def append(self, kind: str, logical_job: str | None, what: str, why: str,
               **detail: Any) -> Entry:
        """Add one entry at the end of the chain; ValueError / TypeError when `kind` is
        empty or `detail` is not JSON (NaN and infinities included)."""
        if not kind:
            raise ValueError("audit: kind must not be empty")
        detail_text = canonical_json(detail)
        stored_detail = json.loads(detail_text)
        with self._transaction() as db:
            seq, prev_hash = self._head(db)
            seq += 1
            when = utc_iso(self._clock())
            digest = entry_hash(seq, when, kind, logical_job, what, why, stored_detail,
                                prev_hash)
            db.execute(f"INSERT INTO audit ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                       (seq, when, kind, logical_job, what, why, detail_text, prev_hash,
                        digest))
        return Entry(seq, when, kind, logical_job, what, why, stored_detail, prev_hash, digest)

    def head(self) -> tuple[int, str]:
        """(seq, hash) of the last entry; (0, 64 zeros) for an empty log."""
        return self._head(self._db)

    @staticmethod
    def _head(db: sqlite3.Connection) -> tuple[int, str]:
        row = db.execute("SELECT seq, hash FROM audit ORDER BY seq DESC LIMIT 1").fetchone()
        return (0, GENESIS) if row is None else (int(row["seq"]), str(row["hash"]))

    def entries(self, logical_job: str | None = None, since_seq: int = 0,
                kind: str | None = None) -> list[Entry]:
        """Entries after `since_seq`, oldest first; only `logical_job`'s, or only those of
        `kind`, when given."""
        sql = f"SELECT {_COLUMNS} FROM audit WHERE seq > ?"
        args: list[Any] = [since_seq]
        if logical_job is not None:
            sql += " AND logical_job = ?"
            args.append(logical_job)
        if kind is not None:
            sql += " AND kind = ?"
            args.append(kind)
        try:
            rows = self._db.execute(sql + " ORDER BY seq", args)
            return [entry_from_row(row) for row in rows]
        except ValueError as exc:
            raise AuditError(f"audit log {self.path}: an entry's {exc}; run `slurm-geo "
                             "audit verify`") from None
        except sqlite3.DatabaseError as exc:  # locked past the timeout, a damaged page
            raise AuditError(f"cannot read audit log {self.path}: {exc}") from None

    def verify(self, expected_head: tuple[int, str] | None = None) -> VerifyReport:
        """Recompute the chain; see the module docstring for what it can and cannot show."""
        checker = ChainChecker(expected_head)
        try:
            for row in self._db.execute(f"SELECT {_COLUMNS} FROM audit ORDER BY seq"):
                checker.feed(row)
        except sqlite3.DatabaseError as exc:
            raise AuditError(f"cannot read audit log {self.path}: {exc}") from None
        return checker.report()


def entry_from_row(row: Mapping[str, Any]) -> Entry:
    try:
        detail = json.loads(row["detail"])
    except (TypeError, json.JSONDecodeError):
        raise ValueError("detail is not JSON") from None
    return Entry(row["seq"], row["time"], row["kind"], row["logical_job"], row["what"],
                 row["why"], detail, row["prev_hash"], row["hash"])


class ChainChecker:
    """Feeds on rows in seq order; remembers the first problem and the expected head's
    hash as stored, if the log reaches it. The log in etcd (federation.etcd.audit) feeds
    it too."""

    def __init__(self, expected_head: tuple[int, str] | None) -> None:
        self.expected = expected_head
        self.count = 0
        self.last: tuple[int, str] = (0, GENESIS)
        self.bad: tuple[int, str] | None = None
        self.at_expected: str | None = None

    def feed(self, row: Mapping[str, Any]) -> None:
        self.count += 1
        if self.bad is None:
            self.bad = self._problem(row)
        self.last = (row["seq"], row["hash"])
        if self.expected is not None and row["seq"] == self.expected[0]:
            self.at_expected = row["hash"]

    def unreadable(self, seq: int, problem: str) -> None:
        """Entry `seq` is there but cannot be read (a value that does not open)."""
        self.count += 1
        if self.bad is None:
            self.bad = self._gap(seq) or (seq, f"entry {seq} {problem}")
        self.last = (seq, "")

    def _gap(self, seq: int) -> tuple[int, str] | None:
        prev_seq = self.last[0]
        if seq == prev_seq + 1:
            return None
        return prev_seq + 1, (f"entry {prev_seq + 1} is missing (the next is {seq}): "
                              "entries were deleted")

    def _problem(self, row: Mapping[str, Any]) -> tuple[int, str] | None:
        prev_seq, prev_hash = self.last
        seq = row["seq"]
        gap = self._gap(seq)
        if gap is not None:
            return gap
        try:
            entry = entry_from_row(row)
            canonical = canonical_json(entry.detail) == row["detail"]
        except ValueError as exc:
            return seq, f"entry {seq}: {exc}"
        if not canonical:
            return seq, f"entry {seq}: detail is not in canonical form: it was edited"
        recomputed = entry_hash(seq, entry.time, entry.kind, entry.logical_job, entry.what,
                                entry.why, entry.detail, entry.prev_hash)
        if recomputed != entry.hash:
            return seq, f"entry {seq} does not match its hash: it was altered"
        if entry.prev_hash != prev_hash:
            if seq == 1:
                return 1, "entry 1 does not start the chain (prev_hash is not 64 zeros)"
            return prev_seq, (f"entry {seq} does not link to entry {prev_seq}: entry "
                              f"{prev_seq} was rewritten with a recomputed hash (or entry "
                              f"{seq}'s link was)")
        return None

    def _head_problem(self) -> tuple[int, str] | None:
        if self.expected is None or self.expected[0] == 0:
            return None
        seq, digest = self.expected
        last = self.last[0]
        if seq > last:
            return last + 1, (f"the log ends at entry {last} but the head kept elsewhere is "
                              f"entry {seq}: entries {last + 1} to {seq} were cut off")
        if self.at_expected != digest:
            return seq, (f"entry {seq}'s hash differs from the head kept elsewhere: history "
                         "up to it was rewritten")
        return None

    def report(self) -> VerifyReport:
        bad = self.bad or self._head_problem()
        if bad is None:
            return VerifyReport(True, self.count, head=self.last)
        return VerifyReport(False, self.count, bad[0], bad[1], head=self.last)
