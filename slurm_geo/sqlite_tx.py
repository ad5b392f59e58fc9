"""The project's SQLite databases: opening one, reading one where a failed read is an
error (never "no rows"), and one write transaction on a connection opened with
isolation_level=None."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from slurm_geo.private import private_database


def open_database(path: Path, *, readonly: bool, missing: Callable[[], Exception],
                  timeout_s: float, **options: Any) -> sqlite3.Connection:
    """`readonly`: the existing database, opened so that nothing is created or written
    (`missing()` is raised when there is none); else the database, created with its
    directory if need be, private to this account whatever the umask (`slurm_geo.private`:
    the file and its companions 0600 in a 0700 directory). `timeout_s` is how long to wait
    for another writer's lock."""
    if readonly:
        if not path.is_file():
            raise missing()
        return sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True,
                               timeout=timeout_s, **options)
    return private_database(path, timeout_s=timeout_s, **options)


def meta_schema_version(db: sqlite3.Connection) -> str | None:
    """The schema version a database keeps in its `meta` table (key 'schema_version'),
    as stored; None where it has no such table or row yet."""
    if not db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'"
                      ).fetchone():
        return None
    row = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    return None if row is None else str(row[0])


def newer_schema(db: sqlite3.Connection, supported: int) -> str | None:
    """The database's schema version where a newer slurm-geo wrote it (above
    `supported`), for its opener to refuse before it changes anything; else None."""
    found = meta_schema_version(db)
    return found if found is not None and found.isdigit() and int(found) > supported else None


def settle_schema(db: sqlite3.Connection, *, readonly: bool, refuse_newer: Callable[[], None],
                  create: Callable[[], None]) -> None:
    """A database just opened: read-only, refuse a schema a newer slurm-geo wrote; else
    create (or bring up to date) this one's. Whatever is refused closes the connection
    before it is raised, so no caller keeps a half-opened database."""
    try:
        if readonly:
            refuse_newer()
        else:
            create()
    except BaseException:
        db.close()
        raise


@contextmanager
def immediate_transaction(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """BEGIN IMMEDIATE takes the write lock up front, so two writers never both read and
    then fail to upgrade; anything raised inside rolls the transaction back."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


@contextmanager
def reading(path: Path, *, missing: Callable[[], Exception],
            unreadable: Callable[[str], Exception],
            timeout_s: float) -> Iterator[sqlite3.Connection]:
    """A read-only connection to the existing database at `path`, closed afterwards. Any
    SQLite error while opening or reading it becomes `unreadable(reason)` (the reason says
    what went wrong and what to do), so a failed read never looks like "no rows"."""
    try:
        db = open_database(path, readonly=True, missing=missing, timeout_s=timeout_s)
    except sqlite3.Error as exc:
        raise unreadable(read_failure(exc, timeout_s)) from exc
    try:
        yield db
    except sqlite3.Error as exc:
        raise unreadable(read_failure(exc, timeout_s)) from exc
    finally:
        db.close()


def read_failure(exc: sqlite3.Error, timeout_s: float) -> str:
    """SQLite's error, and the fix, in one line."""
    text = str(exc)
    if "locked" in text or "busy" in text:
        return (f"{text} (another process held its lock for more than {timeout_s:g} s); "
                "retry when that process has finished writing")
    if text.startswith(("no such table", "no such column")):
        return (f"{text}: its schema is not the one this slurm-geo reads; run the same "
                "slurm-geo version as the process that writes it")
    if "not a database" in text or "malformed" in text:
        return f"{text}: the file is damaged or is another database; check the configured path"
    if "unable to open" in text:
        return f"{text}: check that the file and its directory are readable by this user"
    return text
