"""checkpoint-sync's record of each run's world off-site (docs/checkpoint-sync.md, "A run's
world"): one row per (root, run, destination) in the state database's `worlds` table.

`record_sha256` is the SHA-256 of the home store's `worlds/<run>` (sealed, as it lies)
that the last pass read, `verified` the pins (`tree/snapshot/manifest digest`) read back
whole at the destination, `bytes_total` the pack bytes of the pinned snapshots at home and
`bytes_there` those of them the destination holds; `complete` once the destination's
record is the home one and every pin it names verified there (what the planner's "a job
whose inputs are staged nowhere else is not moved" reads). A run that staged no world has
a row with no record and `complete` 0. Only the daemon writes it.
"""

from __future__ import annotations

import json
import math
import sqlite3
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_geo.stage.residency import TreeResidency, narrowed
from slurm_geo.sync.state import StateDB, SyncError

_WORLDS = """CREATE TABLE IF NOT EXISTS worlds (
    root TEXT NOT NULL, run TEXT NOT NULL, destination TEXT NOT NULL,
    record_sha256 TEXT, trees INTEGER NOT NULL DEFAULT 0, verified TEXT NOT NULL DEFAULT '[]',
    bytes_total INTEGER NOT NULL DEFAULT 0, bytes_there INTEGER NOT NULL DEFAULT 0,
    bytes_copied INTEGER NOT NULL DEFAULT 0, complete INTEGER NOT NULL DEFAULT 0,
    outputs_home INTEGER NOT NULL DEFAULT 0, failures INTEGER NOT NULL DEFAULT 0,
    last_error TEXT, next_attempt_at REAL NOT NULL DEFAULT 0, checked_at REAL,
    updated_at REAL NOT NULL DEFAULT 0, refused TEXT, record_seen_at REAL,
    PRIMARY KEY (root, run, destination))"""


@dataclass(frozen=True)
class WorldRow:
    """One run's world at one destination, as the last pass left it."""

    root: str
    run: str
    destination: str
    record_sha256: str | None = None
    trees: int = 0
    verified: tuple[str, ...] = ()
    bytes_total: int = 0
    bytes_there: int = 0
    bytes_copied: int = 0   # over every pass
    complete: bool = False
    outputs_home: int = 0   # outputs/ objects brought home from the destination
    failures: int = 0
    last_error: str | None = None
    next_attempt_at: float = 0.0
    checked_at: float | None = None
    updated_at: float = 0.0
    refused: str | None = None  # why residency keeps the world from the destination
    record_seen_at: float | None = None  # when this daemon first read this record at home

    @property
    def pending_bytes(self) -> int:
        return max(0, self.bytes_total - self.bytes_there)

    def lag_s(self, now: float) -> float:
        """Staging lag: how long the home record it last read has waited to be whole at
        the destination (0 when it is, or none, or residency keeps it from there)."""
        if self.complete or self.refused is not None or self.record_seen_at is None:
            return 0.0
        return max(0.0, now - self.record_seen_at)

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> WorldRow:
        values = {name: row[name] for name in cls.__dataclass_fields__ if name in row}
        values["verified"] = tuple(json.loads(row["verified"] or "[]"))
        values["complete"] = bool(row["complete"])
        return cls(**values)

    def to_row(self) -> dict[str, Any]:
        values = {name: getattr(self, name) for name in self.__dataclass_fields__}
        values["verified"] = json.dumps(list(self.verified))
        values["complete"] = int(self.complete)
        return values


_WORLD_PACKS = """CREATE TABLE IF NOT EXISTS world_packs (
    destination TEXT NOT NULL, name TEXT NOT NULL, verified_at REAL NOT NULL,
    PRIMARY KEY (destination, name))"""


_DOMAIN_RESIDENCY = """CREATE TABLE IF NOT EXISTS domain_residency (
    domain TEXT PRIMARY KEY, classes TEXT NOT NULL, regions TEXT NOT NULL)"""


def create_worlds_table(state: StateDB) -> None:
    with state.db.conn:
        state.db.execute(_WORLDS)
        state.db.execute(_WORLD_PACKS)
        state.db.execute(_DOMAIN_RESIDENCY)
        columns = {r["name"] for r in state.db.query("PRAGMA table_info(worlds)")}
        for column, kind in (("refused", "TEXT"), ("record_seen_at", "REAL")):
            if column not in columns:  # a table of an earlier release
                state.db.execute(f"ALTER TABLE worlds ADD COLUMN {column} {kind}")


def verified_packs(state: StateDB, destination: str) -> set[str]:
    """The tree packs read back whole and sound at `destination` (any run's)."""
    return {r["name"] for r in state.db.query(
        "SELECT name FROM world_packs WHERE destination = ?", [destination])}


def add_verified_pack(state: StateDB, destination: str, name: str, now: float) -> None:
    with state.db.conn:
        state.db.execute("INSERT OR REPLACE INTO world_packs VALUES (?, ?, ?)",
                         [destination, name, now])


def remember_residency(state: StateDB, read: TreeResidency) -> TreeResidency:
    """The narrowest residency of the domain seen yet: `read` narrowed by what this
    daemon read of it before (slurm_geo.stage.residency.narrowed), kept."""
    old = next((TreeResidency(read.domain, tuple(json.loads(r["classes"])),
                              tuple(json.loads(r["regions"])))
                for r in state.db.query("SELECT * FROM domain_residency WHERE domain = ?",
                                        [read.domain])), None)
    now = narrowed(old, read)
    if now != old:
        with state.db.conn:
            state.db.execute("INSERT OR REPLACE INTO domain_residency VALUES (?, ?, ?)",
                             [now.domain, json.dumps(list(now.classes)),
                              json.dumps(list(now.regions))])
    return now


