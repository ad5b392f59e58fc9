"""What the CLI and the timer run: ingest every source, check what was ingested against
them, build a period's lines. Thin I/O around the pure parts (`sources`, `check`, costs,
reports); Slurm clients are passed in (`connect`), never created here."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from slurm_geo.billing import check, ingest, records, sources
from slurm_geo.billing.config import BillingConfig
from slurm_geo.billing.costs import CostLine, PriceTable
from slurm_geo.billing.db import JOB_COLUMNS, BillingDB
from slurm_geo.billing.errors import BillingDiffers, BillingUncompared
from slurm_geo.billing.lineage import Owners
from slurm_geo.billing.outages import Outage
from slurm_geo.billing.periods import Period, iso
from slurm_geo.billing.report import (
    Flag,
    Owner,
    Report,
    Totals,
    build_report,
    job_flag,
    no_price_flag,
    priced,
)
from slurm_geo.billing.sources import (
    ACCOUNTING_SETTLE_S,
    EGRESS,
    EGRESS_RECORD_S,
    EGRESS_SETTLE_S,
    OWNERSHIP,
    Outcome,
    SourceRun,
    covered_key,
    covered_until,
    ingested_key,
)
from slurm_geo.config.model import ClusterConfig, SiteConfig
from slurm_geo.errors import SlurmGeoError
from slurm_geo.slurm.client import SlurmClient
from slurm_geo.slurm.models import MalformedAccountingRow
from slurm_geo.sync.reader import SyncStateReader

DAY = 86400
EGRESS_OVERLAP_S = EGRESS_SETTLE_S  # how late checkpoint-sync may record a transfer


@dataclass
class IngestResult:
    """Every source's outcome (`sources`), and what was read of each cluster."""

    clusters: list[ingest.IngestStats] = field(default_factory=list)
    sources: list[SourceRun] = field(default_factory=list)
    transfers: int = 0
    repriced: int = 0

    @property
    def failures(self) -> dict[str, str]:
        """{source: the error, naming the fix} of each source not read completely."""
        return {r.source: r.detail for r in self.sources if r.outcome is Outcome.FAILED}

    @property
    def exit_code(self) -> int:
        return sources.exit_code(self.sources)

    def as_dict(self) -> dict[str, Any]:
        return {"sources": [r.as_dict() for r in self.sources],
                "clusters": [s.as_dict() for s in self.clusters], "failures": self.failures,
                "transfers": self.transfers, "repriced": self.repriced,
                "exit_code": self.exit_code}


def run_ingest(db: BillingDB, config: BillingConfig, clients: Sequence[SlurmClient], now: int,
               since: int | None = None, until: int | None = None) -> IngestResult:
    """Ingest each source from its watermark (or `since`) to `until` (default: now).

    A source that cannot be read completely ends FAILED in the result and keeps its
    watermark, so the next run reads the same window again; the others go on. Every other
    source needs the registry (lineage; who owns a checkpoint run): when it cannot be read,
    nothing is. Errors of the billing database itself are raised.
    """
    result = IngestResult()
    table = PriceTable(config.prices, config.clusters)
    if db.set_prices(config.prices, config.clusters):
        result.repriced = ingest.reprice_all(db, table)
    try:
        owners, outages = records.read_ownership(config.registry, config.federation_state,
                                                 config.federation_audit,
                                                 config.federation_etcd)
    except SlurmGeoError as exc:
        needs = ("not read: it needs the registry and the federation's records, and what "
                 "it bills without them would stay wrong")
        result.sources += [sources.failed(OWNERSHIP, exc), *(
            SourceRun(name, Outcome.SKIPPED, needs)
            for name in [*(ingest.accounting_source(c.cluster) for c in clients), EGRESS])]
        return result
    lineage = owners.lineage()
    if config.registry is not None:
        result.sources.append(SourceRun(OWNERSHIP, Outcome.READ, f"{len(lineage)} Slurm "
                                        "job(s) linked to their logical job"))
    window = _Window(now, since, until, now - config.first_ingest_days * DAY)
    for client in clients:
        result.sources.append(_ingest_cluster(db, client, window, lineage, outages, table,
                                              result))
    result.sources.append(_ingest_egress(db, config, window, owners, table, result))
    return result


