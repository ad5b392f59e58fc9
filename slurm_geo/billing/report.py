"""Reports: cost lines of a period, grouped by cost center, user, cluster or job. Pure.

`priced` turns stored incarnations and transfers into (owner, cost line) pairs for one
period; `build_report` adds them up and collects every flag (unknown TRES, no price, no cost
center, still running, malformed accounting rows), one per job (or run) and kind with how
many incarnations or transfers it stands for (`aggregate_flags`: a checkpoint is dozens of
objects, and a flag per object buries the others); `render` writes table, CSV or JSON.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from slurm_geo.billing import costs
from slurm_geo.billing.attribution import NO_COST_CENTER
from slurm_geo.billing.periods import Period
from slurm_geo.cells import table

GROUP_BY = ("cost-center", "user", "cluster", "job")
FORMATS = ("table", "csv", "json")


@dataclass(frozen=True, slots=True)
class Owner:
    """Who a cost line belongs to."""

    cluster: str
    job: str          # "cluster:job_id", or "run:NAME" for egress nobody is known to own
    logical_id: str
    user: str
    cost_center: str  # NO_COST_CENTER when none is known


@dataclass(slots=True)
class Totals:
    """Usage and cost summed over a report's cost lines: a group's, a cluster's or the
    whole period's."""

    cpu_seconds: int = 0
    gpu_seconds: int = 0
    egress_bytes: int = 0
    cpu_usd: float = 0.0
    gpu_usd: float = 0.0
    fee_usd: float = 0.0
    egress_usd: float = 0.0
    unpriced_lines: int = 0

    def add(self, line: costs.CostLine) -> None:
        self.add_sum(line.kind, line.quantity, line.amount or 0.0, int(line.amount is None))

    def add_sum(self, kind: str, quantity: float, amount: float, unpriced: int) -> None:
        """Lines of one kind already added up (quantity, USD, how many had no price)."""
        self.unpriced_lines += unpriced
        if kind == "cpu":
            self.cpu_seconds += int(quantity)
            self.cpu_usd += amount
        elif kind == "gpu":
            self.gpu_seconds += int(quantity)
            self.gpu_usd += amount
        elif kind == "marketplace_fee":
            self.fee_usd += amount
        else:
            self.egress_bytes += int(quantity)
            self.egress_usd += amount

    def add_job_sums(self, cpu_seconds: int, cpu_usd: float, gpu_seconds: int,
                     gpu_usd: float, fee_usd: float, unpriced: int) -> None:
        self.cpu_seconds += cpu_seconds
        self.cpu_usd += cpu_usd
        self.gpu_seconds += gpu_seconds
        self.gpu_usd += gpu_usd
        self.fee_usd += fee_usd
        self.unpriced_lines += unpriced

    @property
    def total_usd(self) -> float:
        return self.cpu_usd + self.gpu_usd + self.fee_usd + self.egress_usd

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("cpu_usd", "gpu_usd", "fee_usd", "egress_usd"):
            out[key] = round(out[key], 6)
        out["total_usd"] = round(self.total_usd, 6)
        return out


@dataclass(frozen=True)
class Flag:
    kind: str     # unknown TRES, no price, no cost center, running, malformed row, ...
    cluster: str
    subject: str  # the job, run or accounting line concerned
    detail: str   # of the first incarnation or transfer concerned
    count: int = 1  # how many incarnations, transfers or rows it stands for


def aggregate_flags(flags: Iterable[Flag]) -> list[Flag]:
    """One flag per kind and subject (a job, `cluster:job_id`, or a run), in the order
    first seen, counting the ones it stands for, with the first one's detail (the earliest:
    lines come in time order) and every cluster named (a run's uploads and its read-backs
    are priced by the clusters of two regions)."""
    found: dict[tuple[str, str], Flag] = {}
    for flag in flags:
        key = (flag.kind, flag.subject)
        known = found.get(key)
        if known is None:
            found[key] = flag
            continue
        clusters = known.cluster.split(",")
        cluster = known.cluster if flag.cluster in clusters else f"{known.cluster},{flag.cluster}"
        found[key] = replace(known, cluster=cluster, count=known.count + flag.count)
    return list(found.values())


