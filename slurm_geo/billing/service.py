"""What the CLI and the timer run: ingest every cluster, build a period's lines. Thin I/O
around the pure parts; Slurm clients are passed in (`connect`), never created here."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from slurm_geo.billing import ingest, sources
from slurm_geo.billing.config import BillingConfig
from slurm_geo.billing.costs import CostLine, PriceTable
from slurm_geo.billing.db import BillingDB
from slurm_geo.billing.periods import Period
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
    EGRESS_SETTLE_S,
    REGISTRY,
    Outcome,
    SourceRun,
    covered_key,
    covered_until,
)
from slurm_geo.errors import SlurmGeoError

DAY = 86400
EGRESS_OVERLAP_S = 3600


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


def run_ingest(db: BillingDB, config: BillingConfig, clients: Sequence[Any], now: int,
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
        lineage, registry_jobs = ingest.read_registry(config.registry)
    except SlurmGeoError as exc:
        needs = ("not read: it needs the registry, and what it bills without it would stay "
                 "wrong")
        result.sources += [sources.failed(REGISTRY, exc), *(
            SourceRun(name, Outcome.SKIPPED, needs)
            for name in [*(ingest.accounting_source(c.cluster) for c in clients), EGRESS])]
        return result
    if config.registry is not None:
        result.sources.append(SourceRun(REGISTRY, Outcome.READ, f"{len(lineage)} lineage "
                                        f"link(s), {len(registry_jobs)} geo job(s)"))
    window = _Window(now, since, until, now - config.first_ingest_days * DAY)
    for client in clients:
        result.sources.append(_ingest_cluster(db, client, window, lineage, table, result))
    result.sources.append(_ingest_egress(db, config, window, registry_jobs, table, result))
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


def _ingest_cluster(db: BillingDB, client: Any, window: _Window, lineage: ingest.Lineage,
                    table: PriceTable, result: IngestResult) -> SourceRun:
    source = ingest.accounting_source(client.cluster)
    before = db.watermark(source)
    start = window.start(before)
    try:
        stats = ingest.ingest_cluster(db, client, start, window.end, lineage, table)
    except SlurmGeoError as exc:
        return sources.failed(source, exc, start, window.end, before)
    result.clusters.append(stats)
    _cover(db, source, covered_until(window.until, window.now, ACCOUNTING_SETTLE_S))
    return SourceRun(source, Outcome.READ,
                     f"{stats.incarnations} incarnation(s) from {stats.records} record(s), "
                     f"{stats.malformed} malformed, {stats.pending} pending",
                     since=start, until=window.end, watermark=db.watermark(source))


def _ingest_egress(db: BillingDB, config: BillingConfig, window: _Window,
                   registry_jobs: list[Any], table: PriceTable, result: IngestResult
                   ) -> SourceRun:
    before = db.watermark(EGRESS)
    # Read again from an hour before the watermark: checkpoint-sync records a transfer
    # when its object is in, which may be long after it began; rows are keyed, so a
    # transfer read twice is stored once.
    start = window.since if window.since is not None else max(
        0, (before or window.first) - EGRESS_OVERLAP_S)
    try:
        result.transfers = ingest.ingest_egress(db, config.sync_state, config.federation_audit,
                                                registry_jobs, table, start, window.end)
    except SlurmGeoError as exc:
        return sources.failed(EGRESS, exc, start, window.end, before)
    _cover(db, EGRESS, covered_until(window.until, window.now, EGRESS_SETTLE_S))
    return SourceRun(EGRESS, Outcome.READ, f"{result.transfers} transfer(s)", since=start,
                     until=window.end, watermark=db.watermark(EGRESS))


def _cover(db: BillingDB, source: str, until: int) -> None:
    """Record that `source` is in up to `until`; a backfill of an older window never
    takes it back."""
    key = covered_key(source)
    db.set_watermark(key, max(until, db.watermark(key) or until))


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


def connect_all(site: Any, names: Sequence[str], connect: Callable[[Any], Any]) -> list[Any]:
    """Clients for `names` (default: every cluster of the site), by the Slurm layer."""
    return [connect(site.cluster(name)) for name in (names or sorted(site.clusters))]