@dataclass(frozen=True)
class _Window:
    now: int
    since: int | None  # as given (a backfill), else each source starts at its watermark
    until: int | None  # as given, else now
    first: int         # where a source never ingested starts

    @property
    def end(self) -> int:
        return self.until if self.until is not None else self.now

    def start(self, watermark: int | None) -> int:
        return self.since if self.since is not None else (watermark or self.first)


def _ingest_cluster(db: BillingDB, client: SlurmClient, window: _Window, lineage: ingest.Lineage,
                    outages: Sequence[Outage], table: PriceTable, result: IngestResult
                    ) -> SourceRun:
    source = ingest.accounting_source(client.cluster)
    before = db.watermark(source)
    start = window.start(before)
    try:
        stats = ingest.ingest_cluster(db, client, start, window.end, lineage, table, outages)
    except SlurmGeoError as exc:
        return sources.failed(source, exc, start, window.end, before)
    result.clusters.append(stats)
    _cover(db, source, covered_until(window.until, window.now, ACCOUNTING_SETTLE_S), window.end)
    return SourceRun(source, Outcome.READ,
                     f"{stats.incarnations} incarnation(s) from {stats.records} record(s), "
                     f"{stats.malformed} malformed, {stats.pending} pending",
                     since=start, until=window.end, watermark=db.watermark(source))


def _ingest_egress(db: BillingDB, config: BillingConfig, window: _Window,
                   owners: Owners, table: PriceTable, result: IngestResult
                   ) -> SourceRun:
    before = db.watermark(EGRESS)
    # Read again from an hour before the watermark: checkpoint-sync records a transfer
    # when its object is in, which may be long after it began; rows are keyed, so a
    # transfer read twice is stored once.
    start = window.since if window.since is not None else max(
        0, (before or window.first) - EGRESS_OVERLAP_S)
    try:
        result.transfers = ingest.ingest_egress(db, config.sync_state, config.federation_audit,
                                                owners, table, start, window.end,
                                                federation_etcd=config.federation_etcd)
    except SlurmGeoError as exc:
        return sources.failed(EGRESS, exc, start, window.end, before)
    _cover(db, EGRESS, covered_until(window.until, window.now, EGRESS_RECORD_S), window.end)
    return SourceRun(EGRESS, Outcome.READ, f"{result.transfers} transfer(s)", since=start,
                     until=window.end, watermark=db.watermark(EGRESS))


def _cover(db: BillingDB, source: str, until: int, read_until: int) -> None:
    """Record that `source` is in up to `until` and was read up to `read_until`; a backfill
    of an older window never takes either back."""
    for key, value in ((covered_key(source), until), (ingested_key(source), read_until)):
        db.set_watermark(key, max(value, db.watermark(key) or value))


@dataclass
class CheckResult:
    """`billing check` of a period: each source compared (or why not), and every
    difference found."""

    period: Period
    sources: list[SourceRun] = field(default_factory=list)
    totals: dict[str, dict[str, Any]] = field(default_factory=dict)  # source -> both sides
    differences: list[check.Difference] = field(default_factory=list)
    # source -> (since, until, ingest after): billed, not comparable yet (check.windows)
    uncompared: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    strict: bool = False  # --strict: what could not be compared yet fails the check (54)

    @property
    def failures(self) -> dict[str, str]:
        """{source: the error, naming the fix} of each source that could not be read."""
        return {r.source: r.detail for r in self.sources if r.outcome is Outcome.FAILED}

    @property
    def not_compared(self) -> list[tuple[str, str]]:
        """(source, line) of each window billed but not compared yet."""
        return [(source, check.not_compared(source, self.period.label, window))
                for source, window in self.uncompared.items()]

    @property
    def exit_code(self) -> int:
        """53 on any difference (money billed wrong is the finding that matters most), else
        as ingest's: the unreadable sources' code; else, with --strict, 54 when part of what
        was billed could not be compared yet."""
        if self.differences:
            return BillingDiffers.exit_code
        failed = sources.exit_code(self.sources)
        if failed or not (self.strict and self.uncompared):
            return failed
        return BillingUncompared.exit_code

    def compared(self, source: str, window: Period, billed: dict[str, int],
                 accounted: dict[str, int], found: list[check.Difference]) -> None:
        self.totals[source] = {"billed": billed, "accounted": accounted}
        self.differences += found
        self.sources.append(SourceRun(
            source, Outcome.READ, f"{len(found)} difference(s)" if found else "agrees",
            since=window.start, until=window.end))

    def as_dict(self) -> dict[str, Any]:
        return {"period": self.period.label,
                "sources": [{**r.as_dict(), **self.totals.get(r.source, {}),
                             **self._uncompared(r.source)} for r in self.sources],
                "differences": [d.as_dict() for d in self.differences],
                "strict": self.strict, "exit_code": self.exit_code}

    def _uncompared(self, source: str) -> dict[str, Any]:
        window = self.uncompared.get(source)
        return {} if window is None else {"not_compared": dict(zip(
            ("since", "until", "ingest_after"), (iso(t) for t in window), strict=True))}


