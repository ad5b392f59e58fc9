"""The federation daemon's SQLite state: logical jobs, their incarnations, leases, tokens,
cluster health and bandwidth estimates.

A *logical job* is what the user submitted once on the home cluster. Each time the daemon
moves it, its *generation* goes up by one and it runs as a new Slurm job on another
cluster (an *incarnation*). Only the current generation holds a training lease; that is
what keeps two incarnations from ever training at once.

Every write is one transaction (WAL mode, BEGIN IMMEDIATE), so the daemon can be killed at
any point and rebuild its view from this file, Slurm and the stores (crash-only).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from slurm_geo.errors import SlurmGeoError
from slurm_geo.sqlite_tx import immediate_transaction

BUSY_TIMEOUT_S = 30.0

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    logical_job TEXT PRIMARY KEY,
    run TEXT NOT NULL,
    home TEXT NOT NULL,
    script TEXT NOT NULL,
    spec TEXT NOT NULL,            -- JSON: what a resubmission needs besides the script
    directives TEXT NOT NULL,      -- JSON: the --geo-* options
    generation INTEGER NOT NULL,
    cluster TEXT NOT NULL,         -- where the current generation runs
    job_id INTEGER,                -- its Slurm job id there; NULL while moving
    resume_step INTEGER,
    status TEXT NOT NULL,
    move_to TEXT,                  -- a planned move waiting for the next checkpoint
    move_after_step INTEGER,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS incarnations (
    logical_job TEXT NOT NULL,
    generation INTEGER NOT NULL,
    cluster TEXT NOT NULL,
    job_id INTEGER,
    resume_step INTEGER,
    submitted_at REAL NOT NULL,
    training_at REAL,              -- first lease granted: training started
    ended_at REAL,
    end_reason TEXT,
    PRIMARY KEY (logical_job, generation)
);
CREATE TABLE IF NOT EXISTS leases (
    logical_job TEXT PRIMARY KEY,
    generation INTEGER NOT NULL,
    cluster TEXT NOT NULL,
    job_id INTEGER NOT NULL,
    restart INTEGER NOT NULL,
    renewed_at REAL NOT NULL,
    last_step INTEGER,
    released INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS tokens (
    token_sha256 TEXT PRIMARY KEY,
    logical_job TEXT NOT NULL,
    generation INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS health (
    cluster TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    failures INTEGER NOT NULL,
    since REAL NOT NULL,
    last_ok REAL,
    last_error TEXT
);
CREATE TABLE IF NOT EXISTS bandwidth (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    snapshot TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


class JobStatus(Enum):
    RUNNING = "running"      # the current generation is queued or running on `cluster`
    MOVING = "moving"        # a new generation is being placed; no lease is granted
    COMPLETED = "completed"
    FAILED = "failed"

    def is_final(self) -> bool:
        return self in (JobStatus.COMPLETED, JobStatus.FAILED)


class UnknownLogicalJob(SlurmGeoError):
    exit_code = 2

    def __init__(self, name: str):
        super().__init__(f"no logical job '{name}' in the federation state; `slurm-geo status` "
                         "without an argument lists them")


@dataclass(frozen=True)
class LogicalJob:
    logical_job: str
    run: str
    home: str
    script: str
    spec: dict[str, Any]
    directives: dict[str, str]
    generation: int
    cluster: str
    job_id: int | None
    resume_step: int | None
    status: JobStatus
    move_to: str | None
    move_after_step: int | None
    created_at: float
    updated_at: float

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> LogicalJob:
        return cls(row["logical_job"], row["run"], row["home"], row["script"],
                   json.loads(row["spec"]), json.loads(row["directives"]), row["generation"],
                   row["cluster"], row["job_id"], row["resume_step"], JobStatus(row["status"]),
                   row["move_to"], row["move_after_step"], row["created_at"], row["updated_at"])


@dataclass(frozen=True)
class Incarnation:
    logical_job: str
    generation: int
    cluster: str
    job_id: int | None
    resume_step: int | None
    submitted_at: float
    training_at: float | None
    ended_at: float | None
    end_reason: str | None


@dataclass(frozen=True)
class Lease:
    logical_job: str
    generation: int
    cluster: str
    job_id: int
    restart: int
    renewed_at: float
    last_step: int | None
    released: bool

    def expired(self, now: float, ttl_s: float) -> bool:
        return self.released or now - self.renewed_at > ttl_s


@dataclass(frozen=True)
class Health:
    cluster: str
    status: str  # "up" or "out"
    failures: int
    since: float
    last_ok: float | None
    last_error: str | None


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class FederationState:
    """All reads and writes of the state database. Thread-safe: the lease service and the
    daemon loop share one instance."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.RLock()
        self.db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None,
                                  check_same_thread=False)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        with self._lock:
            self.db.executescript(SCHEMA)  # idempotent: every statement is IF NOT EXISTS

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock, immediate_transaction(self.db) as db:
            yield db

    # --- logical jobs ---------------------------------------------------------------------

    def add_job(self, job: LogicalJob) -> None:
        with self.transaction() as db:
            db.execute(
                "INSERT INTO jobs VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (job.logical_job, job.run, job.home, job.script, json.dumps(job.spec),
                 json.dumps(job.directives), job.generation, job.cluster, job.job_id,
                 job.resume_step, job.status.value, job.move_to, job.move_after_step,
                 job.created_at, job.updated_at))
            db.execute("INSERT INTO incarnations VALUES (?,?,?,?,?,?,?,?,?)",
                       (job.logical_job, job.generation, job.cluster, job.job_id,
                        job.resume_step, job.created_at, None, None, None))

    def job(self, logical_job: str) -> LogicalJob:
        with self._lock:
            row = self.db.execute("SELECT * FROM jobs WHERE logical_job = ?",
                                  (logical_job,)).fetchone()
        if row is None:
            raise UnknownLogicalJob(logical_job)
        return LogicalJob.from_row(row)

    def find_job(self, cluster: str, job_id: int) -> LogicalJob | None:
        """The logical job whose incarnation is Slurm job `job_id` on `cluster`."""
        with self._lock:
            row = self.db.execute(
                "SELECT j.* FROM jobs j JOIN incarnations i USING (logical_job) "
                "WHERE i.cluster = ? AND i.job_id = ?", (cluster, job_id)).fetchone()
        return None if row is None else LogicalJob.from_row(row)

    def jobs(self, active_only: bool = False) -> list[LogicalJob]:
        where = "WHERE status NOT IN ('completed', 'failed')" if active_only else ""
        with self._lock:
            rows = self.db.execute(f"SELECT * FROM jobs {where} ORDER BY created_at").fetchall()
        return [LogicalJob.from_row(r) for r in rows]

    def update_job(self, logical_job: str, now: float, **changes: Any) -> LogicalJob:
        if "status" in changes and isinstance(changes["status"], JobStatus):
            changes["status"] = changes["status"].value
        columns = ", ".join(f"{name} = ?" for name in changes)
        with self.transaction() as db:
            db.execute(f"UPDATE jobs SET {columns}, updated_at = ? WHERE logical_job = ?",
                       (*changes.values(), now, logical_job))
        return self.job(logical_job)

    def begin_generation(self, logical_job: str, generation: int, cluster: str,
                         resume_step: int | None, now: float) -> LogicalJob:
        """Make `generation` current (status moving, no job id yet): from here on every
        lease request of an older generation is refused."""
        with self.transaction() as db:
            current = db.execute("SELECT generation FROM jobs WHERE logical_job = ?",
                                 (logical_job,)).fetchone()
            if current is None or current["generation"] >= generation:
                raise SlurmGeoError(f"logical job {logical_job} is already at generation "
                                    f"{current and current['generation']}")
            db.execute("UPDATE jobs SET generation = ?, cluster = ?, job_id = NULL, "
                       "resume_step = ?, status = 'moving', move_to = NULL, "
                       "move_after_step = NULL, updated_at = ? WHERE logical_job = ?",
                       (generation, cluster, resume_step, now, logical_job))
            db.execute("INSERT INTO incarnations VALUES (?,?,?,?,?,?,?,?,?)",
                       (logical_job, generation, cluster, None, resume_step, now, None, None,
                        None))
            db.execute("DELETE FROM tokens WHERE logical_job = ?", (logical_job,))
        return self.job(logical_job)

    def submitted(self, logical_job: str, generation: int, job_id: int, token_sha256: str,
                  now: float) -> LogicalJob:
        with self.transaction() as db:
            db.execute("UPDATE jobs SET job_id = ?, status = 'running', updated_at = ? "
                       "WHERE logical_job = ? AND generation = ?",
                       (job_id, now, logical_job, generation))
            db.execute("UPDATE incarnations SET job_id = ? WHERE logical_job = ? AND "
                       "generation = ?", (job_id, logical_job, generation))
            db.execute("INSERT OR REPLACE INTO tokens VALUES (?,?,?)",
                       (token_sha256, logical_job, generation))
        return self.job(logical_job)

    # --- incarnations ---------------------------------------------------------------------

    def incarnations(self, logical_job: str) -> list[Incarnation]:
        with self._lock:
            rows = self.db.execute("SELECT * FROM incarnations WHERE logical_job = ? "
                                   "ORDER BY generation", (logical_job,)).fetchall()
        return [Incarnation(**dict(r)) for r in rows]

    def end_incarnation(self, logical_job: str, generation: int, reason: str,
                        now: float) -> None:
        with self.transaction() as db:
            db.execute("UPDATE incarnations SET ended_at = ?, end_reason = ? WHERE "
                       "logical_job = ? AND generation = ? AND ended_at IS NULL",
                       (now, reason, logical_job, generation))
            db.execute("DELETE FROM tokens WHERE logical_job = ? AND generation = ?",
                       (logical_job, generation))

    # --- leases and tokens ----------------------------------------------------------------

    def lease(self, logical_job: str) -> Lease | None:
        with self._lock:
            row = self.db.execute("SELECT * FROM leases WHERE logical_job = ?",
                                  (logical_job,)).fetchone()
        return None if row is None else Lease(**{**dict(row), "released": bool(row["released"])})

    def put_lease(self, lease: Lease, first_for_generation: bool) -> None:
        with self.transaction() as db:
            db.execute("INSERT OR REPLACE INTO leases VALUES (?,?,?,?,?,?,?,?)",
                       (lease.logical_job, lease.generation, lease.cluster, lease.job_id,
                        lease.restart, lease.renewed_at, lease.last_step, int(lease.released)))
            if first_for_generation:
                db.execute("UPDATE incarnations SET training_at = ? WHERE logical_job = ? AND "
                           "generation = ? AND training_at IS NULL",
                           (lease.renewed_at, lease.logical_job, lease.generation))

    def refresh_leases(self, now: float) -> None:
        """After a restart nobody knows who renewed while the daemon was down: every live
        lease counts as renewed now, so no move starts before it could have run out."""
        with self.transaction() as db:
            db.execute("UPDATE leases SET renewed_at = ? WHERE released = 0", (now,))

    def token_owner(self, token: str) -> tuple[str, int] | None:
        with self._lock:
            row = self.db.execute("SELECT logical_job, generation FROM tokens WHERE "
                                  "token_sha256 = ?", (token_digest(token),)).fetchone()
        return None if row is None else (row["logical_job"], row["generation"])

    # --- health and bandwidth -------------------------------------------------------------

    def health(self) -> dict[str, Health]:
        with self._lock:
            rows = self.db.execute("SELECT * FROM health").fetchall()
        return {r["cluster"]: Health(**dict(r)) for r in rows}

    def put_health(self, health: Health) -> None:
        with self.transaction() as db:
            db.execute("INSERT OR REPLACE INTO health VALUES (?,?,?,?,?,?)",
                       (health.cluster, health.status, health.failures, health.since,
                        health.last_ok, health.last_error))

    def bandwidth_snapshot(self) -> list[dict[str, Any]]:
        with self._lock:
            row = self.db.execute("SELECT snapshot FROM bandwidth WHERE id = 1").fetchone()
        return [] if row is None else json.loads(row["snapshot"])

    def put_bandwidth_snapshot(self, rows: list[dict[str, Any]]) -> None:
        with self.transaction() as db:
            db.execute("INSERT OR REPLACE INTO bandwidth VALUES (1, ?)", (json.dumps(rows),))

    def meta(self, key: str) -> str | None:
        with self._lock:
            row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else row["value"]

    def put_meta(self, key: str, value: str) -> None:
        with self.transaction() as db:
            db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))
