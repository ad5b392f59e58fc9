"""Reading checkpoint-sync's state from outside checkpoint-sync.

The federation daemon, billing, the drill and the benchmarks read `state.py`'s database
through `SyncStateReader`, never with SQL of their own: one owner per database. The reader
opens the file read-only (it never creates or writes it), one connection per read, and
every query names the columns it needs. So a read that fails (no such file where one must
be, a file that cannot be opened, a lock held past the timeout, a damaged file, a table or
column that is not there) raises `SyncStateUnreadable`, naming the file and the fix; it
never comes back as "no rows", which would silently drop, say, egress from a bill.

Whether a file that does not exist *yet* is an error is the caller's to say, with
`missing_ok`: checkpoint-sync creates it when it first starts, so for a daemon that runs
beside it (the federation daemon learning bandwidth, a drill waiting for checkpoints) no
file means nothing replicated yet; billing, which is configured to charge what is in it,
treats a missing file as the error it is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from slurm_geo.sqlite_tx import reading
from slurm_geo.sync.state import BUSY_TIMEOUT_S, Replica, Status, SyncError


class SyncStateUnreadable(SyncError):
    """checkpoint-sync's state cannot be read (see the module docstring for when)."""

    def __init__(self, path: Path, reason: str):
        self.path, self.reason = path, reason
        super().__init__(f"cannot read checkpoint-sync's state {path}: {reason}")


class SyncStateMissing(SyncStateUnreadable):
    """There is no state database at the path, and the caller needs one."""

    def __init__(self, path: Path):
        super().__init__(path, "there is no such file; is checkpoint-sync running on this "
                               "host? (see [sync] state in the config)")


@dataclass(frozen=True)
class ReplicationSample:
    """One replica's copy from `source` to `destination` (verification reads left out):
    a bandwidth sample. `last_id` is its newest transfer's id, the watermark to read on
    from."""

    last_id: int
    source: str
    destination: str
    bytes: int
    started_at: float
    finished_at: float


@dataclass(frozen=True)
class Transfer:
    """One row of `transfers`: an object put, or a verification read-back (kind
    "verify"), between two stores and their regions; what billing charges as egress."""

    id: int
    replica_id: int
    run: str
    step: int
    object: str
    kind: str
    bytes: int
    source: str
    destination: str
    source_region: str
    destination_region: str
    started_at: float
    finished_at: float


@dataclass(frozen=True)
class CopyTotals:
    """What checkpoint-sync copied for a run, or one checkpoint of it, verification reads
    left out: bytes, seconds summed over its transfers, and the first start and last end
    (None when nothing was copied)."""

    bytes: int
    seconds: float
    started_at: float | None
    finished_at: float | None


_TEXT = {"source", "source_region", "destination_region"}  # NULL in old rows: read as ""
_TRANSFER_SELECT = ", ".join(
    f"COALESCE({f.name}, '') AS {f.name}" if f.name in _TEXT
    else "COALESCE(bytes, 0) AS bytes" if f.name == "bytes" else f.name
    for f in fields(Transfer))
_REPLICA_SELECT = ", ".join(f.name for f in fields(Replica))


