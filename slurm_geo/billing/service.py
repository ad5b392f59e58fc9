"""What the CLI and the timer run: ingest every cluster, build a period's lines. Thin I/O
around the pure parts; Slurm clients are passed in (`connect`), never created here."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from slurm_geo.billing import ingest, records
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
from slurm_geo.errors import SlurmGeoError

DAY = 86400
EGRESS_OVERLAP_S = 3600


@dataclass
class IngestResult:
    clusters: list[ingest.IngestStats] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)
    transfers: int = 0
    repriced: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"clusters": [s.as_dict() for s in self.clusters], "failures": self.failures,
                "transfers": self.transfers, "repriced": self.repriced}


def run_ingest(db: BillingDB, config: BillingConfig, clients: Sequence[Any], now: int,
               since: int | None = None, until: int | None = None) -> IngestResult:
    """Ingest each cluster from its watermark (or `since`) to `until` (default: now).

    A cluster that cannot be reached is recorded in `failures` and the others go on; its
    watermark stays, so the next run fetches what was missed.
    """
    result = IngestResult()
    table = PriceTable(config.prices, config.clusters)
    if db.set_prices(config.prices, config.clusters):
        result.repriced = ingest.reprice_all(db, table)
    owners = records.read_owners(config.registry, config.federation_state,
                                 config.federation_audit)
    lineage = owners.lineage()
    end = until if until is not None else now
    first = now - config.first_ingest_days * DAY
    for client in clients:
        start = since if since is not None else (
            db.watermark(f"accounting:{client.cluster}") or first)
        try:
            stats = ingest.ingest_cluster(db, client, start, end, lineage, table)
        except SlurmGeoError as exc:
            result.failures[client.cluster] = str(exc)  # the caller reports it
            continue
        result.clusters.append(stats)
    egress_since = since if since is not None else max(
        0, (db.watermark(ingest.EGRESS_SOURCE) or first) - EGRESS_OVERLAP_S)
    result.transfers = ingest.ingest_egress(db, config.sync_state, config.federation_audit,
                                            owners, table, egress_since, end)
    return result


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
