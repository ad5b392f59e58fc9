"""`billing ingest`: accounting from every cluster, and egress from checkpoint-sync's
transfers and the federation daemon's copies, into the billing database. Incremental by
watermark, idempotent, streamed in batches.

Each cluster is asked, through the Slurm layer, for every incarnation (requeues included)
that overlaps [watermark, until), by `SlurmClient.accounting_rows`: CLI clusters read
sacct --parsable2 a line at a time, REST clusters stream slurmrestd's one document. Records
are upserted on slurmdbd's own key (cluster, job id, submit time), so fetching a record
twice replaces it with itself. The next watermark is `until`, or earlier when an
incarnation had not finished (it must be fetched again). Rows that cannot be read go to
`problems`, verbatim.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import islice
from pathlib import Path
from typing import Any

from slurm_geo.billing import attribution, costs, records
from slurm_geo.billing.db import EGRESS_COLUMNS, EGRESS_KEY, JOB_COLUMNS, JOB_KEY, BillingDB
from slurm_geo.billing.lineage import LegOwner, Owners, attribute
from slurm_geo.billing.outages import Outage, cut_short, estimate_flag, start_known
from slurm_geo.billing.periods import Period, epoch, months_overlapping, next_watermark
from slurm_geo.ckpt.format.names import manifest_name
from slurm_geo.config.daemons import FederationConfig
from slurm_geo.federation.state.audit import Entry
from slurm_geo.slurm.client import SlurmClient
from slurm_geo.slurm.models import AccountingRecord, MalformedAccountingRow
from slurm_geo.sync.reader import SyncStateReader

BATCH = 5000
EGRESS_SOURCE = "egress"
# (cluster, job id) -> its logical job: `Owners.lineage()`.
Lineage = Mapping[tuple[str, int], LegOwner]


@dataclass
class IngestStats:
    cluster: str
    since: int
    until: int
    records: int = 0
    incarnations: int = 0
    malformed: int = 0
    pending: int = 0
    unfinished_since: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"cluster": self.cluster, "since": _iso(self.since), "until": _iso(self.until),
                "records": self.records, "incarnations": self.incarnations,
                "malformed": self.malformed, "pending": self.pending}


# --- pure: a record becomes a row -------------------------------------------------------

def _ts(moment: datetime | None) -> int | None:
    return None if moment is None else epoch(moment)


def incarnation_row(record: AccountingRecord, lineage: Lineage, as_of: int,
                    outages: Sequence[Outage] = ()) -> list[Any]:
    """The `jobs` row of one accounting record, in JOB_COLUMNS order. A leg of a logical
    job whose cluster was lost while it ran ends where the federation daemon last saw the
    cluster (outages), flagged estimated."""
    leg = lineage.get((record.cluster, record.job_id))
    center, source = attribution.cost_center_of(record.admin_comment, record.comment,
                                                record.account, leg.cost_center if leg else "")
    tres_text, gpus, unknown = attribution.tres_facts(record.allocated_tres)
    flags = [f"unknown TRES {name}" for name in unknown]
    if source == "none":
        flags.append("no cost center")
    if not record.settled:
        flags.append("accounting not settled")
    start, end, elapsed = _ts(record.start_time), _ts(record.end_time), record.elapsed_s
    if leg:
        start = start_known(record.cluster, start, leg.trained_since, outages)
    lost = cut_short(record.cluster, start, end, outages) if leg else None
    if lost is not None and start is not None:
        end = max(start, int(lost.last_ok))
        elapsed = end - start
        flags.append(estimate_flag(lost))
    elif record.end_time is None:
        flags.append("running")
    return [record.cluster, record.job_id, _ts(record.submit_time), 0,
            leg.logical_id if leg else f"{record.cluster}:{record.job_id}",
            record.name, record.user, record.account, center, source, record.partition,
            start, end, elapsed,
            record.allocated_tres.get("cpu", 0), gpus, tres_text, record.state.value,
            int(record.settled), "; ".join(flags), as_of]


def malformed_reason(record: AccountingRecord) -> str | None:
    """Why a record parsed from JSON still cannot be billed; None if it can."""
    if record.job_id <= 0:
        return "no job id"
    if record.submit_time is None:
        return "no submit time"
    if record.start_time and record.end_time and record.end_time < record.start_time:
        return "ends before it starts"
    if record.elapsed_s < 0:
        return "negative elapsed time"
    return None


def job_owner(cluster: str, job_id: int, submit_ts: int) -> str:
    return f"job:{cluster}:{job_id}:{submit_ts}"


# Positions in a `jobs` row (JOB_COLUMNS order): ingest reads rows as lists, not dicts.
_COL = {name: i for i, name in enumerate(JOB_COLUMNS)}
(_CLUSTER, _JOB_ID, _SUBMIT, _START, _END, _ELAPSED, _CPUS, _GPUS, _CENTER, _USER,
 _AS_OF) = (_COL[n] for n in ("cluster", "job_id", "submit_ts", "start_ts", "end_ts",
                               "elapsed_s", "cpus", "gpus", "cost_center", "user", "as_of"))


def job_line_rows(row: Sequence[Any], prices: costs.PriceTable) -> list[list[Any]]:
    """`cost_lines` rows of an incarnation (a `jobs` row in JOB_COLUMNS order): its lines
    in each calendar month it touched."""
    start, end, as_of = row[_START], row[_END], row[_AS_OF]
    if start is None:
        return []
    cluster, job_id = row[_CLUSTER], row[_JOB_ID]
    owner = job_owner(cluster, job_id, row[_SUBMIT])
    job, center, user = f"{cluster}:{job_id}", row[_CENTER], row[_USER]
    out = []
    for month in months_overlapping(start, end if end is not None else as_of):
        for charge in costs.job_charges(cluster, row[_CPUS], row[_GPUS], start, end,
                                        row[_ELAPSED], as_of, month, prices):
            out.append([owner, month.label, *charge, None, None, None, center, user, job])
    return out


def _egress_line_row(owner: str, month: Period, line: costs.CostLine, center: str,
                     user: str, job: str) -> list[Any]:
    """A `cost_lines` row (LINE_COLUMNS order) of one transfer's egress line."""
    return [owner, month.label, line.cluster, line.start, line.end, line.price_from,
            0, None, None, 0, None, None, None, None, line.quantity, line.unit_price,
            line.amount, center, user, job]


