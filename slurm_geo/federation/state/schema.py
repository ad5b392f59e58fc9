"""The federation state's schema and its migrations (the reads and writes: state.py).

Schema version 2 (PRAGMA user_version) made version 1's per-job `meta` keys
(`left_home:JOB`, `lost_restarts:JOB`) columns of `jobs` and its daemon-wide ones a
`daemon` row. Version 3 added each job's owner (`owner_user`, `owner_uid`, `owner_gid`,
from Slurm's job record at registration) and the allow-listed part of their submitted
environment (`owner_env`); a job registered before has none until its owner's next
MUNGE-authenticated request proves it against Slurm's record (federation.identities), and
is never submitted again without one (federation.mover). Version 4 added each
incarnation's lease secret (`incarnation_secrets`) and whether a key token was used
(`tokens.used_restart`). Version 5 added the runs an admin gave to an owner
(`run_owners`, federation.runowners), a new table made with the others; a database of
version 4 has none. Opening an older database migrates it in one transaction, one small
function per version.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from slurm_geo.federation.model import FederationStateError, LeftHome

SCHEMA_VERSION = 5

_JOBS = """
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
    updated_at REAL NOT NULL,
    left_home TEXT,                -- outage | queue | chosen: why it runs away from home
    lost_restarts INTEGER NOT NULL DEFAULT 0,
    recoveries INTEGER NOT NULL DEFAULT 0,
    awaiting_approval TEXT,        -- the target of a move waiting for `slurm-geo approve`
    owner_user TEXT,               -- whom Slurm's job record named at registration
    owner_uid INTEGER,
    owner_gid INTEGER,
    owner_env TEXT NOT NULL DEFAULT '{}'  -- JSON: the allow-listed part of their environment
);"""

_OTHERS = """
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
    generation INTEGER NOT NULL,
    used_restart INTEGER           -- the restart it released the key to (NULL: unused)
);
CREATE TABLE IF NOT EXISTS incarnation_secrets (
    logical_job TEXT NOT NULL,     -- the secret an incarnation the daemon submitted signs
    generation INTEGER NOT NULL,   -- its lease-protocol requests with (64 hex digits)
    secret TEXT NOT NULL,
    PRIMARY KEY (logical_job, generation)
);
CREATE TABLE IF NOT EXISTS run_owners (
    run TEXT PRIMARY KEY,          -- a run an admin gave to an owner (runs assign)
    owner_user TEXT NOT NULL,
    owner_uid INTEGER NOT NULL,
    owner_gid INTEGER NOT NULL,
    assigned_by TEXT NOT NULL,
    assigned_at REAL NOT NULL
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
CREATE TABLE IF NOT EXISTS daemon (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    bandwidth_probe_at REAL NOT NULL DEFAULT 0,   -- the last probe transfer between stores
    sync_transfer_id INTEGER NOT NULL DEFAULT 0   -- checkpoint-sync transfers learnt from
);
INSERT OR IGNORE INTO daemon (id) VALUES (1);
"""

_V2_JOB_COLUMNS = ("left_home TEXT", "lost_restarts INTEGER NOT NULL DEFAULT 0",
                   "recoveries INTEGER NOT NULL DEFAULT 0", "awaiting_approval TEXT")
_V3_OWNER_COLUMNS = ("owner_user TEXT", "owner_uid INTEGER", "owner_gid INTEGER",
                     "owner_env TEXT NOT NULL DEFAULT '{}'")


def check_version(db: sqlite3.Connection, path: Path) -> None:
    try:
        version = db.execute("PRAGMA user_version").fetchone()[0]
    except sqlite3.Error as exc:
        raise FederationStateError(f"cannot read the federation state {path}: {exc}") from None
    refuse_newer(db, path)
    if version != SCHEMA_VERSION:
        raise FederationStateError(
            f"the federation state {path} is schema version {version}, this slurm-geo reads "
            f"{SCHEMA_VERSION}; start the federation daemon of this version once to migrate "
            "it (or use the slurm-geo that matches the daemon)")


def refuse_newer(db: sqlite3.Connection, path: Path) -> None:
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise FederationStateError(
            f"the federation state {path} is schema version {version}, newer than this "
            f"slurm-geo ({SCHEMA_VERSION}): written by a newer slurm-geo; upgrade slurm-geo "
            "on this host")


def create_or_migrate(db: sqlite3.Connection) -> None:
    version = db.execute("PRAGMA user_version").fetchone()[0]
    has_jobs = _has_table(db, "jobs")
    if has_jobs and version < 2:
        _migrate_from_v1(db)
    if has_jobs and version < 3:
        _add_owner_columns(db)
    if has_jobs and version < 4:
        _add_token_use(db)
    db.execute(_JOBS)
    for statement in _OTHERS.split(";"):
        if statement.strip():
            db.execute(statement)
    if has_jobs and version < 2:
        _move_v1_meta(db)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


def _migrate_from_v1(db: sqlite3.Connection) -> None:
    for column in _V2_JOB_COLUMNS:
        db.execute(f"ALTER TABLE jobs ADD COLUMN {column}")


def _add_owner_columns(db: sqlite3.Connection) -> None:
    """Version 3: each job's owner and environment. Jobs registered before have none."""
    for column in _V3_OWNER_COLUMNS:
        db.execute(f"ALTER TABLE jobs ADD COLUMN {column}")


def _add_token_use(db: sqlite3.Connection) -> None:
    """Version 4: whether a key token was used (each incarnation's secret is a new table,
    made with the others). Tokens minted before are unused."""
    if _has_table(db, "tokens"):
        db.execute("ALTER TABLE tokens ADD COLUMN used_restart INTEGER")


def _has_table(db: sqlite3.Connection, name: str) -> bool:
    return db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
                      (name,)).fetchone() is not None


def _move_v1_meta(db: sqlite3.Connection) -> None:
    """Version 1 kept per-job facts and the daemon's watermarks as meta keys."""
    if not _has_table(db, "meta"):
        return
    for key, value in db.execute("SELECT key, value FROM meta").fetchall():
        kind, _, logical_job = key.partition(":")
        if kind == "left_home" and value in {h.value for h in LeftHome}:
            db.execute("UPDATE jobs SET left_home = ? WHERE logical_job = ?",
                       (value, logical_job))
        elif kind == "lost_restarts":
            db.execute("UPDATE jobs SET lost_restarts = ? WHERE logical_job = ?",
                       (int(value), logical_job))
        elif key == "bandwidth_probe_at":
            db.execute("UPDATE daemon SET bandwidth_probe_at = ?", (float(value),))
        elif key == "sync_transfer_id":
            db.execute("UPDATE daemon SET sync_transfer_id = ?", (int(value),))
    # Version 1 never cleared left_home when a job came home.
    db.execute("UPDATE jobs SET left_home = NULL WHERE cluster = home")
    db.execute("DROP TABLE meta")
