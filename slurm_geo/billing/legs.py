"""What each Slurm job of a logical job (a leg, all its incarnations) costs, as billing
bills it: for the drill's cost table, which must never be a second computation (it once
billed a lost leg Slurm's 665 s where billing said 245 s, estimated; issue 29).

The arithmetic is ingest's own: each accounting record becomes the `jobs` row ingest would
store (`ingest.incarnation_row`: a leg cut short by its cluster's loss ends where the
federation daemon last saw the cluster, flagged estimated), and that row the cost lines
ingest would store (`ingest.job_line_rows`). `leg_cost` is pure; `leg_costs` reads the
records billing reads (the registry, the daemon's state and audit log, the accounting).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from slurm_geo.billing import ingest, records
from slurm_geo.billing.config import BillingConfig
from slurm_geo.billing.costs import PriceTable
from slurm_geo.billing.db import JOB_COLUMNS, LINE_COLUMNS
from slurm_geo.billing.outages import Outage
from slurm_geo.errors import SlurmGeoError
from slurm_geo.slurm.client import SlurmClient
from slurm_geo.slurm.models import AccountingRecord, MalformedAccountingRow

_ELAPSED = list(JOB_COLUMNS).index("elapsed_s")
_FLAGS = list(JOB_COLUMNS).index("flags")


@dataclass(frozen=True)
class LegCost:
    """One Slurm job's cost, every incarnation together, as billing bills it."""

    cluster: str
    job_id: int
    elapsed_s: int       # billed seconds (an estimated leg's, to its cluster's last answer)
    cpu_seconds: int
    gpu_seconds: int
    compute_usd: float   # CPU and GPU lines
    fee_usd: float       # the marketplace fee
    unpriced: bool = False       # a stretch had no price: its amount is not in the figures
    flags: tuple[str, ...] = ()  # as billing's report flags the job (estimated, running, ...)

    @property
    def total_usd(self) -> float:
        return self.compute_usd + self.fee_usd

    def as_dict(self) -> dict[str, Any]:
        return {"cluster": self.cluster, "job_id": self.job_id, "elapsed_s": self.elapsed_s,
                "cpu_seconds": self.cpu_seconds, "gpu_seconds": self.gpu_seconds,
                "compute_usd": round(self.compute_usd, 6), "fee_usd": round(self.fee_usd, 6),
                "total_usd": round(self.total_usd, 6), "unpriced": self.unpriced,
                "flags": list(self.flags)}


def leg_cost(cluster: str, job_id: int,
             found: Iterable[AccountingRecord | MalformedAccountingRow],
             lineage: ingest.Lineage, outages: Sequence[Outage], prices: PriceTable,
             as_of: int) -> LegCost:
    """The cost of one job's accounting records, as ingest would store them at `as_of`."""
    rows = [ingest.incarnation_row(record, lineage, as_of, outages) for record in found
            if isinstance(record, AccountingRecord) and ingest.malformed_reason(record) is None
            and record.start_time is not None]
    lines = [dict(zip(LINE_COLUMNS, line, strict=True))
             for row in rows for line in ingest.job_line_rows(row, prices)]
    flags = tuple(dict.fromkeys(flag for row in rows for flag in row[_FLAGS].split("; ")
                                if flag))
    return LegCost(
        cluster, job_id, sum(row[_ELAPSED] or 0 for row in rows),
        sum(line["cpu_seconds"] or 0 for line in lines),
        sum(line["gpu_seconds"] or 0 for line in lines),
        sum((line["cpu_usd"] or 0.0) + (line["gpu_usd"] or 0.0) for line in lines),
        sum(line["fee_usd"] or 0.0 for line in lines),
        any(line["price_from"] is None for line in lines), flags)


def leg_costs(config: BillingConfig, clients: Mapping[str, SlurmClient],
              jobs: Sequence[tuple[str, int]], now: int) -> list[LegCost]:
    """Each job's cost as billing bills it now. A record billing could not read (the
    registry, the daemon's records, a cluster's accounting) is said in the leg's flags,
    never left out silently."""
    problems: list[str] = []
    try:
        owners, outages = records.read_ownership(config.registry, config.federation_state,
                                                 config.federation_audit,
                                                 config.federation_etcd)
        lineage: ingest.Lineage = owners.lineage()
    except SlurmGeoError as exc:
        lineage, outages = {}, []
        problems.append(f"not linked to its logical job, no outage known: {exc}")
    prices = PriceTable(config.prices, config.clusters)
    legs = []
    for cluster, job_id in jobs:
        try:
            found = clients[cluster].accounting([job_id])
            unread = []
        except SlurmGeoError as exc:
            found, unread = [], [f"accounting not read: {exc}"]
        leg = leg_cost(cluster, job_id, found, lineage, outages, prices, now)
        legs.append(replace(leg, flags=(*leg.flags, *problems, *unread)))
    return legs