# --- I/O: accounting ----------------------------------------------------------------------

def ingest_records(db: BillingDB, items: Iterable[AccountingRecord | MalformedAccountingRow],
                   stats: IngestStats, lineage: Lineage, as_of: int,
                   prices: costs.PriceTable, batch: int = BATCH,
                   outages: Sequence[Outage] = ()) -> IngestStats:
    """Upsert `items` in batches (bounded memory), with their cost lines and problems."""
    columns = list(JOB_COLUMNS)
    iterator = iter(items)
    while chunk := list(islice(iterator, batch)):
        rows, problems = [], []
        for item in chunk:
            stats.records += 1
            if isinstance(item, MalformedAccountingRow):
                problems.append((item.cluster, item.line, item.text, item.reason))
                continue
            reason = malformed_reason(item)
            if reason is not None:
                problems.append((item.cluster, stats.records, repr(item), reason))
                continue
            if item.end_time is None or not item.settled:  # to be fetched again
                stats.unfinished_since.append(epoch(item.start_time or item.submit_time
                                                    or datetime.fromtimestamp(as_of, UTC)))
            if item.start_time is None and item.end_time is None:
                stats.pending += 1
                continue
            rows.append(incarnation_row(item, lineage, as_of, outages))
        stats.malformed += len(problems)
        stats.incarnations += len(rows)
        _write_batch(db, columns, rows, problems, prices)
    return stats


def _write_batch(db: BillingDB, columns: list[str], rows: list[list[Any]],
                 problems: list[tuple[str, int, str, str]], prices: costs.PriceTable) -> None:
    lines = []
    for values in rows:
        lines += job_line_rows(values, prices)
    with db.conn:
        db.upsert("jobs", columns, JOB_KEY, rows)
        db.replace_lines([job_owner(r[0], r[1], r[2]) for r in rows], lines)
        db.add_problems(problems)


def fetch_accounting(client: SlurmClient, since: int, until: int
                     ) -> Iterable[AccountingRecord | MalformedAccountingRow]:
    """Every incarnation overlapping [since, until) that the cluster's accounting holds, or
    a SlurmError: a window that cannot be read completely is never an empty one. CLI
    clusters stream `sacct --parsable2`; REST ones answer one JSON document."""
    return client.accounting_rows(datetime.fromtimestamp(since, UTC),
                                  datetime.fromtimestamp(until, UTC))


def accounting_source(cluster: str) -> str:
    """The name of a cluster's accounting as a source: its watermark's key, and what
    `billing ingest` and `billing check` report it as."""
    return f"accounting:{cluster}"


def ingest_cluster(db: BillingDB, client: SlurmClient, since: int, until: int, lineage: Lineage,
                   prices: costs.PriceTable, outages: Sequence[Outage] = ()) -> IngestStats:
    """One cluster's window [since, until) through its SlurmClient; moves its watermark
    only once the whole window is in (a SlurmError leaves it where it was)."""
    stats = IngestStats(client.cluster, since, until)
    ingest_records(db, fetch_accounting(client, since, until), stats, lineage, until, prices,
                   outages=outages)
    db.count_restarts()
    db.set_watermark(accounting_source(client.cluster),
                     next_watermark(until, stats.unfinished_since))
    return stats


def reprice_all(db: BillingDB, prices: costs.PriceTable) -> int:
    """Recompute every job's cost lines (after the price table changed)."""
    columns = list(JOB_COLUMNS)
    count = 0
    for rows in _pages(db, "jobs", columns):
        _write_batch(db, columns, rows, [], prices)
        count += len(rows)
    for rows in _pages(db, "egress", list(EGRESS_COLUMNS)):
        _write_egress(db, rows, prices)
        count += len(rows)
    return count