def run_check(db: BillingDB, config: BillingConfig, clients: Sequence[SlurmClient], period: Period,
              now: int, strict: bool = False) -> CheckResult:
    """Compare what billing holds of `period` with what each source accounts for now,
    up to where ingest read that source completely (`sources.covered_key`); what it billed
    past that is named in `uncompared` (and fails a `strict` check)."""
    result = CheckResult(period, strict=strict)
    try:  # what ingest bills by: a leg cut short by an outage is estimated on both sides
        owners, outages = records.read_ownership(config.registry, config.federation_state,
                                                 config.federation_audit,
                                                 config.federation_etcd)
        lineage = owners.lineage()
    except SlurmGeoError as exc:
        result.sources.append(sources.failed(OWNERSHIP, exc))
        return result
    for client in clients:
        source = ingest.accounting_source(client.cluster)
        window = _compared(db, source, period, now, ACCOUNTING_SETTLE_S, result, [source])
        if window is None:
            continue
        try:
            accounted = check.usage(_accounted(client, window, lineage, outages), window)
        except SlurmGeoError as exc:
            result.sources.append(sources.failed(source, exc, window.start, window.end))
            continue
        billed = check.usage((check.Incarnation.of(dict(row)) for row in db.incarnations_of(
            client.cluster, window.start, window.end)), window)
        result.compared(source, window, check.Totals.of(billed).as_dict(),
                        check.Totals.of(accounted).as_dict(),
                        check.compare_usage(source, client.cluster, window, billed, accounted))
    _check_egress(db, config, period, now, result)
    return result


def _compared(db: BillingDB, source: str, period: Period, now: int, settle_s: int,
              result: CheckResult, names: Sequence[str]) -> Period | None:
    """The part of `period` billing claims to hold all of `source` for (`check.windows`);
    what it billed past that goes to `result.uncompared` under each of `names`, and a
    source with nothing to compare is `skipped` there, saying why."""
    found = check.windows(period, db.watermark(covered_key(source)),
                          db.watermark(ingested_key(source)), now, settle_s)
    if found.uncompared is not None:
        result.uncompared.update((name, found.uncompared) for name in names)
    if found.compared is None:
        detail = "nothing of the period ingested yet" if found.uncompared is None else \
            f"not compared yet: ingest again after {iso(found.uncompared[2])}"
        result.sources += [SourceRun(name, Outcome.SKIPPED, detail) for name in names]
    return found.compared


def _accounted(client: SlurmClient, window: Period, lineage: ingest.Lineage,
               outages: Sequence[Outage]) -> Iterator[check.Incarnation]:
    """The cluster's incarnations of `window` as ingest would store them now; rows it
    could not bill (flagged in reports) are left out on both sides."""
    for item in ingest.fetch_accounting(client, window.start, window.end):
        if isinstance(item, MalformedAccountingRow) or ingest.malformed_reason(item):
            continue
        row = ingest.incarnation_row(item, lineage, window.end, outages)
        yield check.Incarnation.of(dict(zip(JOB_COLUMNS, row, strict=True)))


