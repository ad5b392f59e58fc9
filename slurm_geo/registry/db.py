"""SQLite registry of geo jobs on a cluster's controller.

A *logical job* is what the user submitted once; it runs as one or more Slurm jobs (a new
job id on each cluster it moves to), each as one or more *incarnations* (a requeue keeps
the job id and starts a new incarnation). Lineage links each Slurm job to its logical job.

Incarnation lifecycle (`LIFECYCLE`, checked by `_move` on every change):

    RUNNING --> REQUEUED    ended, and Slurm queued the job again (time limit + requeue,
                            preemption, node failure); the next incarnation follows.
                            `planned` when the job asked for it after saving its state
                            (slurm_geo.policy.restarts): only unplanned ones count toward
                            max_restarts
    RUNNING --> ENDED       the job's last incarnation ended, with its exit code
    RUNNING --> REQUEUED    also when a newer incarnation starts while this one was never
                            seen to end (a lost EpilogSlurmctld)

State is kept in SQLite with a rollback journal (its readers only read; see Registry);
every write is one transaction, so concurrent hooks (PrologSlurmctld and EpilogSlurmctld
run in parallel for different jobs) never see half a change. `Registry` is the hooks' (it
creates the database); everyone else (the daemons, billing) reads through
`RegistryReader`, read-only, where a failed read raises `RegistryUnreadable` instead of
coming back as no jobs.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from slurm_geo.closing import Closing
from slurm_geo.errors import SlurmGeoError
from slurm_geo.exitcodes import ExitCode
from slurm_geo.lifecycle import Lifecycle
from slurm_geo.private import private_database
from slurm_geo.sqlite_tx import immediate_transaction, reading

BUSY_TIMEOUT_S = 30.0
DEFAULT_PATH = Path("/var/lib/slurm-geo/registry.db")


class IncarnationState(Enum):
    RUNNING = "running"
    REQUEUED = "requeued"
    ENDED = "ended"

    def is_terminal(self) -> bool:
        return self is not IncarnationState.RUNNING


class IllegalTransition(SlurmGeoError):
    def __init__(self, incarnation: Incarnation, current: IncarnationState,
                 wanted: IncarnationState):
        super().__init__(f"job {incarnation.cluster}:{incarnation.job_id} incarnation "
                         f"{incarnation.restart}: cannot go from {current.value} to "
                         f"{wanted.value}")


LIFECYCLE: Lifecycle[IncarnationState, Incarnation] = Lifecycle(IncarnationState, {
    IncarnationState.RUNNING: {IncarnationState.REQUEUED, IncarnationState.ENDED},
    IncarnationState.REQUEUED: set(),
    IncarnationState.ENDED: set(),
}, IllegalTransition)


class RegistryUnreadable(SlurmGeoError):
    """The registry exists but cannot be read: not openable, locked past the timeout,
    damaged, of another schema, or holding a row this slurm-geo cannot parse."""

    exit_code = ExitCode.REGISTRY

    def __init__(self, path: Path, reason: str):
        self.path, self.reason = path, reason
        super().__init__(f"cannot read the job registry {path}: {reason}")


@dataclass(frozen=True)
class Incarnation:
    cluster: str
    job_id: int
    restart: int
    state: IncarnationState
    nodes: str
    started_at: float
    ended_at: float | None
    exit_code: str | None
    planned: bool = False  # requeued at the job's own request, its state saved

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Incarnation:
        return cls(row["cluster"], row["job_id"], row["restart"],
                   IncarnationState(row["state"]), row["nodes"], row["started_at"],
                   row["ended_at"], row["exit_code"], bool(row["planned"]))


_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    cluster TEXT NOT NULL, job_id INTEGER NOT NULL, logical_id TEXT NOT NULL,
    name TEXT NOT NULL, user TEXT NOT NULL, directives TEXT NOT NULL,
    first_seen REAL NOT NULL, held_reason TEXT,
    PRIMARY KEY (cluster, job_id));
CREATE TABLE IF NOT EXISTS incarnations (
    cluster TEXT NOT NULL, job_id INTEGER NOT NULL, restart INTEGER NOT NULL,
    state TEXT NOT NULL, nodes TEXT NOT NULL, started_at REAL NOT NULL,
    ended_at REAL, exit_code TEXT, planned INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (cluster, job_id, restart));
CREATE TABLE IF NOT EXISTS lineage (
    cluster TEXT NOT NULL, job_id INTEGER NOT NULL, logical_id TEXT NOT NULL,
    parent_cluster TEXT, parent_job_id INTEGER, linked_at REAL NOT NULL,
    PRIMARY KEY (cluster, job_id));
CREATE INDEX IF NOT EXISTS lineage_by_logical ON lineage (logical_id);
"""