class SyncStateReader:
    """checkpoint-sync's state database at `path`, read-only. With `missing_ok`, a file
    that does not exist yet reads as empty (checkpoint-sync has not started there yet);
    without, it raises `SyncStateMissing`. Holds no connection: safe to share."""

    def __init__(self, path: Path, *, missing_ok: bool = False,
                 timeout_s: float = BUSY_TIMEOUT_S):
        self.path = Path(path)
        self.missing_ok = missing_ok
        self.timeout_s = timeout_s

    def replication_samples(self, after_id: int) -> list[ReplicationSample]:
        """Each (replica, source, destination) copied in transfers with id > `after_id`,
        oldest first: the federation daemon's bandwidth samples. Only whole attempts: the
        transfers from the first of a replica still uploading on are left for a later
        call, since its packs go several at once and a part of them timed alone measures
        one stream, not the link (a 444 MB copy at 185 Mbit/s learned as 128)."""
        [(held,)] = self._rows(
            "SELECT MIN(t.id) FROM transfers t JOIN replicas r ON r.id = t.replica_id "
            "WHERE t.id > ? AND r.status = ?", [after_id, Status.UPLOADING.value]) or [(None,)]
        through = "" if held is None else f" AND id < {int(held)}"
        rows = self._rows(
            "SELECT MAX(id), source, destination, COALESCE(SUM(bytes), 0), MIN(started_at), "
            "MAX(finished_at) FROM transfers WHERE id > ? AND kind != 'verify' "
            f"AND started_at IS NOT NULL AND finished_at IS NOT NULL{through} "
            "GROUP BY replica_id, source, destination ORDER BY MAX(id)", [after_id])
        return [ReplicationSample(int(last), source, destination, int(nbytes),
                                  float(started), float(finished))
                for last, source, destination, nbytes, started, finished in rows]

    def transfers_finished(self, since: float, until: float) -> list[Transfer]:
        """Every transfer (verification reads included) that finished in [since, until),
        by id: what billing ingests as egress."""
        rows = self._rows(f"SELECT {_TRANSFER_SELECT} FROM transfers WHERE finished_at >= ? "
                          "AND finished_at < ? ORDER BY id", [since, until])
        return [Transfer(*row) for row in rows]

    def verified_steps(self, run: str) -> list[int]:
        """The steps of `run`'s checkpoints verified at a destination, oldest first (each
        step once)."""
        rows = self._rows("SELECT DISTINCT step FROM replicas WHERE run = ? AND status = ? "
                          "ORDER BY step", [run, Status.VERIFIED.value])
        return [int(step) for (step,) in rows]

    def copied(self, run: str, step: int | None = None) -> CopyTotals:
        """What was copied for `run` (or only its checkpoint at `step`)."""
        where = "run = ? AND kind != 'verify'"
        params: list[Any] = [run]
        if step is not None:
            where += " AND step = ?"
            params.append(step)
        rows = self._rows(
            "SELECT COALESCE(SUM(bytes), 0), COALESCE(SUM(finished_at - started_at), 0), "
            f"MIN(started_at), MAX(finished_at) FROM transfers WHERE {where}", params)
        if not rows:
            return CopyTotals(0, 0.0, None, None)
        nbytes, seconds, started, finished = rows[0]
        return CopyTotals(int(nbytes), float(seconds), started, finished)

    def replicas(self, run: str | None = None) -> list[Replica]:
        """Every replica (of `run`, if given), by run, step, destination and root."""
        where, params = ("1", []) if run is None else ("run = ?", [run])
        rows = self._rows(f"SELECT {_REPLICA_SELECT} FROM replicas WHERE {where} "
                          "ORDER BY run, step, destination, root", params)
        names = [f.name for f in fields(Replica)]
        try:
            return [Replica.from_row(dict(zip(names, row, strict=True))) for row in rows]
        except ValueError as exc:  # a status this slurm-geo does not know
            raise SyncStateUnreadable(self.path, f"{exc}; run the same slurm-geo version as "
                                                 "checkpoint-sync") from exc

    def job_directories(self) -> dict[str, tuple[str, ...]]:
        """Each registered job directory checkpoint-sync replicates (its root,
        `file://<real path>`) -> the jobs ("cluster:job_id") that named it, newest first:
        whose checkpoints its transfers carry. None in a state from before `sources`."""
        if not self._rows("SELECT 1 FROM sqlite_master WHERE type = 'table' AND "
                          "name = 'sources'", []):
            return {}
        rows = self._rows("SELECT root, jobs FROM sources WHERE kind = 'job' ORDER BY root",
                          [])
        try:
            return {root: tuple(str(tag) for tag in json.loads(jobs)) for root, jobs in rows}
        except (TypeError, ValueError) as exc:
            raise SyncStateUnreadable(self.path, f"a row of sources does not list its jobs "
                                                 f"as JSON ({exc}); run the same slurm-geo "
                                                 "version as checkpoint-sync") from exc

    def _rows(self, sql: str, params: list[Any]) -> list[tuple[Any, ...]]:
        if self.missing_ok and not self.path.exists():
            return []
        with reading(self.path, missing=lambda: SyncStateMissing(self.path),
                     unreadable=lambda reason: SyncStateUnreadable(self.path, reason),
                     timeout_s=self.timeout_s) as db:
            return db.execute(sql, params).fetchall()
