"""The billing database (SQLite via sqlite-utils): what was ingested, the prices, the lines.

Tables (times are Unix seconds, UTC):

    jobs        one row per incarnation: (cluster, job_id, submit_ts) is slurmdbd's own key,
                so a requeue is a new row and ingesting a record again replaces it in place
    egress      one row per checkpoint transfer, keyed as checkpoint-sync recorded it
    clusters    region and provider of each cluster, prices  the effective-dated price table
    cost_lines  per incarnation or transfer, calendar month and price: a `costs.Charge`
    problems    accounting rows that could not be read, kept verbatim
    watermarks  where the next incremental ingest of each source starts; and, under
                "covered:SOURCE", how far that source was read completely (billing check)

Writes are batched `executemany` upserts inside one transaction per batch, so memory stays
bounded and a re-ingest of the same window leaves every table as it was.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from sqlite_utils import Database

from slurm_geo.billing.config import ClusterFacts, PriceEntry
from slurm_geo.billing.errors import BillingError
from slurm_geo.closing import Closing
from slurm_geo.sqlite_tx import meta_schema_version, newer_schema, open_database, settle_schema

BUSY_TIMEOUT_S = 30.0
SCHEMA_VERSION = 1

JOB_COLUMNS: dict[str, type] = {
    "cluster": str, "job_id": int, "submit_ts": int, "restarts": int, "logical_id": str,
    "name": str, "user": str, "account": str, "cost_center": str, "cost_center_source": str,
    "partition": str, "start_ts": int, "end_ts": int, "elapsed_s": int, "cpus": int,
    "gpus": int, "alloc_tres": str, "state": str, "settled": int, "flags": str, "as_of": int,
}
EGRESS_COLUMNS: dict[str, type] = {
    "run": str, "step": int, "object": str, "kind": str, "started_at": float,
    "finished_at": float, "bytes": int, "source": str, "destination": str,
    "source_region": str, "destination_region": str, "job_cluster": str, "job_id": int,
    "logical_id": str, "user": str, "cost_center": str, "cost_center_source": str,
}
# One row per incarnation (or transfer), calendar month and price in force: the columns from
# cluster to fee_usd are a `costs.Charge`; egress rows use the egress_* columns instead.
LINE_COLUMNS: dict[str, type] = {
    "owner": str, "period": str, "cluster": str, "start": int, "end": int, "price_from": int,
    "cpu_seconds": int, "cpu_hour": float, "cpu_usd": float,
    "gpu_seconds": int, "gpu_hour": float, "gpu_usd": float,
    "fee_pct": float, "fee_usd": float,
    "egress_bytes": int, "egress_per_gb": float, "egress_usd": float,
    "cost_center": str, "user": str, "job": str,
}
PRICE_COLUMNS: dict[str, type] = {
    "cluster": str, "provider": str, "effective_from": int, "gpu_hour": float,
    "cpu_hour": float, "egress_per_gb": float, "marketplace_fee_pct": float, "source": str,
}
JOB_KEY = ("cluster", "job_id", "submit_ts")
EGRESS_KEY = ("run", "step", "object", "kind", "started_at")


def upsert_sql(table: str, columns: Sequence[str], key: Sequence[str]) -> str:
    updates = ", ".join(f"{c} = excluded.{c}" for c in columns if c not in key)
    return (f"INSERT INTO {table} ({', '.join(columns)}) VALUES "
            f"({', '.join('?' for _ in columns)}) ON CONFLICT ({', '.join(key)}) DO UPDATE "
            f"SET {updates}")


class BillingDB(Closing):
    """The database at `path`; `readonly` opens an existing one without creating it."""

    def __init__(self, path: Path, readonly: bool = False):
        self.path = Path(path)
        conn = open_database(self.path, readonly=readonly, timeout_s=BUSY_TIMEOUT_S,
                             missing=lambda: BillingError(
                                 f"no billing database at {self.path}; run `slurm-geo "
                                 "billing ingest` first (or give --db PATH)"))
        conn.row_factory = sqlite3.Row
        self.conn = conn
        self.db = Database(conn)
        settle_schema(conn, readonly=readonly, refuse_newer=self._refuse_newer,
                      create=self._create_schema)

    def close(self) -> None:
        self.conn.close()

    def _refuse_newer(self) -> None:
        """Before anything changes the file: a database a newer slurm-geo wrote is refused
        (its tables may not be this one's; moving it aside would lose what it holds)."""
        found = newer_schema(self.conn, SCHEMA_VERSION)
        if found is not None:
            raise BillingError(f"{self.path} has billing schema {found}, written by a newer "
                               f"slurm-geo (this one reads {SCHEMA_VERSION}); upgrade "
                               "slurm-geo on this host")

    def _create_schema(self) -> None:
        self._refuse_newer()
        self.db.enable_wal()
        # Everything here can be ingested again from Slurm: a power cut may lose the last
        # batch, never corrupt the file (WAL), so commits need not wait for the disk.
        self.conn.execute("PRAGMA synchronous = NORMAL")
        # Ingest writes in batches of thousands of rows: a 32 MB page cache keeps the
        # indexes' hot pages in memory, and fewer, larger WAL checkpoints mean fewer fsyncs.
        self.conn.execute("PRAGMA cache_size = -32768")
        self.conn.execute("PRAGMA wal_autocheckpoint = 8192")
        tables = (("jobs", JOB_COLUMNS, JOB_KEY), ("egress", EGRESS_COLUMNS, EGRESS_KEY),
                  ("prices", PRICE_COLUMNS, ("cluster", "provider", "effective_from")),
                  ("clusters", {"name": str, "region": str, "provider": str}, ("name",)),
                  ("problems", {"cluster": str, "line": int, "text": str, "reason": str},
                   ("cluster", "text", "reason")),
                  ("watermarks", {"source": str, "value": int}, ("source",)),
                  ("meta", {"key": str, "value": str}, ("key",)))
        with self.conn:
            # cost_lines is written most (a row per incarnation and month): without a rowid
            # its primary key is the table, one B-tree less to update per row.
            types = {int: "INTEGER", float: "REAL", str: "TEXT"}
            self.conn.execute(
                "CREATE TABLE IF NOT EXISTS cost_lines (" + ", ".join(
                    f"[{c}] {types[t]}" for c, t in LINE_COLUMNS.items())
                + ", PRIMARY KEY (owner, period, start)) WITHOUT ROWID")
            for name, columns, key in tables:
                self.db[name].create(columns, pk=key, if_not_exists=True)  # type: ignore[union-attr]
            for table, column in (("jobs", "start_ts"), ("jobs", "cost_center"),
                                  ("egress", "finished_at"), ("cost_lines", "period")):
                self.db[table].create_index([column], if_not_exists=True)  # type: ignore[union-attr]
            self._check_columns([*((n, c) for n, c, _ in tables), ("cost_lines", LINE_COLUMNS)])
            self.conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)",
                              [str(SCHEMA_VERSION)])
        found = meta_schema_version(self.conn)
        if found != str(SCHEMA_VERSION):
            raise BillingError(f"{self.path} has billing schema {found}, this slurm-geo "
                               f"writes {SCHEMA_VERSION}; move it aside and ingest again")

    def _check_columns(self, tables: Sequence[tuple[str, Mapping[str, type]]]) -> None:
        for name, columns in tables:
            found = {r[1] for r in self.conn.execute(f"PRAGMA table_info([{name}])")}
            if found != set(columns):
                raise BillingError(f"{self.path}: table {name} is not the one this slurm-geo "
                                   "writes; move the database aside and ingest again")

    # --- writing ------------------------------------------------------------------------

    def upsert(self, table: str, columns: Sequence[str], key: Sequence[str],
               rows: Iterable[Sequence[Any]]) -> None:
        self.conn.executemany(upsert_sql(table, columns, key), rows)

    def replace_lines(self, owners: Sequence[str], lines: Iterable[Sequence[Any]]) -> None:
        self.conn.executemany("DELETE FROM cost_lines WHERE owner = ?", ((o,) for o in owners))
        columns = list(LINE_COLUMNS)
        self.conn.executemany(f"INSERT INTO cost_lines ({', '.join(columns)}) VALUES "
                              f"({', '.join('?' for _ in columns)})", lines)

    def add_problems(self, rows: Iterable[tuple[str, int, str, str]]) -> None:
        self.conn.executemany("INSERT OR IGNORE INTO problems (cluster, line, text, reason) "
                              "VALUES (?, ?, ?, ?)", rows)

    def count_restarts(self) -> None:
        """Each incarnation's number: how many of the same job id were submitted before it."""
        self.conn.execute(
            "UPDATE jobs SET restarts = (SELECT COUNT(*) FROM jobs AS e WHERE e.cluster = "
            "jobs.cluster AND e.job_id = jobs.job_id AND e.submit_ts < jobs.submit_ts) "
            "WHERE restarts IS NULL OR restarts != (SELECT COUNT(*) FROM jobs AS e WHERE "
            "e.cluster = jobs.cluster AND e.job_id = jobs.job_id AND e.submit_ts < "
            "jobs.submit_ts)")

    def set_prices(self, entries: Sequence[PriceEntry], clusters: Mapping[str, ClusterFacts]
                   ) -> bool:
        """Make the price table and clusters those of the config; True if they changed."""
        before = self.price_rows(), self.cluster_rows()
        with self.conn:
            self.conn.execute("DELETE FROM prices")
            self.conn.execute("DELETE FROM clusters")
            self.upsert("prices", list(PRICE_COLUMNS), ("cluster", "provider", "effective_from"),
                        [[e.cluster, e.provider, e.effective_from, e.gpu_hour, e.cpu_hour,
                          e.egress_per_gb, e.marketplace_fee_pct, e.source] for e in entries])
            self.upsert("clusters", ["name", "region", "provider"], ("name",),
                        [[c.name, c.region, c.provider] for c in clusters.values()])
        return (self.price_rows(), self.cluster_rows()) != before

    def set_watermark(self, source: str, value: int) -> None:
        with self.conn:
            self.upsert("watermarks", ["source", "value"], ("source",), [[source, value]])

    # --- reading ------------------------------------------------------------------------

    def watermark(self, source: str) -> int | None:
        row = self.conn.execute("SELECT value FROM watermarks WHERE source = ?",
                                [source]).fetchone()
        return None if row is None else int(row[0])

    def price_rows(self) -> list[tuple[Any, ...]]:
        return [tuple(r) for r in self.conn.execute(
            "SELECT * FROM prices ORDER BY cluster, provider, effective_from")]

    def cluster_rows(self) -> list[tuple[Any, ...]]:
        return [tuple(r) for r in self.conn.execute("SELECT * FROM clusters ORDER BY name")]

    def prices(self) -> tuple[list[PriceEntry], dict[str, ClusterFacts]]:
        entries = [PriceEntry(r["effective_from"], r["gpu_hour"], r["cpu_hour"],
                              r["egress_per_gb"], r["marketplace_fee_pct"], r["cluster"],
                              r["provider"], r["source"])
                   for r in self.conn.execute("SELECT * FROM prices")]
        clusters = {r["name"]: ClusterFacts(r["name"], r["region"], r["provider"])
                    for r in self.conn.execute("SELECT * FROM clusters")}
        return entries, clusters

    def jobs_in(self, start: int, end: int) -> Iterator[sqlite3.Row]:
        """Incarnations that ran at some point of [start, end)."""
        return self.conn.execute(
            "SELECT * FROM jobs WHERE start_ts IS NOT NULL AND start_ts < ? AND "
            "COALESCE(end_ts, as_of) > ? ORDER BY cluster, job_id, submit_ts", [end, start])

    def incarnations_of(self, cluster: str, start: int, end: int) -> Iterator[sqlite3.Row]:
        """One cluster's incarnations that ran at some point of [start, end): what `billing
        check` compares with that cluster's accounting."""
        return self.conn.execute(
            "SELECT job_id, submit_ts, start_ts, end_ts, elapsed_s, cpus, gpus, as_of FROM "
            "jobs WHERE cluster = ? AND start_ts IS NOT NULL AND start_ts < ? AND "
            "(COALESCE(end_ts, as_of) > ? OR start_ts >= ?)", [cluster, end, start, start])

    def jobs_by_keys(self, keys: Sequence[tuple[str, int, int]]) -> list[sqlite3.Row]:
        rows = []
        for key in keys:
            rows += self.conn.execute("SELECT * FROM jobs WHERE cluster = ? AND job_id = ? "
                                      "AND submit_ts = ?", key).fetchall()
        return rows

    def egress_in(self, start: int, end: int) -> Iterator[sqlite3.Row]:
        return self.conn.execute(
            "SELECT * FROM egress WHERE finished_at >= ? AND finished_at < ? ORDER BY "
            "finished_at, run, step, object", [start, end])

    def job_line_sums(self, period: str, by: str) -> Iterator[tuple[Any, ...]]:
        """(group, cluster, cpu-seconds, cpu USD, gpu-seconds, gpu USD, fee USD, lines
        without price) of the stored job lines of a calendar month, grouped as `report`
        groups."""
        key = {"cost-center": "CASE WHEN cost_center = '' THEN '(none)' ELSE cost_center END",
               "user": "CASE WHEN user = '' THEN '(unknown)' ELSE user END",
               "cluster": "cluster", "job": "job"}[by]
        return self.conn.execute(
            f"SELECT {key} AS grp, cluster, "
            "TOTAL(cpu_seconds), TOTAL(cpu_usd), TOTAL(gpu_seconds), TOTAL(gpu_usd), "
            "TOTAL(fee_usd), SUM(CASE WHEN price_from IS NULL THEN 1 + (gpu_seconds > 0) "
            "ELSE 0 END) FROM cost_lines WHERE period = ? AND owner LIKE 'job:%' "
            "GROUP BY grp, cluster", [period])

    def flagged_jobs(self, start: int, end: int) -> Iterator[sqlite3.Row]:
        return self.conn.execute(
            "SELECT cluster, job_id, restarts, alloc_tres, flags FROM jobs WHERE flags != '' "
            "AND start_ts IS NOT NULL AND start_ts < ? AND COALESCE(end_ts, as_of) > ? "
            "ORDER BY cluster, job_id, submit_ts", [end, start])

    def unpriced_jobs(self, period: str) -> Iterator[sqlite3.Row]:
        return self.conn.execute(
            "SELECT cluster, job, MIN(start) AS since FROM cost_lines WHERE period = ? AND "
            "owner LIKE 'job:%' AND price_from IS NULL GROUP BY owner ORDER BY owner",
            [period])

    def problems(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self.conn.execute(
            "SELECT * FROM problems ORDER BY cluster, line, text")]

    def dump(self) -> dict[str, list[tuple[Any, ...]]]:
        """Every table's rows, sorted: what "nothing changed" is checked against."""
        names = [r[0] for r in self.conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
        return {name: sorted((tuple(r) for r in self.conn.execute(f"SELECT * FROM [{name}]")),
                             key=repr) for name in names}
