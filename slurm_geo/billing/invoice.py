"""Monthly invoices per cost center: a CSV of its lines and a self-contained HTML page with an
inline SVG bar chart of cost by cluster (no scripts, no external files). Pure: text out;
the CLI writes the files.

A line is one job's cost of one kind at one price (`job_lines`): its incarnations'
stretches, or its checkpoint transfers, added up (a checkpoint is dozens of objects, each
a transfer; finance needs the job, not the object). `items` says how many were added;
the amount is the sum of theirs, each rounded to micro-USD as the report adds them, so
an invoice's total is the report's.
"""

from __future__ import annotations

import csv
import hashlib
import io
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from html import escape
from typing import NamedTuple

from slurm_geo.billing.costs import CostLine
from slurm_geo.billing.periods import Period
from slurm_geo.billing.report import Owner

CSV_HEADER = ("cost_center", "cluster", "job", "logical_job", "user", "kind", "start_utc",
              "end_utc", "quantity", "unit", "unit_price", "price_effective_from", "amount_usd",
              "items")
UNITS = {"cpu": "cpu-seconds", "gpu": "gpu-seconds", "marketplace_fee": "USD (cpu+gpu)",
         "egress": "bytes"}
PRICE_UNITS = {"cpu": "USD/cpu-hour", "gpu": "USD/gpu-hour", "marketplace_fee": "%",
               "egress": "USD/GB"}


class InvoiceLine(NamedTuple):
    """One job's cost lines of one kind, cluster and price, added up: from the first
    one's start to the last one's end, `items` of them."""

    owner: Owner
    line: CostLine
    items: int


@dataclass
class Invoice:
    cost_center: str
    period: Period
    lines: list[InvoiceLine] = field(default_factory=list)

    @property
    def total(self) -> float:
        return round(sum(li.line.amount or 0.0 for li in self.lines), 2)

    def by_cluster(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for owner, line, _items in self.lines:
            name = line.cluster or owner.cluster or "(unknown)"
            out[name] = out.get(name, 0.0) + (line.amount or 0.0)
        return dict(sorted(out.items()))

    @property
    def unpriced(self) -> int:
        return sum(1 for li in self.lines if li.line.amount is None)


def job_lines(lines: Iterable[tuple[Owner, CostLine]]) -> list[InvoiceLine]:
    """The lines added up per job, kind, cluster and price, in the order first seen."""
    found: dict[tuple[Owner, str, str, float | None, int | None], InvoiceLine] = {}
    for owner, line in lines:
        key = (owner, line.kind, line.cluster, line.unit_price, line.price_from)
        known = found.get(key)
        if known is None:
            found[key] = InvoiceLine(owner, line, 1)
            continue
        was = known.line
        amount = None if was.amount is None or line.amount is None else round(
            was.amount + line.amount, 6)
        found[key] = InvoiceLine(owner, was._replace(
            start=min(was.start, line.start), end=max(was.end, line.end),
            quantity=round(was.quantity + line.quantity, 6), amount=amount), known.items + 1)
    return list(found.values())


def invoices(lines: Iterable[tuple[Owner, CostLine]], period: Period) -> dict[str, Invoice]:
    """One invoice per cost center, of its jobs' lines (`job_lines`)."""
    grouped: dict[str, list[tuple[Owner, CostLine]]] = {}
    for owner, line in lines:
        grouped.setdefault(owner.cost_center, []).append((owner, line))
    return {center: Invoice(center, period, job_lines(grouped[center]))
            for center in sorted(grouped)}


def invoice_csv(invoice: Invoice) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_HEADER)
    for owner, line, items in invoice.lines:
        writer.writerow([invoice.cost_center, line.cluster, owner.job, owner.logical_id,
                         owner.user, line.kind, _iso(line.start), _iso(line.end),
                         _number(line.quantity), UNITS[line.kind],
                         "" if line.unit_price is None else _number(line.unit_price),
                         "" if line.price_from is None else _iso(line.price_from),
                         "" if line.amount is None else f"{line.amount:.6f}", items])
    writer.writerow([invoice.cost_center, "", "", "", "", "TOTAL", "", "", "", "", "", "",
                     f"{invoice.total:.2f}", sum(li.items for li in invoice.lines)])
    return out.getvalue()


