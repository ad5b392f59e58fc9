"""The federation daemon's SQLite state: logical jobs, their incarnations, leases, tokens,
cluster health and bandwidth estimates (the types and the lifecycle: federation.model).

Every write is one transaction (WAL mode, BEGIN IMMEDIATE), so the daemon can be killed at
any point and rebuild its view from this file, Slurm and the stores (crash-only). Status
changes and generation bumps are compare-and-set on what the writer last saw, so the
daemon, `slurm-geo cancel` and `slurm-geo approve` never overwrite each other.

The schema and its migrations are in federation.schema (version 3: each job's owner and
their allow-listed environment; version 4: incarnation secrets, used tokens; version 5:
runs an admin gave to an owner); who is who (owners claimed, runs assigned, secrets, key
tokens) in federation.identities.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from slurm_geo.federation.model import (
    LIFECYCLE,
    ClusterStatus,
    FederationStateError,
    Health,
    Incarnation,
    IncarnationEnd,
    JobStatus,
    Lease,
    LeftHome,
    LogicalJob,
    StaleJob,
    UnknownLogicalJob,
)
from slurm_geo.federation.state.identities import Identities, forget_incarnation, put_token
from slurm_geo.federation.state.schema import (
    SCHEMA_VERSION,
    check_version,
    create_or_migrate,
    refuse_newer,
)
from slurm_geo.private import private_database
from slurm_geo.slurm.models import Owner
from slurm_geo.sqlite_tx import immediate_transaction, open_database

__all__ = ["SCHEMA_VERSION", "FederationState"]

BUSY_TIMEOUT_S = 30.0


def _job_from_row(row: sqlite3.Row) -> LogicalJob:
    owner = None
    if row["owner_user"] is not None and None not in (row["owner_uid"], row["owner_gid"]):
        owner = Owner(row["owner_user"], row["owner_uid"], row["owner_gid"])
    return LogicalJob(
        logical_job=row["logical_job"], run=row["run"], home=row["home"], script=row["script"],
        spec=json.loads(row["spec"]), directives=json.loads(row["directives"]),
        generation=row["generation"], cluster=row["cluster"], job_id=row["job_id"],
        resume_step=row["resume_step"], status=JobStatus(row["status"]),
        move_to=row["move_to"], move_after_step=row["move_after_step"],
        created_at=row["created_at"], updated_at=row["updated_at"],
        left_home=LeftHome(row["left_home"]) if row["left_home"] else None,
        lost_restarts=row["lost_restarts"], recoveries=row["recoveries"],
        awaiting_approval=row["awaiting_approval"], owner=owner,
        owner_env=json.loads(row["owner_env"]))


def _owner_values(job: LogicalJob) -> tuple[str | None, int | None, int | None, str]:
    owner = job.owner
    return (None if owner is None else owner.user, None if owner is None else owner.uid,
            None if owner is None else owner.gid, json.dumps(job.owner_env))


class FederationState:
    """All reads and writes of the state database. Thread-safe: the lease service and the
    daemon loop share one instance. The file and its directory are private to the
    daemon's account whatever the umask: they hold every job's batch script. `readonly`
    (commands that only look, benchmarks) opens an existing database of this schema
    version without creating or migrating anything."""

    def __init__(self, path: Path, readonly: bool = False):
        self.path = path
        self._lock = threading.RLock()
        if readonly:
            self.db = open_database(path, readonly=True, timeout_s=BUSY_TIMEOUT_S,
                                    missing=lambda: FederationStateError(
                                        f"no federation state at {path}; is the federation "
                                        "daemon running on this host? ([federation] state)"),
                                    isolation_level=None, check_same_thread=False)
            self.db.row_factory = sqlite3.Row
            check_version(self.db, path)
            self.identities = Identities(self.db, self._lock)
            return
        self.db = private_database(path, timeout_s=BUSY_TIMEOUT_S, isolation_level=None,
                                   check_same_thread=False)
        self.db.row_factory = sqlite3.Row
        try:
            refuse_newer(self.db, path)  # before anything changes the file
        except FederationStateError:
            self.db.close()
            raise
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        with self._lock, immediate_transaction(self.db) as db:
            create_or_migrate(db)
        self.identities = Identities(self.db, self._lock)

    def close(self) -> None:
        self.db.close()

    def confirm_leading(self) -> None:
        """Alone on its SQLite state, the daemon always leads (the etcd state asks etcd)."""

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock, immediate_transaction(self.db) as db:
            yield db

    def _one(self, sql: str, params: tuple[Any, ...] = ()) -> sqlite3.Row | None:
        with self._lock:
            row: sqlite3.Row | None = self.db.execute(sql, params).fetchone()
            return row

    # --- logical jobs ---------------------------------------------------------------------

    def add_job(self, job: LogicalJob) -> bool:
        """Register `job` (generation 0 at home); False if it is already known."""
        with self.transaction() as db:
            if db.execute("SELECT 1 FROM jobs WHERE logical_job = ?",
                          (job.logical_job,)).fetchone():
                return False
            db.execute(
                "INSERT INTO jobs (logical_job, run, home, script, spec, directives, "
                "generation, cluster, job_id, resume_step, status, created_at, updated_at, "
                "owner_user, owner_uid, owner_gid, owner_env) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (job.logical_job, job.run, job.home, job.script, json.dumps(job.spec),
                 json.dumps(job.directives), job.generation, job.cluster, job.job_id,
                 job.resume_step, job.status.value, job.created_at, job.updated_at,
                 *_owner_values(job)))
            db.execute("INSERT INTO incarnations VALUES (?,?,?,?,?,?,?,?,?)",
                       (job.logical_job, job.generation, job.cluster, job.job_id,
                        job.resume_step, job.created_at, None, None, None))
        return True

    def job(self, logical_job: str) -> LogicalJob:
        row = self._one("SELECT * FROM jobs WHERE logical_job = ?", (logical_job,))
        if row is None:
            raise UnknownLogicalJob(logical_job)
        return _job_from_row(row)

    def find_job(self, cluster: str, job_id: int) -> LogicalJob | None:
        """The logical job whose incarnation is Slurm job `job_id` on `cluster`."""
        row = self._one("SELECT j.* FROM jobs j JOIN incarnations i USING (logical_job) "
                        "WHERE i.cluster = ? AND i.job_id = ?", (cluster, job_id))
        return None if row is None else _job_from_row(row)

    def find_by_job_id(self, job_id: int) -> list[tuple[str, LogicalJob]]:
        """(cluster, logical job) of each incarnation that is Slurm job `job_id` anywhere."""
        sql = ("SELECT DISTINCT j.*, i.cluster AS here FROM jobs j JOIN incarnations i USING "
               "(logical_job) WHERE i.job_id = ? ORDER BY here, j.created_at")
        with self._lock:
            return [(r["here"], _job_from_row(r)) for r in self.db.execute(sql, (job_id,))]

    def find_by_run(self, run: str) -> list[LogicalJob]:
        with self._lock:
            rows = self.db.execute("SELECT * FROM jobs WHERE run = ? ORDER BY created_at",
                                   (run,)).fetchall()
        return [_job_from_row(r) for r in rows]

    def jobs(self, active_only: bool = False) -> list[LogicalJob]:
        final = tuple(s.value for s in JobStatus if s.is_final())
        where = f"WHERE status NOT IN ({','.join('?' * len(final))})" if active_only else ""
        with self._lock:
            rows = self.db.execute(f"SELECT * FROM jobs {where} ORDER BY created_at",
                                   final if active_only else ()).fetchall()
        return [_job_from_row(r) for r in rows]

    def name_run(self, logical_job: str, run: str, now: float) -> LogicalJob:
        """A job discovered while pending names its run with its first lease request."""
        with self.transaction() as db:
            db.execute("UPDATE jobs SET run = ?, updated_at = ? WHERE logical_job = ? AND "
                       "run = ''", (run, now, logical_job))
        return self.job(logical_job)

    def move_status(self, logical_job: str, expected: JobStatus, wanted: JobStatus,
                    now: float) -> LogicalJob:
        """`expected` -> `wanted`, if that is a transition and the job is still `expected`;
        IllegalTransition or StaleJob otherwise, and nothing is written."""
        with self.transaction() as db:
            _check_status(db, logical_job, expected, wanted)
            db.execute("UPDATE jobs SET status = ?, move_to = NULL, move_after_step = NULL, "
                       "awaiting_approval = NULL, updated_at = ? WHERE logical_job = ?",
                       (wanted.value, now, logical_job))
        return self.job(logical_job)

    def plan_move(self, logical_job: str, generation: int, target: str,
                  after_step: int | None, now: float) -> LogicalJob:
        """A move to `target` at the job's next checkpoint after `after_step` (a failback,
        or a person's approval), if the job is still at `generation`."""
        with self.transaction() as db:
            changed = db.execute(
                "UPDATE jobs SET move_to = ?, move_after_step = ?, awaiting_approval = NULL, "
                "updated_at = ? WHERE logical_job = ? AND generation = ? AND status IN "
                "('running', 'moving')", (target, after_step, now, logical_job, generation))
            if changed.rowcount != 1:
                raise StaleJob(logical_job, f"active at generation {generation}")
        return self.job(logical_job)

    def await_approval(self, logical_job: str, target: str | None, now: float) -> None:
        with self.transaction() as db:
            db.execute("UPDATE jobs SET awaiting_approval = ?, updated_at = ? WHERE "
                       "logical_job = ?", (target, now, logical_job))

    def count_lost_restart(self, logical_job: str, now: float) -> None:
        with self.transaction() as db:
            db.execute("UPDATE jobs SET lost_restarts = lost_restarts + 1, updated_at = ? "
                       "WHERE logical_job = ?", (now, logical_job))

    def reset_lost_restarts(self, logical_job: str, now: float) -> None:
        """A failed job resubmitted gets max_restarts afresh; StaleJob unless still failed."""
        with self.transaction() as db:
            if db.execute("UPDATE jobs SET lost_restarts = 0, updated_at = ? WHERE logical_job "
                          "= ? AND status = 'failed'", (now, logical_job)).rowcount != 1:
                raise StaleJob(logical_job, JobStatus.FAILED.value)

    def begin_generation(self, logical_job: str, expected_generation: int, cluster: str,
                         resume_step: int | None, now: float, *,
                         left_home: LeftHome | None = None, recovery: bool = False,
                         live_lease_ttl_s: float | None = None) -> LogicalJob:
        """Make generation `expected_generation + 1` current on `cluster` (status moving,
        no job id yet): from here on every lease request of an older generation is
        refused. A compare-and-set: StaleJob if the job is no longer at that generation,
        or (with `live_lease_ttl_s`) if its lease was renewed meanwhile."""
        with self.transaction() as db:
            row = db.execute("SELECT status, generation FROM jobs WHERE logical_job = ?",
                             (logical_job,)).fetchone()
            if row is None:
                raise UnknownLogicalJob(logical_job)
            if row["generation"] != expected_generation:
                raise StaleJob(logical_job, f"at generation {expected_generation}")
            LIFECYCLE.check(logical_job, JobStatus(row["status"]), JobStatus.MOVING)
            if live_lease_ttl_s is not None and _lease_live(db, logical_job,
                                                            expected_generation, now,
                                                            live_lease_ttl_s):
                raise StaleJob(logical_job, "without a live lease")
            generation = expected_generation + 1
            db.execute("UPDATE jobs SET generation = ?, cluster = ?, job_id = NULL, "
                       "resume_step = ?, status = 'moving', move_to = NULL, "
                       "move_after_step = NULL, awaiting_approval = NULL, "
                       "left_home = CASE WHEN ? = home THEN NULL ELSE COALESCE(?, left_home) "
                       "END, recoveries = recoveries + ?, updated_at = ? "
                       "WHERE logical_job = ?",
                       (generation, cluster, resume_step, cluster,
                        None if left_home is None else left_home.value, int(recovery), now,
                        logical_job))
            db.execute("INSERT INTO incarnations VALUES (?,?,?,?,?,?,?,?,?)",
                       (logical_job, generation, cluster, None, resume_step, now, None, None,
                        None))
            db.execute("DELETE FROM tokens WHERE logical_job = ?", (logical_job,))
        return self.job(logical_job)

    def submitted(self, logical_job: str, generation: int, job_id: int, token_sha256: str,
                  now: float) -> LogicalJob:
        """The moving generation runs as Slurm job `job_id`: status running. StaleJob if
        the job was cancelled (or moved on) meanwhile."""
        with self.transaction() as db:
            changed = db.execute(
                "UPDATE jobs SET job_id = ?, status = 'running', updated_at = ? "
                "WHERE logical_job = ? AND generation = ? AND status = 'moving'",
                (job_id, now, logical_job, generation))
            if changed.rowcount != 1:
                raise StaleJob(logical_job, f"moving at generation {generation}")
            db.execute("UPDATE incarnations SET job_id = ? WHERE logical_job = ? AND "
                       "generation = ?", (job_id, logical_job, generation))
            put_token(db, token_sha256, logical_job, generation)
        return self.job(logical_job)

    # --- incarnations ---------------------------------------------------------------------

    def incarnations(self, logical_job: str) -> list[Incarnation]:
        with self._lock:
            rows = self.db.execute("SELECT * FROM incarnations WHERE logical_job = ? "
                                   "ORDER BY generation", (logical_job,)).fetchall()
        return [Incarnation(**{**dict(r), "end_reason": IncarnationEnd.read(r["end_reason"])})
                for r in rows]

    def end_incarnation(self, logical_job: str, generation: int, reason: IncarnationEnd,
                        now: float) -> None:
        with self.transaction() as db:
            db.execute("UPDATE incarnations SET ended_at = ?, end_reason = ? WHERE "
                       "logical_job = ? AND generation = ? AND ended_at IS NULL",
                       (now, str(reason), logical_job, generation))
            forget_incarnation(db, logical_job, generation)

    # --- leases and tokens ----------------------------------------------------------------

    def lease(self, logical_job: str) -> Lease | None:
        row = self._one("SELECT * FROM leases WHERE logical_job = ?", (logical_job,))
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

    def release_lease(self, logical_job: str) -> None:
        with self.transaction() as db:
            db.execute("UPDATE leases SET released = 1 WHERE logical_job = ?", (logical_job,))

    def refresh_leases(self, now: float) -> None:
        """After a restart nobody knows who renewed while the daemon was down: every live
        lease counts as renewed now, so no move starts before it could have run out."""
        with self.transaction() as db:
            db.execute("UPDATE leases SET renewed_at = ? WHERE released = 0", (now,))

    # --- health, bandwidth and the daemon's own watermarks ----------------------------------

    def health(self) -> dict[str, Health]:
        with self._lock:
            rows = self.db.execute("SELECT * FROM health").fetchall()
        return {r["cluster"]: Health(**{**dict(r), "status": ClusterStatus(r["status"])})
                for r in rows}

    def put_health(self, health: Health) -> None:
        with self.transaction() as db:
            db.execute("INSERT OR REPLACE INTO health VALUES (?,?,?,?,?,?)",
                       (health.cluster, health.status.value, health.failures, health.since,
                        health.last_ok, health.last_error))

    def bandwidth_snapshot(self) -> list[dict[str, Any]]:
        row = self._one("SELECT snapshot FROM bandwidth WHERE id = 1")
        return [] if row is None else list(json.loads(row["snapshot"]))

    def put_bandwidth_snapshot(self, rows: list[dict[str, Any]]) -> None:
        with self.transaction() as db:
            db.execute("INSERT OR REPLACE INTO bandwidth VALUES (1, ?)", (json.dumps(rows),))

    def bandwidth_probe_at(self) -> float:
        row = self._one("SELECT bandwidth_probe_at FROM daemon WHERE id = 1")
        return 0.0 if row is None else float(row[0])

    def put_bandwidth_probe_at(self, when: float) -> None:
        with self.transaction() as db:
            db.execute("UPDATE daemon SET bandwidth_probe_at = ? WHERE id = 1", (when,))

    def sync_transfer_id(self) -> int:
        row = self._one("SELECT sync_transfer_id FROM daemon WHERE id = 1")
        return 0 if row is None else int(row[0])

    def put_sync_transfer_id(self, transfer_id: int) -> None:
        with self.transaction() as db:
            db.execute("UPDATE daemon SET sync_transfer_id = ? WHERE id = 1", (transfer_id,))


def _check_status(db: sqlite3.Connection, logical_job: str, expected: JobStatus,
                  wanted: JobStatus) -> sqlite3.Row:
    LIFECYCLE.check(logical_job, expected, wanted)
    row: sqlite3.Row | None = db.execute(
        "SELECT status, generation FROM jobs WHERE logical_job = ?",
        (logical_job,)).fetchone()
    if row is None:
        raise UnknownLogicalJob(logical_job)
    if row["status"] != expected.value:
        raise StaleJob(logical_job, expected.value)
    return row


def _lease_live(db: sqlite3.Connection, logical_job: str, generation: int, now: float,
                ttl_s: float) -> bool:
    row = db.execute("SELECT generation, renewed_at, released FROM leases WHERE "
                     "logical_job = ?", (logical_job,)).fetchone()
    return (row is not None and row["generation"] == generation and not row["released"]
            and now - row["renewed_at"] <= ttl_s)