def _check_egress(db: BillingDB, config: BillingConfig, period: Period, now: int,
                  result: CheckResult) -> None:
    """checkpoint-sync's transfers and the daemon's copies against billing's egress rows
    (the daemon's are stored with kind "move")."""
    wanted = [(name, origin, read) for name, origin, read, path in (
        ("egress:checkpoint-sync", "checkpoint-sync", _sync_transfers, config.sync_state),
        ("egress:federation", "the federation daemon", _daemon_copies,
         config.federation_audit or config.federation_etcd),
    ) if path is not None]
    if not wanted:
        return
    window = _compared(db, EGRESS, period, now, EGRESS_RECORD_S, result,
                       [name for name, _, _ in wanted])
    if window is None:
        return
    rows = [dict(r) for r in db.egress_in(window.start, window.end)]
    for name, origin, read in wanted:
        try:
            recorded = read(config, window)
        except SlurmGeoError as exc:
            result.sources.append(sources.failed(name, exc, window.start, window.end))
            continue
        moves = name == "egress:federation"
        billed = {check.transfer_key(r): r["bytes"] or 0 for r in rows
                  if (r["kind"] == "move") == moves}
        result.compared(name, window, _transfer_totals(billed), _transfer_totals(recorded),
                        check.compare_transfers(name, origin, window, billed, recorded))


def _sync_transfers(config: BillingConfig, window: Period) -> check.Transfers:
    assert config.sync_state is not None
    return {check.transfer_key(asdict(t)): t.bytes or 0 for t in
            SyncStateReader(config.sync_state).transfers_finished(window.start, window.end)}


def _daemon_copies(config: BillingConfig, window: Period) -> check.Transfers:
    """As ingest reads them: none while the daemon has written no audit log yet."""
    entries = records.audit_entries(config.federation_audit, ("transfer",),
                                    config.federation_etcd)
    return {check.transfer_key(t): t["bytes"] or 0 for t in
            ingest.federation_transfers(entries, window.start, window.end)}


def _transfer_totals(transfers: check.Transfers) -> dict[str, int]:
    return {"transfers": len(transfers), "bytes": sum(transfers.values())}


def period_lines(db: BillingDB, period: Period, flags: list[Flag]
                 ) -> Iterator[tuple[Owner, CostLine]]:
    entries, clusters = db.prices()
    table = PriceTable(entries, clusters)
    return priced(db.jobs_in(period.start, period.end),
                  db.egress_in(period.start, period.end), table, period, flags)


def report(db: BillingDB, period: Period, by: str, stored: bool | None = None) -> Report:
    """The report of `period`. A calendar month is added up from the cost lines ingest
    stored (fast: SQL does the sums); any other window is priced from the incarnations on
    the fly. Both use the same arithmetic (`costs.job_lines`), tested to agree."""
    if stored is None:
        stored = is_month(period)
    flags: list[Flag] = []
    if not stored:
        return build_report(period_lines(db, period, flags), period, by, flags, db.problems())
    for row in db.flagged_jobs(period.start, period.end):
        flags += [job_flag(row["cluster"], f"{row['cluster']}:{row['job_id']}",
                           row["restarts"], row["alloc_tres"], text)
                  for text in row["flags"].split("; ")]
    flags += [no_price_flag(r["cluster"], r["job"], r["since"])
              for r in db.unpriced_jobs(period.label)]
    entries, clusters = db.prices()
    egress = priced([], db.egress_in(period.start, period.end), PriceTable(entries, clusters),
                    period, flags)
    result = build_report(egress, period, by, flags, db.problems())
    groups, per_cluster = result.groups, result.clusters
    for key, cluster, cpu_s, cpu_usd, gpu_s, gpu_usd, fee_usd, unpriced in \
            db.job_line_sums(period.label, by):
        sums = (int(cpu_s), cpu_usd, int(gpu_s), gpu_usd, fee_usd, unpriced)
        for totals in (groups.get(key) or groups.setdefault(key, Totals()),
                       per_cluster.get(cluster) or per_cluster.setdefault(cluster, Totals()),
                       result.total):
            totals.add_job_sums(*sums)
    return result


def is_month(period: Period) -> bool:
    return bool(re.fullmatch(r"\d{4}-\d{2}", period.label))


def connect_all(site: SiteConfig, names: Sequence[str],
                connect: Callable[[ClusterConfig], SlurmClient]) -> list[SlurmClient]:
    """Clients for `names` (default: every cluster of the site), by the Slurm layer."""
    return [connect(site.cluster(name)) for name in (names or sorted(site.clusters))]