# PRAGMA user_version. 1: the first to be numbered (0 is a registry of before, with or
# without incarnations.planned: opening it adds the column and numbers it).
SCHEMA_VERSION = 1


def refuse_newer(db: sqlite3.Connection, path: Path) -> None:
    """RegistryUnreadable when a newer slurm-geo wrote the registry: its hooks upgraded
    before this host's slurm-geo."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise RegistryUnreadable(path, f"it is schema version {version}, written by a newer "
                                 f"slurm-geo (this one reads {SCHEMA_VERSION}); upgrade "
                                 "slurm-geo on this host")


class Registry(Closing):
    def __init__(self, path: Path):
        # 0640 in 0750: its readers, the daemons (root without capabilities), read it
        # through the directory's group when SlurmUser is not root (docs/security.md).
        self._db = private_database(path, timeout_s=BUSY_TIMEOUT_S, group=True,
                                    isolation_level=None)
        self._db.row_factory = sqlite3.Row
        try:
            refuse_newer(self._db, Path(path))  # before anything changes the file
        except RegistryUnreadable:
            self._db.close()
            raise
        # A rollback journal, not WAL: its readers (the daemons, as the service account)
        # read through the directory's group and cannot write. A WAL database needs its
        # readers to make or write its -shm file, which they cannot, so they failed
        # ("attempt to write a readonly database"). Its writes are a few per job.
        self._db.execute("PRAGMA journal_mode=DELETE")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self._add_planned_column()
        self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def close(self) -> None:
        self._db.close()

    def _transaction(self) -> AbstractContextManager[sqlite3.Connection]:
        return immediate_transaction(self._db)

    # --- written by the controller's hooks ----------------------------------------------

    def job_started(self, cluster: str, job_id: int, restart: int, *, name: str, user: str,
                    nodes: str, directives: Mapping[str, str], now: float) -> Incarnation:
        """Record incarnation `restart` as running (PrologSlurmctld); idempotent."""
        with self._transaction() as db:
            db.execute(
                "INSERT OR IGNORE INTO jobs (cluster, job_id, logical_id, name, user, "
                "directives, first_seen) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (cluster, job_id, f"{cluster}:{job_id}", name, user,
                 json.dumps(dict(directives), sort_keys=True), now))
            db.execute(
                "INSERT OR IGNORE INTO lineage (cluster, job_id, logical_id, linked_at) "
                "VALUES (?, ?, ?, ?)", (cluster, job_id, f"{cluster}:{job_id}", now))
            for older in self._running(db, cluster, job_id):
                if older.restart < restart:  # its end was never recorded
                    self._move(db, older, IncarnationState.REQUEUED, now, None)
            db.execute(
                "INSERT OR IGNORE INTO incarnations (cluster, job_id, restart, state, nodes, "
                "started_at) VALUES (?, ?, ?, ?, ?, ?)",
                (cluster, job_id, restart, IncarnationState.RUNNING.value, nodes, now))
        return self.incarnation(cluster, job_id, restart)

    def job_ended(self, cluster: str, job_id: int, restart_now: int, exit_code: str,
                  now: float, planned_restart: int | None = None) -> Incarnation | None:
        """Record the end of the running incarnation (EpilogSlurmctld).

        Slurm counts the restart before the epilog runs, so `restart_now` above the running
        incarnation's number means the job was queued again: planned when the job marked
        this incarnation's requeue as its own (`planned_restart`). None if none was running.
        """
        with self._transaction() as db:
            running = self._running(db, cluster, job_id)
            if not running:
                return None
            current = running[-1]
            if restart_now > current.restart:
                self._move(db, current, IncarnationState.REQUEUED, now, exit_code)
                if planned_restart == current.restart:
                    db.execute("UPDATE incarnations SET planned = 1 WHERE cluster = ? AND "
                               "job_id = ? AND restart = ?", (cluster, job_id, current.restart))
            else:
                self._move(db, current, IncarnationState.ENDED, now, exit_code)
        return self.incarnation(cluster, job_id, current.restart)

    def unplanned_requeues(self, cluster: str, job_id: int) -> int:
        """How often the job was queued again without asking for it (what max_restarts caps)."""
        row = self._db.execute(
            "SELECT COUNT(*) FROM incarnations WHERE cluster = ? AND job_id = ? AND state = ? "
            "AND planned = 0", (cluster, job_id, IncarnationState.REQUEUED.value)).fetchone()
        return int(row[0])

    def mark_held(self, cluster: str, job_id: int, reason: str) -> None:
        with self._transaction() as db:
            db.execute("UPDATE jobs SET held_reason = ? WHERE cluster = ? AND job_id = ?",
                       (reason, cluster, job_id))

    def link(self, cluster: str, job_id: int, parent_cluster: str, parent_job_id: int,
             now: float) -> str:
        """Make a Slurm job a continuation of another's logical job; its logical id."""
        with self._transaction() as db:
            row = db.execute("SELECT logical_id FROM lineage WHERE cluster = ? AND job_id = ?",
                             (parent_cluster, parent_job_id)).fetchone()
            logical = row["logical_id"] if row else f"{parent_cluster}:{parent_job_id}"
            db.execute(
                "INSERT OR REPLACE INTO lineage (cluster, job_id, logical_id, parent_cluster, "
                "parent_job_id, linked_at) VALUES (?, ?, ?, ?, ?, ?)",
                (cluster, job_id, logical, parent_cluster, parent_job_id, now))
            db.execute("UPDATE jobs SET logical_id = ? WHERE cluster = ? AND job_id = ?",
                       (logical, cluster, job_id))
        return logical

    # --- reading -------------------------------------------------------------------------

    def incarnation(self, cluster: str, job_id: int, restart: int) -> Incarnation:
        row = self._db.execute(
            "SELECT * FROM incarnations WHERE cluster = ? AND job_id = ? AND restart = ?",
            (cluster, job_id, restart)).fetchone()
        if row is None:
            raise KeyError((cluster, job_id, restart))
        return Incarnation.from_row(row)

    def incarnations(self, cluster: str, job_id: int) -> list[Incarnation]:
        rows = self._db.execute(
            "SELECT * FROM incarnations WHERE cluster = ? AND job_id = ? ORDER BY restart",
            (cluster, job_id))
        return [Incarnation.from_row(r) for r in rows]

    def job(self, cluster: str, job_id: int) -> dict[str, Any] | None:
        row = self._db.execute("SELECT * FROM jobs WHERE cluster = ? AND job_id = ?",
                               (cluster, job_id)).fetchone()
        if row is None:
            return None
        job = dict(row)
        job["directives"] = json.loads(job["directives"])
        return job

    def lineage(self, logical_id: str) -> list[tuple[str, int]]:
        rows = self._db.execute(
            "SELECT cluster, job_id FROM lineage WHERE logical_id = ? ORDER BY linked_at",
            (logical_id,))
        return [(r["cluster"], r["job_id"]) for r in rows]

    # --- internals -----------------------------------------------------------------------

    def _add_planned_column(self) -> None:
        """A registry from before planned requeues were told apart: every requeue in it
        counts, as it did then."""
        columns = {row["name"] for row in self._db.execute("PRAGMA table_info(incarnations)")}
        if "planned" not in columns:
            with self._transaction() as db:
                db.execute("ALTER TABLE incarnations ADD COLUMN planned INTEGER NOT NULL "
                           "DEFAULT 0")

    @staticmethod
    def _running(db: sqlite3.Connection, cluster: str, job_id: int) -> list[Incarnation]:
        rows = db.execute(
            "SELECT * FROM incarnations WHERE cluster = ? AND job_id = ? AND state = ? "
            "ORDER BY restart", (cluster, job_id, IncarnationState.RUNNING.value))
        return [Incarnation.from_row(r) for r in rows]

    @staticmethod
    def _move(db: sqlite3.Connection, incarnation: Incarnation, wanted: IncarnationState,
              now: float, exit_code: str | None) -> None:
        LIFECYCLE.check(incarnation, incarnation.state, wanted)
        db.execute(
            "UPDATE incarnations SET state = ?, ended_at = ?, exit_code = ? WHERE cluster = ? "
            "AND job_id = ? AND restart = ? AND state = ?",
            (wanted.value, now, exit_code, incarnation.cluster, incarnation.job_id,
             incarnation.restart, incarnation.state.value))


