"""Prices in force over time, and the cost lines of a job or a transfer. Pure arithmetic.

Every line can be redone by hand from the price table:

    cpu             = cpu-seconds / 3600 x cpu_hour
    gpu             = gpu-seconds / 3600 x gpu_hour
    marketplace_fee = (cpu + gpu of the same interval) x marketplace_fee_pct / 100
    egress          = bytes / 10^9 x egress_per_gb       (only between different regions)

each rounded to 6 decimals (micro-USD); invoices round their totals to cents. A job that
runs across a price change gets one line per price; a stretch without a price gets a
line with no amount, flagged.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from itertools import pairwise
from typing import NamedTuple

from slurm_geo.billing.config import ClusterFacts, PriceEntry
from slurm_geo.billing.periods import Period

KINDS = ("cpu", "gpu", "marketplace_fee", "egress")


class CostLine(NamedTuple):  # a tuple: ingest makes hundreds of thousands
    kind: str                 # one of KINDS
    cluster: str
    start: int                # the interval priced, Unix seconds
    end: int
    quantity: float           # cpu-seconds, gpu-seconds, USD (fee base) or bytes
    unit_price: float | None  # USD per cpu-hour / gpu-hour, percent, USD per GB; None: no price
    price_from: int | None    # effective_from of the price entry used
    amount: float | None      # USD; None when there was no price (flagged)


class PriceTable:
    """The price entries of each cluster as a timeline, cluster entries over provider ones."""

    def __init__(self, entries: Iterable[PriceEntry], clusters: Mapping[str, ClusterFacts]):
        self.clusters = dict(clusters)
        self._timelines: dict[str, tuple[list[int], list[PriceEntry]]] = {}
        entries = list(entries)
        for name, facts in self.clusters.items():
            mine = sorted((e for e in entries if e.cluster == name
                           or (not e.cluster and e.provider == facts.provider)),
                          key=lambda e: (e.effective_from, bool(e.cluster)))
            times: list[int] = []
            chosen: list[PriceEntry] = []
            for entry in mine:  # a cluster entry replaces a provider entry of the same time
                if times and times[-1] == entry.effective_from:
                    chosen[-1] = entry
                else:
                    times.append(entry.effective_from)
                    chosen.append(entry)
            self._timelines[name] = (times, chosen)

    def at(self, cluster: str, moment: int) -> PriceEntry | None:
        times, chosen = self._timelines.get(cluster, ([], []))
        index = bisect.bisect_right(times, moment) - 1
        return chosen[index] if index >= 0 else None

    def segments(self, cluster: str, start: int, end: int
                 ) -> list[tuple[int, int, PriceEntry | None]]:
        """[start, end) cut where the cluster's price changes, each with its price."""
        times, chosen = self._timelines.get(cluster, ([], []))
        index = bisect.bisect_right(times, start)
        if index == len(times) or times[index] >= end:  # one price all along: most jobs
            return [(start, end, chosen[index - 1] if index else None)]
        cuts = [t for t in times[index:] if t < end]
        bounds = [start, *cuts, end]
        return [(low, high, self.at(cluster, low)) for low, high in pairwise(bounds)]

    def egress_cluster(self, region: str) -> str | None:
        """The cluster whose provider bills traffic leaving `region` (first by name)."""
        for name in sorted(self.clusters):
            if self.clusters[name].region == region:
                return name
        return None


def _usd(value: float) -> float:
    return round(value, 6)


def billed_seconds(start: int | None, end: int | None, elapsed_s: int, as_of: int,
                   window: Period) -> tuple[int, int, int] | None:
    """(from, to, seconds) of an incarnation inside `window`; None if it did not run there.

    An incarnation still running is counted up to `as_of` (when it was last ingested). A
    finished one entirely inside the window counts Slurm's own elapsed time (which leaves
    out suspended time); one cut by the window counts the part inside, as sacct
    --truncate does.
    """
    if start is None:
        return None
    stop = end if end is not None else as_of
    clipped = window.clip(start, stop)
    if clipped is None:
        return None
    low, high = clipped
    whole = end is not None and low == start and high == end
    return low, high, (elapsed_s if whole else high - low)