def bar_chart_svg(values: dict[str, float], width: int = 560, bar: int = 28) -> str:
    """Horizontal bars, one per cluster, labelled with the amount."""
    top = max(values.values(), default=0.0) or 1.0
    height = bar * len(values) + 20
    label_w = 140
    rows = []
    for i, (name, usd) in enumerate(values.items()):
        y = 10 + i * bar
        length = max(1, round((width - label_w - 110) * usd / top)) if usd > 0 else 0
        rows.append(
            f'<text x="{label_w - 8}" y="{y + bar * 0.65:.0f}" text-anchor="end">'
            f'{escape(name)}</text>'
            f'<rect x="{label_w}" y="{y + 4}" width="{length}" height="{bar - 8}" '
            f'fill="#3b6ea8"><title>{escape(name)}: {usd:.2f} USD</title></rect>'
            f'<text x="{label_w + length + 6}" y="{y + bar * 0.65:.0f}">{usd:,.2f} USD</text>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'role="img" aria-label="cost by cluster" font-family="sans-serif" '
            f'font-size="13">{"".join(rows)}</svg>')


def invoice_html(invoice: Invoice) -> str:
    period = invoice.period
    rows = "".join(
        f"<tr><td>{escape(owner.job)}</td><td>{escape(owner.logical_id)}</td>"
        f"<td>{escape(owner.user)}</td><td>{escape(line.cluster)}</td>"
        f"<td>{escape(line.kind)}</td><td>{_iso(line.start)}</td><td>{_iso(line.end)}</td>"
        f"<td class=n>{_number(line.quantity)} {UNITS[line.kind]}</td>"
        f"<td class=n>{'' if line.unit_price is None else _number(line.unit_price)} "
        f"{PRICE_UNITS[line.kind] if line.unit_price is not None else 'NO PRICE'}</td>"
        f"<td class=n>{'-' if line.amount is None else f'{line.amount:.6f}'}</td>"
        f"<td class=n>{items}</td></tr>"
        for owner, line, items in invoice.lines)
    warning = (f"<p class=warn>{invoice.unpriced} line(s) have no price and are not in the "
               "total; see `slurm-geo billing report`.</p>" if invoice.unpriced else "")
    title = f"Invoice {escape(invoice.cost_center)} {escape(period.label)}"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:2px 6px;font-size:12px}}.n{{text-align:right}}
.warn{{color:#a00}}</style></head><body>
<h1>{title}</h1>
<p>Cost center <b>{escape(invoice.cost_center)}</b>, period {_iso(period.start)} to
{_iso(period.end)} (UTC). Total: <b>{invoice.total:,.2f} USD</b>.</p>{warning}
<h2>Cost by cluster</h2>
{bar_chart_svg(invoice.by_cluster())}
<h2>Cost lines</h2>
<table><tr><th>job</th><th>logical job</th><th>user</th><th>cluster</th><th>kind</th>
<th>from</th><th>to</th><th>quantity</th><th>unit price</th><th>USD</th><th>items</th></tr>
{rows}</table>
<p>Generated by slurm-geo billing; every line adds up one job's <i>items</i> of one kind at
one price, each quantity x unit price (per hour for seconds, per 10<sup>9</sup> bytes for
egress, percent for fees) rounded to 6 decimals.</p>
</body></html>
"""


def file_stem(cost_center: str, period: Period) -> str:
    """A file name for the cost center: anything but [A-Za-z0-9._-] becomes '_'."""
    safe = "".join(c if c.isascii() and (c.isalnum() or c in "._-") else "_"
                   for c in cost_center)
    if safe != cost_center:  # two names may map to one safe spelling: keep them apart
        safe += "-" + hashlib.sha256(cost_center.encode()).hexdigest()[:8]
    label = "".join(c if c.isalnum() or c in "-" else "_" for c in period.label)
    return f"invoice-{label}-{safe}"


def _number(value: float) -> str:
    return f"{value:.6f}".rstrip("0").rstrip(".") if value != int(value) else str(int(value))


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
