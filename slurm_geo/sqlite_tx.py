"""The project's SQLite databases: opening one, and one write transaction on a connection
opened with isolation_level=None."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def open_database(path: Path, *, readonly: bool, missing: Callable[[], Exception],
                  timeout_s: float, **options: Any) -> sqlite3.Connection:
    """`readonly`: the existing database, opened so that nothing is created or written
    (`missing()` is raised when there is none); else the database, created with its
    directory if need be. `timeout_s` is how long to wait for another writer's lock."""
    if readonly:
        if not path.is_file():
            raise missing()
        return sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True,
                               timeout=timeout_s, **options)
    path.parent.mkdir(parents=True, exist_ok=True)
    return sqlite3.connect(path, timeout=timeout_s, **options)


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