def world_rows(state: StateDB, destination: str | None = None) -> list[WorldRow]:
    where, params = ("WHERE destination = ?", [destination]) if destination else ("", [])
    return [WorldRow.from_row(r) for r in state.db.query(
        f"SELECT * FROM worlds {where} ORDER BY run, root, destination", params)]


def put_world_row(state: StateDB, row: WorldRow) -> None:
    values = row.to_row()
    columns = ", ".join(values)
    marks = ", ".join("?" for _ in values)
    with state.db.conn:
        state.db.execute(f"INSERT OR REPLACE INTO worlds ({columns}) VALUES ({marks})",
                         list(values.values()))


def synced_runs(state: StateDB, destination: str) -> list[tuple[str, str]]:
    """(root, run) of every run with a checkpoint bound for `destination`: the runs whose
    worlds follow their checkpoints there. The run whose newest checkpoint was found
    last comes first: a training job's world, which a move may wait for, goes before
    that of a run that stopped checkpointing (one ended, or cancelled with its world half
    copied: in name order, a 1 GB world left so waited for another, bench/world_move.py)."""
    return [(r["root"], r["run"]) for r in state.db.query(
        "SELECT root, run FROM replicas WHERE destination = ? AND status != 'skipped' "
        "GROUP BY root, run ORDER BY MAX(discovered_at) DESC, run, root", [destination])]


@dataclass
class WorldQueue:
    """Which runs' worlds a pass looks at, in order (ties in the order of `runs`,
    `synced_runs`': the most recently checkpointing first): runs never looked at by this daemon
    first, and those looked at with no world record at home whose record the last scan
    lists now (`recorded`: their job has just staged it; waiting for the recheck cost a
    move up to `recheck_s`, bench/world_move.py), then incomplete ones whose retry is due,
    then complete ones not checked for `recheck_s` (their home record may have moved on).
    Pure."""

    recheck_s: float
    seen: set[tuple[str, str]] = field(default_factory=set)  # by this process

    def due(self, runs: Sequence[tuple[str, str]], rows: Iterable[WorldRow], now: float,
            once: bool = False, recorded: Mapping[tuple[str, str], float] | None = None
            ) -> list[tuple[str, str]]:
        by_run = {(r.root, r.run): r for r in rows}
        ranked: list[tuple[int, float, int, tuple[str, str]]] = []
        for place, key in enumerate(runs):
            row = by_run.get(key)
            if key not in self.seen or row is None or _appeared(row, key, recorded, now):
                ranked.append((0, 0.0, place, key))
            elif not row.complete and row.record_sha256 is not None \
                    and row.next_attempt_at <= now:
                ranked.append((1, row.next_attempt_at, place, key))
            elif not once and (row.checked_at or 0.0) + self.recheck_s <= now:
                ranked.append((2, row.checked_at or 0.0, place, key))
        return [key for *_, key in sorted(ranked)]

    def next_due(self, runs: Sequence[tuple[str, str]], rows: Iterable[WorldRow],
                 once: bool = False,
                 recorded: Mapping[tuple[str, str], float] | None = None) -> float | None:
        """When the first run not due now becomes due (None: none will by itself)."""
        by_run = {(r.root, r.run): r for r in rows}
        times = []
        for key in runs:
            row = by_run.get(key)
            if key not in self.seen or row is None:
                return 0.0
            if _appeared(row, key, recorded, math.inf):
                times.append(row.next_attempt_at)
            if not row.complete and row.record_sha256 is not None:
                times.append(row.next_attempt_at)
            elif not once:
                times.append((row.checked_at or 0.0) + self.recheck_s)
        return min(times, default=None)


def _appeared(row: WorldRow, key: tuple[str, str],
              recorded: Mapping[tuple[str, str], float] | None, now: float) -> bool:
    """Whether a scan found the run's world record at home (`recorded`: when) after its
    row was last checked and saw none; a failed look's retry still waits its turn."""
    if recorded is None or key not in recorded or row.record_sha256 is not None \
            or row.refused is not None:
        return False
    return (row.checked_at or 0.0) < recorded[key] and row.next_attempt_at <= now


def read_worlds(state_path: Path, run: str | None = None) -> list[WorldRow]:
    """The `worlds` rows (of `run`), from the state database opened read-only; none where
    the daemon has not looked at any world yet. SyncError naming it when it cannot be
    read."""
    try:
        state = StateDB(state_path, readonly=True)
        try:
            rows = world_rows(state)
        finally:
            state.close()
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):
            return []
        raise SyncError(f"sync state {state_path} cannot be read: {exc}") from None
    except sqlite3.Error as exc:
        raise SyncError(f"sync state {state_path} cannot be read: {exc}") from None
    return [r for r in rows if run is None or r.run == run]


def world_offsite(rows: Iterable[WorldRow], run: str) -> bool | None:
    """Whether `run`'s world is complete at some destination: True, False (staged at home,
    not yet whole anywhere else), None (the run staged no world, or none was looked at)."""
    mine = [r for r in rows if r.run == run and r.record_sha256 is not None]
    if not mine:
        return None
    return any(r.complete for r in mine)