@dataclass
class Report:
    period: Period
    by: str
    groups: dict[str, Totals] = field(default_factory=dict)
    clusters: dict[str, Totals] = field(default_factory=dict)
    total: Totals = field(default_factory=Totals)
    flags: list[Flag] = field(default_factory=list)


def priced(jobs: Iterable[Any], egress: Iterable[Any],
           prices: costs.PriceTable, period: Period, flags: list[Flag] | None = None
           ) -> Iterator[tuple[Owner, costs.CostLine]]:
    """Every cost line of `period`, with its owner; what needs a human goes to `flags`."""
    flags = flags if flags is not None else []
    for job in jobs:
        owner = Owner(job["cluster"], f"{job['cluster']}:{job['job_id']}", job["logical_id"],
                      job["user"], job["cost_center"] or NO_COST_CENTER)
        lines = costs.job_lines(job["cluster"], job["cpus"], job["gpus"], job["start_ts"],
                                job["end_ts"], job["elapsed_s"], job["as_of"], period, prices)
        if not lines:
            continue
        for text in filter(None, (job["flags"] or "").split("; ")):
            flags.append(_job_flag(owner, job, text))
        if any(line.amount is None for line in lines):
            flags.append(no_price_flag(owner.cluster, owner.job,
                                       min(li.start for li in lines if li.amount is None)))
        for line in lines:
            yield owner, line
    yield from _priced_egress(egress, prices, flags)


def _priced_egress(egress: Iterable[Any], prices: costs.PriceTable, flags: list[Flag]
                   ) -> Iterator[tuple[Owner, costs.CostLine]]:
    """The egress lines. A month holds a transfer per checkpoint object: a job's owner is
    made once, and a flag once per kind, cluster and subject, counted up after that."""
    owners: dict[tuple[Any, ...], Owner] = {}
    seen: dict[tuple[str, str, str], int] = {}

    def flag(kind: str, owner: Owner, row: Any, line: costs.CostLine) -> None:
        key = (kind, owner.cluster, owner.job)
        at = seen.get(key)
        if at is None:
            seen[key] = len(flags)
            flags.append(Flag(kind, owner.cluster, owner.job, _egress_detail(kind, row, line)))
        else:
            flags[at] = replace(flags[at], count=flags[at].count + 1)

    for row in egress:
        line = costs.egress_line(row["bytes"], row["source_region"] or "",
                                 row["destination_region"] or "", int(row["finished_at"]),
                                 prices)
        if line is None:
            continue
        job_id, center = row["job_id"], row["cost_center"]
        key = (line.cluster, row["job_cluster"], job_id, None if job_id else row["run"],
               row["logical_id"], row["user"], center)
        owner = owners.get(key)
        if owner is None:
            subject = (f"{row['job_cluster']}:{job_id}" if job_id is not None
                       else f"run:{row['run']}")
            owner = owners[key] = Owner(line.cluster or row["job_cluster"] or "", subject,
                                        row["logical_id"] or "", row["user"] or "",
                                        center or NO_COST_CENTER)
        if not center:
            flag("no cost center", owner, row, line)
        if line.amount is None:
            flag("no price", owner, row, line)
        yield owner, line


def _egress_detail(kind: str, row: Any, line: costs.CostLine) -> str:
    if kind == "no price":
        return f"no egress price for region '{row['source_region']}' at {_iso(line.start)}"
    return (_unowned(row) + f" (first: step {row['step']}, {row['object']}, "
            f"{_iso(line.start)})")


def _unowned(row: Any) -> str:
    if row["job_id"] is None:
        return (f"egress of run '{row['run']}': no job is known to own the run (no "
                "federation record names it, no registered job's --geo-ckpt-dir holds it)")
    return (f"egress of run '{row['run']}': its logical job {row['logical_id'] or '?'} was "
            "registered without --geo-cost-center")


def _job_flag(owner: Owner, job: Any, text: str) -> Flag:
    return job_flag(owner.cluster, owner.job, job["restarts"], job["alloc_tres"], text)


