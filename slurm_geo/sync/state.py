"""checkpoint-sync's state: one SQLite database (WAL), one row per (checkpoint, destination).

The replication lifecycle, enforced by `StateDB` on every status change:

    discovered --> PENDING <-------------------------------+--------------+
                   |   ^  \\                                |              |
        attempt    |   |   '--> SKIPPED (retention tier 2  | sync retry   | sync retry, or
        starts     |   |        no longer wants it; back   |              | the scrub's repair
                   v   |        to PENDING if it does)     |              | (the source still
                UPLOADING --(attempts exhausted)--------> FAILED        CORRUPTED  has it)
                   |   (outage, fault with attempts left,  ^              ^  ^  ^
                   |    a put the destination holds other  |              |  |  |
                   |    bytes of, clean stop, crash        |              |  |  |
                   |    recovery: back to PENDING)         |              |  |  |
                   +--(a pack fails its hash at the source)--------------+  |  |
                   v                                       |                 |  |
                REPLICATED --(verification attempts       -+                 |  |
                   |          exhausted)                                     |  |
                   +--(the same, found when the copy is checked again)------+  |
                   v                                                            |
                VERIFIED --(the scrub finds damage)-----------------------------+
                           (the only status a resume is ever offered from)

Verified means verified as written (docs/checkpoint-sync.md, "What verified proves"):
every object put was checked against the digest the destination keeps of it; nothing
is read back.

Every status change is a compare-and-set on the row's current status, so the daemon, its
worker thread and `slurm-geo sync retry` never overwrite each other's moves. Transfers
(one row per object put, plus one per verification read-back) are what billing reads.

`sources` is not a lifecycle but an observation: one row per place the daemon reads from
(a configured root, a registered job's checkpoint directory, the job registry) saying what
its last scan saw there, so that `sync status` can name a directory that cannot be
replicated. The scrub (slurm_geo.sync.scrub) keeps, per replica, when it last re-read it
(`scrubbed_at`), the bytes it read (`scrubbed_bytes`), the damage it found
(`scrub_findings`) and the repairs that verified again (`repairs`; `repairing` while one is
under way). Only the daemon writes it, whole rows, when what it saw changes.
Times are Unix seconds (REAL).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from sqlite_utils import Database

from slurm_geo.errors import SlurmGeoError
from slurm_geo.exitcodes import ExitCode
from slurm_geo.lifecycle import Lifecycle
from slurm_geo.sqlite_tx import newer_schema, open_database, settle_schema
from slurm_geo.sync.jobdirs import SourceStatus

SCHEMA_VERSION = 2  # 2: the scrub's columns, added to a version 1 table on open
BUSY_TIMEOUT_S = 10.0


class Status(Enum):
    PENDING = "pending"
    UPLOADING = "uploading"
    REPLICATED = "replicated"
    VERIFIED = "verified"
    CORRUPTED = "corrupted"
    FAILED = "failed"
    SKIPPED = "skipped"

    def is_terminal(self) -> bool:
        """The daemon moves it no further by itself (an admin may retry it)."""
        return self in _TERMINAL


_TERMINAL = {Status.VERIFIED, Status.CORRUPTED, Status.FAILED, Status.SKIPPED}

TRANSITIONS: dict[Status, frozenset[Status]] = {
    Status.PENDING: frozenset({Status.UPLOADING, Status.SKIPPED}),
    Status.UPLOADING: frozenset({Status.REPLICATED, Status.PENDING, Status.FAILED,
                                 Status.CORRUPTED}),
    Status.REPLICATED: frozenset({Status.VERIFIED, Status.CORRUPTED, Status.FAILED}),
    Status.VERIFIED: frozenset({Status.CORRUPTED}),
    Status.CORRUPTED: frozenset({Status.PENDING}),
    Status.FAILED: frozenset({Status.PENDING}),
    Status.SKIPPED: frozenset({Status.PENDING}),
}
ACTIVE = (Status.PENDING, Status.UPLOADING, Status.REPLICATED)  # the queue


@dataclass(frozen=True)
class Source:
    """One row of `sources` (what its status means: `SourceStatus`). `kind` is "root" (a
    [sync] root), "job" (a registered job's --geo-ckpt-dir, named file://<real path>) or
    "registry"; `jobs` and `users` are those of the registered jobs that named it, newest
    first; `scanned_at`, when a good scan of it began (kept to the nearest few minutes: it
    only decides when a finished job's directory is let go)."""

    root: str
    kind: str
    path: str
    status: SourceStatus
    jobs: tuple[str, ...] = ()
    users: tuple[str, ...] = ()
    detail: str | None = None
    since: float = 0.0
    scanned_at: float | None = None

    def same_as(self, other: Source | None) -> bool:
        """Whether `other` saw the same (`since` and `scanned_at` aside)."""
        return other is not None and (self.kind, self.path, self.status, self.jobs,
                                      self.users, self.detail) == (
            other.kind, other.path, other.status, other.jobs, other.users, other.detail)


class SyncError(SlurmGeoError):
    """The sync state database cannot be used as asked."""

    exit_code = ExitCode.SYNC_STATE


class IllegalTransition(SyncError):
    def __init__(self, replica_id: int, current: Status, wanted: Status):
        self.current, self.wanted = current, wanted
        super().__init__(f"replica {replica_id}: {current.value} -> {wanted.value} is not a "
                         "transition of the replication lifecycle")


class StaleStatus(SyncError):
    """The row changed under us (another process moved it first)."""

    def __init__(self, replica_id: int, expected: Status):
        super().__init__(f"replica {replica_id} is no longer {expected.value}")


LIFECYCLE: Lifecycle[Status, int] = Lifecycle(Status, TRANSITIONS, IllegalTransition)


@dataclass(frozen=True)
class Replica:
    """One row of `replicas`: a checkpoint at one destination."""

    id: int
    root: str
    run: str
    step: int
    destination: str
    sequence: int
    status: Status
    promoted: bool
    manifest_sha256: str | None
    bytes: int
    attempts: int
    failures: int
    charged: int
    outages: int
    corruptions: int
    created_at: float | None
    discovered_at: float
    started_at: float | None
    replicated_at: float | None
    verified_at: float | None
    next_attempt_at: float
    lag_s: float | None
    last_error: str | None
    scrubbed_at: float | None = None
    scrubbed_bytes: int = 0
    scrub_findings: int = 0
    repairs: int = 0
    repairing: bool = False

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Replica:
        values = {name: row[name] for name in cls.__dataclass_fields__}
        values["status"] = Status(row["status"])
        values["promoted"] = bool(row["promoted"])
        values["repairing"] = bool(row["repairing"])
        return cls(**values)


_REPLICA_COLUMNS: dict[str, type] = {
    "id": int, "root": str, "run": str, "step": int, "destination": str, "sequence": int,
    "status": str, "promoted": int, "manifest_sha256": str, "bytes": int, "attempts": int,
    "failures": int, "charged": int, "outages": int, "corruptions": int, "created_at": float,
    "discovered_at": float, "started_at": float, "replicated_at": float,
    "verified_at": float, "next_attempt_at": float, "lag_s": float, "last_error": str,
    "updated_at": float, "scrubbed_at": float, "scrubbed_bytes": int, "scrub_findings": int,
    "repairs": int, "repairing": int,
}
_SCRUB_COUNTERS = ("scrubbed_bytes", "scrub_findings", "repairs", "repairing")
_TRANSFER_COLUMNS: dict[str, type] = {
    "id": int, "replica_id": int, "run": str, "step": int, "object": str, "kind": str,
    "bytes": int, "source": str, "destination": str, "source_region": str,
    "destination_region": str, "started_at": float, "finished_at": float,
}
_SOURCES = """CREATE TABLE IF NOT EXISTS sources (
    root TEXT PRIMARY KEY, kind TEXT NOT NULL, path TEXT NOT NULL, status TEXT NOT NULL,
    jobs TEXT NOT NULL, users TEXT NOT NULL, detail TEXT, since REAL NOT NULL,
    scanned_at REAL)"""
_COUNTERS = ("bytes", "attempts", "failures", "charged", "outages", "corruptions")


class StateDB:
    """The state database at `path`; one instance per thread (SQLite connections are not
    shared between threads). `readonly` opens an existing database without creating it."""

    def __init__(self, path: Path, readonly: bool = False):
        self.path = Path(path)
        conn = open_database(self.path, readonly=readonly, timeout_s=BUSY_TIMEOUT_S,
                             missing=lambda: SyncError(
                                 f"no sync state database at {self.path}; is checkpoint-sync "
                                 "running there? (see [sync] state in the config)"))
        self.db = Database(conn)
        settle_schema(conn, readonly=readonly, refuse_newer=self._refuse_newer,
                      create=self._create_schema)

    def close(self) -> None:
        self.db.conn.close()

    def _refuse_newer(self) -> None:
        """Before anything changes the file: a state a newer checkpoint-sync wrote is
        refused (this one would otherwise number it down)."""
        found = newer_schema(self.db.conn, SCHEMA_VERSION)
        if found is not None:
            raise SyncError(f"the sync state {self.path} is schema version {found}, written "
                            f"by a newer slurm-geo (this one reads {SCHEMA_VERSION}); upgrade "
                            "slurm-geo on this host")

    def _create_schema(self) -> None:
        self._refuse_newer()
        self.db.enable_wal()
        self.db.execute("PRAGMA synchronous = FULL")  # a committed move survives power loss
        with self.db.conn:
            replicas = self.db["replicas"]
            replicas.create(_REPLICA_COLUMNS, pk="id", if_not_exists=True,  # type: ignore[union-attr]
                            not_null={"root", "run", "step", "destination", "status"},
                            defaults={c: 0 for c in (*_COUNTERS, *_SCRUB_COUNTERS,
                                                     "promoted", "next_attempt_at")})
            self._add_scrub_columns()
            replicas.create_index(["root", "run", "destination", "step"],  # type: ignore[union-attr]
                                  unique=True, if_not_exists=True)
            replicas.create_index(["status"], if_not_exists=True)  # type: ignore[union-attr]
            replicas.create_index(["run", "destination"], if_not_exists=True)  # type: ignore[union-attr]
            transfers = self.db["transfers"]
            transfers.create(_TRANSFER_COLUMNS, pk="id", if_not_exists=True)  # type: ignore[union-attr]
            transfers.create_index(["replica_id"], if_not_exists=True)  # type: ignore[union-attr]
            self.db.execute(_SOURCES)
            self.db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)")
            self.db.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)",
                            [str(SCHEMA_VERSION)])

    def _add_scrub_columns(self) -> None:
        """A version 1 table gains the scrub's columns, counters starting at 0."""
        present = self.db["replicas"].columns_dict
        for column in ("scrubbed_at", *_SCRUB_COUNTERS):
            if column not in present:
                default = None if column == "scrubbed_at" else 0
                self.db["replicas"].add_column(  # type: ignore[union-attr]
                    column, _REPLICA_COLUMNS[column], not_null_default=default)

    # --- reading ------------------------------------------------------------------------

    def replica(self, replica_id: int) -> Replica:
        rows = list(self.db.query("SELECT * FROM replicas WHERE id = ?", [replica_id]))
        if not rows:
            raise SyncError(f"no replica {replica_id} in {self.path}")
        return Replica.from_row(rows[0])

    def replicas(self, where: str = "1", params: Iterable[Any] = ()) -> list[Replica]:
        sql = f"SELECT * FROM replicas WHERE {where} ORDER BY run, step, destination, root"
        return [Replica.from_row(r) for r in self.db.query(sql, list(params))]

    def for_planning(self, destination: str, runs: Iterable[tuple[str, str, int]]
                     ) -> list[Replica]:
        """The queue of `destination`, and each (root, run)'s rows from step `lowest` up:
        what the planner needs, without the long tail of settled history."""
        active = ", ".join(f"'{s.value}'" for s in ACTIVE)
        found = {r.id: r for r in self.replicas(
            f"destination = ? AND status IN ({active})", [destination])}
        for root, run, lowest in runs:
            found.update((r.id, r) for r in self.replicas(
                "destination = ? AND root = ? AND run = ? AND step >= ?",
                [destination, root, run, lowest]))
        return sorted(found.values(), key=lambda r: (r.root, r.run, r.step))

    def max_sequences(self, destination: str) -> dict[tuple[str, str], int]:
        rows = self.db.query("SELECT root, run, MAX(sequence) AS top FROM replicas "
                             "WHERE destination = ? GROUP BY root, run", [destination])
        return {(r["root"], r["run"]): r["top"] for r in rows}

    def newest_verified(self, run: str, destination: str) -> int | None:
        """The step a resume may be offered at `destination`: never a corrupted one."""
        rows = list(self.db.query(
            "SELECT MAX(step) AS step FROM replicas WHERE run = ? AND destination = ? "
            "AND status = ?", [run, destination, Status.VERIFIED.value]))
        return rows[0]["step"] if rows else None

    def transfers(self, replica_id: int | None = None) -> list[dict[str, Any]]:
        if replica_id is None:
            return list(self.db.query("SELECT * FROM transfers ORDER BY id"))
        return list(self.db.query("SELECT * FROM transfers WHERE replica_id = ? ORDER BY id",
                                  [replica_id]))

    def transferred_bytes(self, replica_id: int) -> int:
        rows = list(self.db.query("SELECT COALESCE(SUM(bytes), 0) AS n FROM transfers WHERE "
                                  "replica_id = ? AND kind != 'verify'", [replica_id]))
        return int(rows[0]["n"])

    def sources(self) -> list[Source]:
        """Every row of `sources`, by root; none in a database from before the table."""
        if not self.db["sources"].exists():
            return []
        return [Source(row["root"], row["kind"], row["path"], SourceStatus(row["status"]),
                       tuple(json.loads(row["jobs"])), tuple(json.loads(row["users"])),
                       row["detail"], row["since"], row["scanned_at"])
                for row in self.db.query("SELECT * FROM sources ORDER BY root")]

    def first_roots(self, runs: Iterable[str], destination: str) -> dict[str, str]:
        """The root each of `runs` was first replicated from to `destination` (runs never
        replicated there are left out)."""
        found = {}
        for run in sorted(set(runs)):
            rows = list(self.db.query("SELECT root FROM replicas WHERE run = ? AND "
                                      "destination = ? ORDER BY id LIMIT 1", [run, destination]))
            if rows:
                found[run] = rows[0]["root"]
        return found

    def owed_roots(self, destination: str) -> set[str]:
        """Roots with replicas still to copy or verify at `destination`."""
        active = ", ".join(f"'{s.value}'" for s in ACTIVE)
        return {row["root"] for row in self.db.query(
            f"SELECT DISTINCT root FROM replicas WHERE destination = ? AND status IN ({active})",
            [destination])}

    def query(self, sql: str, params: Iterable[Any] = ()) -> Iterator[dict[str, Any]]:
        return self.db.query(sql, list(params))

    # --- writing ------------------------------------------------------------------------

    def add(self, rows: Iterable[dict[str, Any]], now: float) -> list[int]:
        """Insert newly discovered replicas (root, run, step, destination, sequence, status,
        promoted); rows already there are left alone."""
        ids = []
        with self.db.conn:
            for row in rows:
                Status(row["status"])  # only lifecycle values reach the table
                cursor = self.db.execute(
                    "INSERT OR IGNORE INTO replicas (root, run, step, destination, sequence, "
                    "status, promoted, created_at, discovered_at, updated_at) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    [row["root"], row["run"], row["step"], row["destination"], row["sequence"],
                     row["status"], int(row.get("promoted", False)), row.get("created_at"),
                     now, now])
                if cursor.rowcount:
                    ids.append(int(cursor.lastrowid or 0))
        return ids

    def move(self, replica_id: int, expected: Status, wanted: Status, now: float,
             **changes: Any) -> None:
        """Change status `expected` -> `wanted` (an allowed transition) and set `changes`;
        raises StaleStatus if the row is no longer `expected`. Counters in `changes` given
        as ("+", n) are added to."""
        LIFECYCLE.check(replica_id, expected, wanted)
        self.update(replica_id, expected, now, status=wanted.value, **changes)

    def update(self, replica_id: int, expected: Status, now: float, **changes: Any) -> None:
        """Set `changes` on a row that is still `expected`, status unchanged unless given."""
        assignments, params = [], []
        for column, value in {**changes, "updated_at": now}.items():
            if column not in _REPLICA_COLUMNS or column == "id":
                raise ValueError(f"no column {column!r}")
            if isinstance(value, tuple) and value[:1] == ("+",):
                assignments.append(f"{column} = {column} + ?")
                params.append(value[1])
            else:
                assignments.append(f"{column} = ?")
                params.append(value)
        with self.db.conn:
            cursor = self.db.execute(
                f"UPDATE replicas SET {', '.join(assignments)} WHERE id = ? AND status = ?",
                [*params, replica_id, expected.value])
        if cursor.rowcount != 1:
            raise StaleStatus(replica_id, expected)

    def mark(self, key: str) -> str | None:
        """A value the daemon keeps across restarts (`meta`), None when never set."""
        rows = list(self.db.query("SELECT value FROM meta WHERE key = ?", [key]))
        return rows[0]["value"] if rows else None

    def set_mark(self, key: str, value: str) -> None:
        with self.db.conn:
            self.db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", [key, value])

    def record_sources(self, sources: Iterable[Source]) -> None:
        """Write these rows of `sources` whole, in one transaction."""
        with self.db.conn:
            for source in sources:
                self.db.execute(
                    "INSERT OR REPLACE INTO sources (root, kind, path, status, jobs, users, "
                    "detail, since, scanned_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    [source.root, source.kind, source.path, source.status.value,
                     json.dumps(list(source.jobs)), json.dumps(list(source.users)),
                     source.detail, source.since, source.scanned_at])

    def record_transfer(self, replica: Replica, row: dict[str, Any]) -> None:
        """One object moved for `replica`: object, kind, bytes, source(_region),
        destination_region, started_at, finished_at."""
        with self.db.conn:
            self.db["transfers"].insert(  # type: ignore[union-attr]
                {"replica_id": replica.id, "run": replica.run, "step": replica.step,
                 "destination": replica.destination, **row})

    def recover_interrupted(self, now: float, max_attempts: int) -> list[Replica]:
        """After a stop or crash: every UPLOADING row goes back to PENDING (the attempt
        counts: a checkpoint that keeps crashing the daemon must end up FAILED)."""
        interrupted = self.replicas("status = ?", [Status.UPLOADING.value])
        for replica in interrupted:
            exhausted = replica.charged + 1 >= max_attempts
            wanted = Status.FAILED if exhausted else Status.PENDING
            self.move(replica.id, Status.UPLOADING, wanted, now, failures=("+", 1),
                      charged=("+", 1), next_attempt_at=now,
                      last_error="the attempt was cut short (the daemon stopped or crashed)")
        return interrupted

    def requeue(self, run: str, destination: str | None, now: float) -> list[Replica]:
        """`sync retry`: FAILED and CORRUPTED replicas of `run` go back to PENDING with a
        fresh budget of attempts."""
        where = "run = ? AND status IN (?, ?)"
        params: list[Any] = [run, Status.FAILED.value, Status.CORRUPTED.value]
        if destination is not None:
            where += " AND destination = ?"
            params.append(destination)
        requeued = []
        for replica in self.replicas(where, params):
            try:
                self.move(replica.id, replica.status, Status.PENDING, now, charged=0,
                          next_attempt_at=now, last_error=None)
            except StaleStatus:
                continue
            requeued.append(replica)
        return requeued