class Charge(NamedTuple):
    """One stretch of an incarnation at one price: a stored `cost_lines` row, whose cpu, gpu
    and fee columns are the `cpu`, `gpu` and `marketplace_fee` lines (`lines_of`)."""

    cluster: str
    start: int
    end: int
    price_from: int | None    # effective_from of the entry used; None: no price (flagged)
    cpu_seconds: int
    cpu_hour: float | None
    cpu_usd: float | None
    gpu_seconds: int
    gpu_hour: float | None
    gpu_usd: float | None
    fee_pct: float | None
    fee_usd: float | None


def job_charges(cluster: str, cpus: int, gpus: int, start: int | None, end: int | None,
                elapsed_s: int, as_of: int, window: Period, prices: PriceTable
                ) -> list[Charge]:
    """What one incarnation costs inside `window`: a Charge per price in force."""
    span = billed_seconds(start, end, elapsed_s, as_of, window)
    if span is None:
        return []
    low, high, seconds = span
    segments = prices.segments(cluster, low, high)
    if len(segments) == 1:
        return [charge(cluster, low, high, cpus * seconds, gpus * seconds, segments[0][2])]
    return [charge(cluster, a, b, cpus * (b - a), gpus * (b - a), entry)
            for a, b, entry in segments]


def charge(cluster: str, low: int, high: int, cpu_s: int, gpu_s: int,
           entry: PriceEntry | None) -> Charge:
    if entry is None:
        return Charge(cluster, low, high, None, cpu_s, None, None, gpu_s, None, None, None, None)
    cpu = round(cpu_s / 3600 * entry.cpu_hour, 6)
    gpu = round(gpu_s / 3600 * entry.gpu_hour, 6)
    fee = round((cpu + gpu) * entry.marketplace_fee_pct / 100, 6)
    return Charge(cluster, low, high, entry.effective_from, cpu_s, entry.cpu_hour, cpu, gpu_s,
                  entry.gpu_hour, gpu, entry.marketplace_fee_pct, fee)


def lines_of(c: Charge) -> list[CostLine]:
    """The charge as cost lines: cpu; gpu (if any GPU ran); the fee (if the price has one)."""
    lines = [CostLine("cpu", c.cluster, c.start, c.end, c.cpu_seconds, c.cpu_hour,
                      c.price_from, c.cpu_usd)]
    if c.gpu_seconds:
        lines.append(CostLine("gpu", c.cluster, c.start, c.end, c.gpu_seconds, c.gpu_hour,
                              c.price_from, c.gpu_usd))
    if c.fee_pct and c.cpu_usd is not None and c.gpu_usd is not None:
        lines.append(CostLine("marketplace_fee", c.cluster, c.start, c.end,
                              _usd(c.cpu_usd + c.gpu_usd), c.fee_pct, c.price_from,
                              c.fee_usd))
    return lines


def job_lines(cluster: str, cpus: int, gpus: int, start: int | None, end: int | None,
              elapsed_s: int, as_of: int, window: Period, prices: PriceTable
              ) -> list[CostLine]:
    """The cost lines of one incarnation inside `window`."""
    return [line for c in job_charges(cluster, cpus, gpus, start, end, elapsed_s, as_of,
                                      window, prices) for line in lines_of(c)]


def egress_line(num_bytes: int, source_region: str, destination_region: str,
                finished_at: int, prices: PriceTable) -> CostLine | None:
    """The egress line of one transfer; None when it stayed inside one region."""
    if source_region == destination_region:
        return None
    cluster = prices.egress_cluster(source_region) or ""
    entry = prices.at(cluster, finished_at) if cluster else None
    if entry is None:
        return CostLine("egress", cluster, finished_at, finished_at, num_bytes, None, None,
                        None)
    return CostLine("egress", cluster, finished_at, finished_at, num_bytes,
                    entry.egress_per_gb, entry.effective_from,
                    _usd(num_bytes / 1e9 * entry.egress_per_gb))