def _pages(db: BillingDB, table: str, columns: list[str]) -> Iterable[list[list[Any]]]:
    """A table's rows, BATCH at a time by rowid (safe to write between pages)."""
    last = 0
    while True:
        chunk = db.conn.execute(f"SELECT rowid, {', '.join(columns)} FROM {table} WHERE "
                                f"rowid > ? ORDER BY rowid LIMIT {BATCH}", [last]).fetchall()
        if not chunk:
            return
        last = chunk[-1][0]
        yield [list(r)[1:] for r in chunk]


# --- egress ------------------------------------------------------------------------------

def egress_owner(row: Mapping[str, Any]) -> str:
    return f"egress:{row['run']}:{row['step']}:{row['object']}:{row['kind']}:{row['started_at']}"


def egress_row(transfer: Mapping[str, Any], owners: Owners,
               job_dirs: Mapping[str, Sequence[str]] | None = None) -> list[Any]:
    """The `egress` row of one transfer (checkpoint-sync's, or the daemon's copy), with the
    logical job, leg and cost center it is charged to (`billing.lineage.attribute`)."""
    owner = attribute(transfer, owners, job_dirs)
    return [transfer["run"], transfer["step"], transfer["object"], transfer["kind"],
            transfer["started_at"], transfer["finished_at"], transfer["bytes"] or 0,
            transfer["source"], transfer["destination"], transfer["source_region"],
            transfer["destination_region"], owner.cluster, owner.job_id, owner.logical_id,
            owner.user, owner.cost_center, "directive" if owner.cost_center else "none"]


def ingest_egress(db: BillingDB, sync_state: Path | None, federation_audit: Path | None,
                  owners: Owners, prices: costs.PriceTable, since: int,
                  until: int, federation_etcd: FederationConfig | None = None) -> int:
    """Checkpoint transfers finished in [since, until): checkpoint-sync's (when [sync] is
    configured: its state must be readable) and the federation daemon's copies when a job
    moves (when its audit log exists; the replicas' in etcd with `federation_etcd`), each
    charged through `owners`."""
    job_dirs = records.job_directories(sync_state)
    copies = records.audit_entries(federation_audit, ("transfer",), federation_etcd)
    transfers = (_sync_transfers(sync_state, since, until)
                 + federation_transfers(copies, since, until))
    rows = [egress_row(t, owners, job_dirs) for t in transfers]
    _write_egress(db, rows, prices)
    db.set_watermark(EGRESS_SOURCE, until)
    return len(rows)


def _sync_transfers(sync_state: Path | None, since: int, until: int) -> list[Mapping[str, Any]]:
    """checkpoint-sync's transfers, when [sync] is configured. Its state must then be
    readable: a missing or unreadable one raises `SyncStateUnreadable` (ingest fails and
    the egress watermark stays) rather than billing no egress."""
    if sync_state is None:
        return []
    # vars(), not asdict(): the rows are flat, and asdict's deep copy took 60 % of an
    # egress ingest (bench/billing_ingest.py).
    return [dict(vars(t)) for t in SyncStateReader(sync_state).transfers_finished(since, until)]


def federation_transfers(entries: Iterable[Entry], since: int, until: int
                         ) -> list[Mapping[str, Any]]:
    """The daemon's checkpoint copies (audit entries of kind "transfer") finished in
    [since, until), as checkpoint-sync's transfer rows. Entries of daemons that did not yet
    record where the copy went (no "run" in the detail) are skipped."""
    transfers: list[Mapping[str, Any]] = []
    for entry in entries:
        detail = entry.detail
        if entry.kind != "transfer" or "run" not in detail:
            continue
        finished = entry.unix_time
        if not since <= finished < until:
            continue
        transfers.append({
            "logical_job": entry.logical_job, "run": detail["run"], "step": detail["step"],
            "object": manifest_name(detail["run"], detail["step"]), "kind": "move",
            "started_at": finished - float(detail.get("seconds", 0.0)),
            "finished_at": finished, "bytes": detail.get("bytes", 0),
            "source": detail["source"], "destination": detail["destination"],
            "source_region": detail["source_region"],
            "destination_region": detail["destination_region"]})
    return transfers


def _write_egress(db: BillingDB, rows: list[list[Any]], prices: costs.PriceTable) -> None:
    columns = list(EGRESS_COLUMNS)
    lines = []
    for values in rows:
        row = dict(zip(columns, values, strict=True))
        line = costs.egress_line(row["bytes"], row["source_region"] or "",
                                 row["destination_region"] or "", int(row["finished_at"]),
                                 prices)
        if line is not None:
            month = months_overlapping(line.start, line.start)[0]
            lines.append(_egress_line_row(egress_owner(row), month, line, row["cost_center"],
                                   row["user"], f"{row['job_cluster']}:{row['job_id']}"
                                   if row["job_id"] is not None else f"run:{row['run']}"))
    with db.conn:
        db.upsert("egress", columns, EGRESS_KEY, rows)
        db.replace_lines([egress_owner(dict(zip(columns, r, strict=True))) for r in rows], lines)


def _iso(seconds: int) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