def job_flag(cluster: str, job: str, restarts: int, alloc_tres: str, text: str) -> Flag:
    kind = next((k for k in ("unknown TRES", "estimated") if text.startswith(k)), text)
    return Flag(kind, cluster, job, f"{text} (first: incarnation {restarts}, TRES "
                f"{alloc_tres or '-'})")


def no_price_flag(cluster: str, job: str, moment: int) -> Flag:
    return Flag("no price", cluster, job, f"no price for cluster '{cluster}' at {_iso(moment)}")


def group_key(owner: Owner, by: str) -> str:
    if by == "cost-center":
        return owner.cost_center
    if by == "user":
        return owner.user or "(unknown)"
    if by == "cluster":
        return owner.cluster or "(unknown)"
    return owner.job


def build_report(lines: Iterable[tuple[Owner, costs.CostLine]], period: Period, by: str,
                 flags: list[Flag], problems: Iterable[Mapping[str, Any]] = ()) -> Report:
    """Add up `lines` per group and per cluster. `flags` is the list `priced` fills."""
    report = Report(period, by)
    for owner, line in lines:
        report.groups.setdefault(group_key(owner, by), Totals()).add(line)
        report.clusters.setdefault(line.cluster or owner.cluster, Totals()).add(line)
        report.total.add(line)
    # Malformed rows stay one flag each: each is a different row to look at.
    report.flags = aggregate_flags(flags)
    report.flags += [Flag("malformed accounting row", p["cluster"], f"line {p['line']}",
                          f"{p['reason']}: {p['text']}") for p in problems]
    return report


# --- rendering ------------------------------------------------------------------------------

COLUMNS = ("cpu_seconds", "gpu_seconds", "egress_bytes", "cpu_usd", "gpu_usd", "fee_usd",
           "egress_usd", "total_usd", "unpriced_lines")


def as_json(report: Report) -> dict[str, Any]:
    return {
        "period": {"label": report.period.label, "start": _iso(report.period.start),
                   "end": _iso(report.period.end)},
        "by": report.by,
        "rows": [{"key": key, **totals.as_dict()} for key, totals in sorted(report.groups.items())],
        "clusters": [{"cluster": name, **totals.as_dict()}
                     for name, totals in sorted(report.clusters.items())],
        "total": report.total.as_dict(),
        "flags": [asdict(flag) for flag in report.flags],
    }


def render(report: Report, fmt: str) -> str:
    doc = as_json(report)
    if fmt == "json":
        return json.dumps(doc, indent=2)
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow([report.by, *COLUMNS])
        for row in [*doc["rows"], {**doc["total"], "key": "TOTAL"}]:
            writer.writerow([row["key"], *(_csv_value(row[c]) for c in COLUMNS)])
        return out.getvalue().rstrip("\n")
    return _table(doc)


def _csv_value(value: Any) -> str:
    return f"{value:.6f}" if isinstance(value, float) else str(value)


def _table(doc: dict[str, Any]) -> str:
    head = [doc["by"].upper(), "CPU-S", "GPU-S", "EGRESS-GB", "CPU $", "GPU $", "FEE $",
            "EGRESS $", "TOTAL $"]

    def cells(key: str, row: dict[str, Any]) -> list[str]:
        return [key, str(row["cpu_seconds"]), str(row["gpu_seconds"]),
                f"{row['egress_bytes'] / 1e9:.3f}", *(f"{row[c]:.2f}" for c in (
                    "cpu_usd", "gpu_usd", "fee_usd", "egress_usd", "total_usd"))]

    rows = [head] + [cells(r["key"], r) for r in doc["rows"]] + [cells("TOTAL", doc["total"])]
    lines = [f"period {doc['period']['label']} ({doc['period']['start']} .. "
             f"{doc['period']['end']}, UTC)"]
    lines.append(table(rows, right=range(1, len(head))))
    if doc["flags"]:
        lines.append(f"\n{len(doc['flags'])} flag(s) need a look:")
        lines += [f"  [{f['kind']}] {f['cluster']} {f['subject']}"
                  + (f" ({f['count']} times)" if f["count"] > 1 else "") + f": {f['detail']}"
                  for f in doc["flags"]]
    return "\n".join(lines)


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