# --- reading from outside the hooks ----------------------------------------------------------

@dataclass(frozen=True)
class LineageLink:
    """A Slurm job and the logical job it is part of."""

    cluster: str
    job_id: int
    logical_id: str


@dataclass(frozen=True)
class RegisteredJob:
    """A geo job the controller saw start, with its --geo-* directives (name -> value)."""

    cluster: str
    job_id: int
    logical_id: str
    user: str
    directives: Mapping[str, str]
    first_seen: float


@dataclass(frozen=True)
class ActiveJob:
    """A geo job and how recently it ran: `running` while an incarnation is, `last_seen`
    its newest incarnation's start or end (controller clock)."""

    job: RegisteredJob
    running: bool
    last_seen: float


class RegistryReader:
    """The registry at `path`, read-only (never created or written), one connection per
    read. The hooks create it at the first geo job's PrologSlurmctld, so with `missing_ok`
    a file that does not exist yet reads as no jobs; without, it is `RegistryUnreadable`."""

    def __init__(self, path: Path, *, missing_ok: bool = False,
                 timeout_s: float = BUSY_TIMEOUT_S):
        self.path = Path(path)
        self.missing_ok = missing_ok
        self.timeout_s = timeout_s

    def lineage(self) -> list[LineageLink]:
        """Every Slurm job's logical job, by cluster and job id."""
        rows = self._rows("SELECT cluster, job_id, logical_id FROM lineage "
                          "ORDER BY cluster, job_id")
        return [LineageLink(cluster, int(job_id), logical) for cluster, job_id, logical in rows]

    def jobs(self) -> list[RegisteredJob]:
        """Every geo job, by cluster and job id."""
        rows = self._rows("SELECT cluster, job_id, logical_id, user, directives, first_seen "
                          "FROM jobs ORDER BY cluster, job_id")
        return [RegisteredJob(cluster, int(job_id), logical, user,
                              self._directives(cluster, job_id, text), float(first_seen))
                for cluster, job_id, logical, user, text, first_seen in rows]

    def active_jobs(self, since: float, also: Iterable[tuple[str, int]] = ()
                    ) -> list[ActiveJob]:
        """Geo jobs running now or seen (started or ended) at `since` or later, and the
        jobs named in `also` however old, by cluster and job id. Bounded by what runs,
        not by the registry's history: checkpoint-sync reads it every scan."""
        wanted = sorted(set(also))
        named = "".join(" OR (j.cluster = ? AND j.job_id = ?)" for _ in wanted)
        seen = "MAX(MAX(i.started_at, COALESCE(i.ended_at, 0)))"
        rows = self._rows(
            "SELECT j.cluster, j.job_id, j.logical_id, j.user, j.directives, j.first_seen, "
            f"MAX(i.state = 'running'), {seen} FROM jobs j JOIN incarnations i "
            "ON i.cluster = j.cluster AND i.job_id = j.job_id GROUP BY j.cluster, j.job_id "
            f"HAVING MAX(i.state = 'running') = 1 OR {seen} >= ?{named} "
            "ORDER BY j.cluster, j.job_id",
            [since, *(value for tag in wanted for value in tag)])
        return [ActiveJob(RegisteredJob(cluster, int(job_id), logical, user,
                                        self._directives(cluster, job_id, text),
                                        float(first_seen)), bool(running), float(seen))
                for cluster, job_id, logical, user, text, first_seen, running, seen in rows]

    def _directives(self, cluster: str, job_id: int, text: str | None) -> dict[str, str]:
        try:
            found = json.loads(text or "{}")
        except ValueError:
            found = None
        if not isinstance(found, dict):
            raise RegistryUnreadable(self.path, f"job {cluster}:{job_id} has directives "
                                                f"that are not a JSON object: {text!r}")
        return {str(k): str(v) for k, v in found.items()}

    def _rows(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        if self.missing_ok and not self.path.exists():
            return []
        with reading(self.path, missing=lambda: RegistryUnreadable(
                         self.path, "there is no such file; is this the controller's host? "
                                    "(see [registry] path in the config)"),
                     unreadable=lambda reason: RegistryUnreadable(self.path, reason),
                     timeout_s=self.timeout_s) as db:
            refuse_newer(db, self.path)
            return db.execute(sql, list(params)).fetchall()
