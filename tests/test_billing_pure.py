"""Billing's pure parts, table-driven: periods, attribution, prices, cost lines, budgets,
the [billing] table, reports and invoices. No files, no Slurm."""

from __future__ import annotations

import json
import shutil
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import pytest

from slurm_geo.billing import attribution, budgets, costs, invoice, report
from slurm_geo.billing.config import ClusterFacts, PriceEntry, billing_config
from slurm_geo.billing.errors import BillingError
from slurm_geo.billing.lineage import LegOwner
from slurm_geo.billing.periods import (
    Period,
    months_overlapping,
    next_watermark,
    parse_period,
)
from slurm_geo.config import parse_config
from slurm_geo.errors import ConfigError


def ts(text: str) -> int:
    return int(datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp())


# --- periods ----------------------------------------------------------------------------------

@pytest.mark.parametrize("text, start, end", [
    ("2026-11", "2026-11-01", "2026-12-01"),
    ("2026-12", "2026-12-01", "2027-01-01"),
    ("2026-02", "2026-02-01", "2026-03-01"),
    ("2026-11-29", "2026-11-29", "2026-11-30"),
    ("2026-11-29T10:00:00..2026-11-29T10:00:30", "2026-11-29T10:00:00", "2026-11-29T10:00:30"),
    ("2026-11-29T11:00:00+01:00..2026-11-29T10:00:30", "2026-11-29T10:00:00",
     "2026-11-29T10:00:30"),
])
def test_parse_period(text, start, end):
    period = parse_period(text)
    assert (period.start, period.end) == (ts(start), ts(end))


@pytest.mark.parametrize("text, message", [
    ("2026-13", "month must be 01-12"),
    ("November", "is not YYYY-MM"),
    ("2026-11-29T10:00:00..2026-11-29T09:00:00", "ends before it starts"),
    ("soon..later", "is not a date or time"),
])
def test_bad_periods(text, message):
    with pytest.raises(BillingError, match=message):
        parse_period(text)


@pytest.mark.parametrize("start, end, labels", [
    ("2026-11-05", "2026-11-06", ["2026-11"]),
    ("2026-11-30T23:00:00", "2026-12-01T01:00:00", ["2026-11", "2026-12"]),
    ("2026-11-30T23:00:00", "2026-12-01T00:00:00", ["2026-11"]),
    ("2026-12-31", "2027-02-01T00:00:01", ["2026-12", "2027-01", "2027-02"]),
])
def test_months_overlapping(start, end, labels):
    assert [p.label for p in months_overlapping(ts(start), ts(end))] == labels


@pytest.mark.parametrize("end, unfinished, expected", [
    (100, [], 100), (100, [40, 70], 40), (100, [150], 100),
])
def test_next_watermark(end, unfinished, expected):
    assert next_watermark(end, unfinished) == expected


# --- attribution ------------------------------------------------------------------------------

@pytest.mark.parametrize("admin, comment, account, recorded, expected", [
    ("geo:cost_center=ml-research", "", "root", "", ("ml-research", "directive")),
    ("note geo:cost_center=ops", "", "root", "", ("ops", "directive")),
    ("", "geo:cost_center=ops", "root", "", ("ops", "directive")),
    ("", "", "physics", "", ("physics", "account")),
    ("", "", "", "", ("", "none")),
    ("geo:cost_center=", "", "acct", "", ("acct", "account")),
    ("xgeo:cost_center=ops", "", "acct", "", ("acct", "account")),
    # A leg the federation daemon submitted where nothing tagged it: its logical job's.
    ("", "", "rental-acct", "ml-research", ("ml-research", "logical job")),
    ("", "", "", "ml-research", ("ml-research", "logical job")),
    ("geo:cost_center=ops", "", "", "ml-research", ("ops", "directive")),
])
def test_cost_center_of(admin, comment, account, recorded, expected):
    assert attribution.cost_center_of(admin, comment, account, recorded) == expected


@pytest.mark.parametrize("tres, gpus, unknown", [
    ({"cpu": 8, "gres/gpu": 2, "gres/gpu:a100": 2, "mem": 1000}, 2, []),
    ({"cpu": 8, "gres/gpu:a100": 2, "gres/gpu:h100": 1}, 3, []),
    ({"cpu": 1, "node": 1, "billing": 1}, 0, []),
    ({"cpu": 1, "gres/fpga": 1, "license/matlab": 2}, 0, ["gres/fpga", "license/matlab"]),
    ({"cpu": 1, "gres/gpumem:a100": 80, "energy": 5}, 0, []),
])
def test_gpus_and_unknown_tres(tres, gpus, unknown):
    assert attribution.gpu_count(tres) == gpus
    assert attribution.unknown_tres(tres) == unknown


# --- prices and cost lines ------------------------------------------------------------------

CLUSTERS = {"onprem": ClusterFacts("onprem", "home", "onprem"),
            "rented": ClusterFacts("rented", "remote", "gpu-market"),
            "rented2": ClusterFacts("rented2", "remote2", "gpu-market")}
DEC1 = ts("2026-12-01")
TABLE = costs.PriceTable([
    PriceEntry(0, 0.0, 0.01, 0.0, 0.0, cluster="onprem"),
    PriceEntry(ts("2026-11-01"), 2.50, 0.04, 0.09, 5.0, provider="gpu-market"),
    PriceEntry(DEC1, 2.10, 0.04, 0.08, 5.0, cluster="rented"),
], CLUSTERS)
NOV = parse_period("2026-11")


@pytest.mark.parametrize("cluster, moment, gpu_hour", [
    ("rented", "2026-10-31T23:59:59", None),
    ("rented", "2026-11-01", 2.50),
    ("rented", "2026-12-01", 2.10),
    ("rented2", "2026-12-15", 2.50),   # provider entry: rented2 has none of its own
    ("onprem", "1999-01-01", 0.0),
    ("nowhere", "2026-11-05", None),
])
def test_price_in_force(cluster, moment, gpu_hour):
    entry = TABLE.at(cluster, ts(moment))
    assert (entry.gpu_hour if entry else None) == gpu_hour


def test_worked_example_from_docs():
    """docs/billing.md: 2 GPUs and 8 CPUs on `rented` for 1 h 30 min in November."""
    start = ts("2026-11-10T08:00:00")
    lines = costs.job_lines("rented", 8, 2, start, start + 5400, 5400, start + 5400, NOV, TABLE)
    assert [(li.kind, li.quantity, li.unit_price, li.amount) for li in lines] == [
        ("cpu", 43200, 0.04, 0.48),             # 8 x 5400 cpu-s / 3600 x 0.04
        ("gpu", 10800, 2.50, 7.5),              # 2 x 5400 gpu-s / 3600 x 2.50
        ("marketplace_fee", 7.98, 5.0, 0.399),  # (0.48 + 7.50) x 5 %
    ]


def test_a_job_across_a_price_change_gets_a_line_per_price():
    start = DEC1 - 1800
    period = Period("nov-dec", ts("2026-11-01"), ts("2027-01-01"))
    lines = costs.job_lines("rented", 0, 1, start, DEC1 + 1800, 3600, DEC1 + 1800, period, TABLE)
    gpu = [(li.start, li.end, li.quantity, li.unit_price, li.amount) for li in lines
           if li.kind == "gpu"]
    assert gpu == [(start, DEC1, 1800, 2.50, 1.25), (DEC1, DEC1 + 1800, 1800, 2.10, 1.05)]


def test_a_stretch_without_price_is_a_line_without_amount():
    start = ts("2026-10-31T23:00:00")
    period = Period("x", ts("2026-10-01"), ts("2026-12-01"))
    lines = costs.job_lines("rented", 1, 1, start, start + 7200, 7200, start + 7200, period,
                            TABLE)
    assert [(li.kind, li.quantity, li.amount) for li in lines] == [
        ("cpu", 3600, None), ("gpu", 3600, None),
        ("cpu", 3600, 0.04), ("gpu", 3600, 2.5), ("marketplace_fee", 2.54, 0.127)]


@pytest.mark.parametrize("start, end, elapsed, as_of, expected", [
    ("2026-11-02T00:00:00", "2026-11-02T01:00:00", 3500, None, 3500),   # Slurm's own elapsed
    ("2026-10-31T23:00:00", "2026-11-01T01:00:00", 7200, None, 3600),   # cut at the start
    ("2026-11-30T23:30:00", "2026-12-01T00:30:00", 3600, None, 1800),   # cut at the end
    ("2026-11-30T23:00:00", None, 0, "2026-11-30T23:10:00", 600),       # running: to as_of
    ("2026-12-01T00:00:00", "2026-12-01T01:00:00", 3600, None, None),   # after the period
    (None, None, 0, None, None),                                        # never started
])
def test_billed_seconds(start, end, elapsed, as_of, expected):
    span = costs.billed_seconds(ts(start) if start else None, ts(end) if end else None,
                                elapsed, ts(as_of) if as_of else 0, NOV)
    assert (span[2] if span else None) == expected


@pytest.mark.parametrize("size, source, dest, cluster, amount", [
    (5 * 10**9, "home", "remote", "onprem", 0.0),
    (2 * 10**9, "remote", "home", "rented", 0.18),
    (10**9, "home", "home", None, None),            # inside one region: no line
    (10**9, "mars", "home", "", None),              # nobody prices it: flagged
])
def test_egress_line(size, source, dest, cluster, amount):
    line = costs.egress_line(size, source, dest, ts("2026-11-15"), TABLE)
    if cluster is None:
        assert line is None
    else:
        assert (line.cluster, line.amount) == (cluster, amount)


# --- budgets ----------------------------------------------------------------------------------

@pytest.mark.parametrize("spent, levels", [
    ({"ml": 100.0}, []),
    ({"ml": 800.0}, [("warning", "ml")]),
    ({"ml": 1000.0}, [("warning", "ml")]),
    ({"ml": 1000.01, "ops": 10.0}, [("exceeded", "ml")]),
    ({"ops": 60.0}, [("exceeded", "ops")]),
    ({"unbudgeted": 1e6}, []),
])
def test_monthly_budgets(spent, levels):
    alerts = budgets.check_monthly(spent, {"ml": 1000.0, "ops": 50.0}, 80.0, "2026-11")
    assert [(a.level, a.cost_center) for a in alerts] == levels
    assert all("2026-11" in a.message for a in alerts)


def test_per_job_budgets_from_policy():
    alerts = budgets.check_jobs({("ml", "onprem:1"): 600.0, ("ml", "onprem:2"): 10.0,
                                 ("other", "onprem:3"): 1e6}, {"ml": 500.0})
    assert [(a.subject, a.spent_usd) for a in alerts] == [("onprem:1", 600.0)]


def line(center: str, job: str, usd: float | None) -> tuple[report.Owner, costs.CostLine]:
    owner = report.Owner("onprem", f"onprem:{job}", f"onprem-{job}" if job else "", "alice",
                         center)
    return owner, costs.CostLine("cpu", "onprem", 0, 3600, 3600.0, 1.0, 0, usd)


@pytest.mark.parametrize("lines, alerts, exceeded", [
    ([], [], False),
    # monthly: warned at 80% of ml's 1000 USD, exceeded past ops' 50
    ([line("ml", "1", 450.0), line("ml", "2", 400.0)], [("warning", "ml", "month")], False),
    ([line("ops", "3", 30.0), line("ops", "3", 30.0)], [("exceeded", "ops", "month")], True),
    # per job ([policy.budgets] ml: 500 USD): two lines of one job add up; unpriced is 0
    ([line("ml", "1", 300.0), line("ml", "1", 250.0), line("ml", "2", None)],
     [("exceeded", "ml", "onprem-1")], True),
    # monthly alerts first, then per-job ones
    ([line("ml", "1", 900.0), line("ops", "3", 60.0)],
     [("warning", "ml", "month"), ("exceeded", "ops", "month"), ("exceeded", "ml", "onprem-1")],
     True),
    # a line of no logical job counts under its Slurm job
    ([line("ml", "", 501.0)], [("exceeded", "ml", "onprem:")], True),
])
def test_a_periods_budgets_are_decided_in_one_call(lines, alerts, exceeded):
    found = budgets.check_budgets(lines, {"ml": 1000.0, "ops": 50.0}, 80.0, {"ml": 500.0},
                                  "2026-11")
    assert [(a.level, a.cost_center, a.subject) for a in found.alerts] == alerts
    assert bool(found.exceeded) is exceeded
    assert found.exceeded == [a for a in found.alerts if a.level == "exceeded"]
    assert found.spent == {c: sum(usd or 0.0 for o, (*_, usd) in lines if o.cost_center == c)
                           for c in {o.cost_center for o, _ in lines}}


def test_webhook_reports_failure_without_raising():
    class Down:
        def post(self, url, json, timeout):
            import requests
            raise requests.ConnectionError("refused")

    class Answer:
        def __init__(self, code):
            self.status_code = code

    class Up:
        sent: list = []

        def post(self, url, json, timeout):
            self.sent.append(json)
            return Answer(204)

    alert = budgets.Alert("exceeded", "ml", "month", 2.0, 1.0, "over")
    assert budgets.post_webhook("http://x", "2026-11", [alert], session=Down()) == \
        "webhook http://x: ConnectionError"
    up = Up()
    assert budgets.post_webhook("http://x", "2026-11", [alert], session=up) is None
    assert up.sent[0]["alerts"][0]["cost_center"] == "ml"


# --- the [billing] table ----------------------------------------------------------------------

SITE = {
    "site": {"home_cluster": "onprem"},
    "clusters": {
        "onprem": {"region": "home", "access": "cli", "slurm_conf": "/etc/slurm/slurm.conf",
                   "prices": {"cpu_hour": 0.01}},
        "rented": {"region": "remote", "access": "rest", "provider": "gpu-market",
                   "rest_url": "https://r", "rest_user": "u", "token_file": "/t",
                   "prices": {"gpu_hour": 2.5}},
    },
    "policy": {"budgets": {"ml": 500}},
}


def config_of(billing):
    return billing_config(parse_config({**SITE, "billing": billing}))


def test_billing_defaults_use_the_clusters_prices():
    config = config_of({})
    assert config.database == Path("/var/lib/slurm-geo/billing.db")
    assert {(e.cluster, e.effective_from, e.cpu_hour, e.gpu_hour) for e in config.prices} == {
        ("onprem", 0, 0.01, 0.0), ("rented", 0, 0.0, 2.5)}
    assert config.job_budgets == {"ml": 500.0}


def test_effective_dated_entries_replace_the_cluster_default():
    config = config_of({"prices": [{"provider": "gpu-market", "effective_from": "2026-12-01",
                                    "gpu_hour": 2.1, "cpu_hour": 0.04, "egress_per_gb": 0.08,
                                    "marketplace_fee_pct": 5}],
                        "budgets": {"ml": 1000}, "webhook_url": "https://hooks/x"})
    assert [(e.cluster, e.provider, e.effective_from) for e in config.prices] == [
        ("", "gpu-market", ts("2026-12-01")), ("onprem", "", 0)]
    assert config.budgets == {"ml": 1000.0}


ENTRY = {"cluster": "rented", "effective_from": "2026-12-01", "gpu_hour": 1, "cpu_hour": 1,
         "egress_per_gb": 1, "marketplace_fee_pct": 1}


@pytest.mark.parametrize("billing, message", [
    ({"nonsense": 1}, "unknown key"),
    ({"database": "relative.db"}, "absolute path"),
    ({"budgets": {"ml": -5}}, "must be a number"),
    ({"webhook_url": "ftp://x"}, "http:// or https://"),
    ({"prices": {"cluster": "rented"}}, "list of tables"),
    ({"prices": [{**ENTRY, "cluster": "elsewhere"}]}, "not one of \\[clusters\\]"),
    ({"prices": [{**ENTRY, "provider": "gpu-market"}]}, "exactly one of"),
    ({"prices": [{k: v for k, v in ENTRY.items() if k != "gpu_hour"}]}, "missing gpu_hour"),
    ({"prices": [{**ENTRY, "effective_from": "someday"}]}, "effective_from"),
    ({"prices": [{**ENTRY, "gpu_hour": "free"}]}, "gpu_hour must be a number"),
])
def test_billing_table_mistakes(billing, message):
    with pytest.raises(ConfigError, match=message):
        config_of(billing)


# --- reports and invoices ---------------------------------------------------------------------

def job(**over):
    row = {"cluster": "rented", "job_id": 5, "submit_ts": ts("2026-11-10T07:59:00"),
           "restarts": 0, "logical_id": "onprem:3", "user": "alice", "cost_center": "ml",
           "start_ts": ts("2026-11-10T08:00:00"), "end_ts": ts("2026-11-10T09:30:00"),
           "elapsed_s": 5400, "cpus": 8, "gpus": 2, "alloc_tres": "cpu=8,gres/gpu=2",
           "as_of": ts("2026-11-11"), "flags": ""}
    return {**row, **over}


def build(jobs, egress=(), by="cost-center", problems=()):
    flags: list = []
    lines = report.priced(jobs, egress, TABLE, NOV, flags)
    return report.build_report(lines, NOV, by, flags, problems)


def test_report_totals_and_groups():
    result = build([job(), job(job_id=6, user="bob", cost_center="", cpus=1, gpus=0,
                           flags="no cost center")], by="user")
    assert set(result.groups) == {"alice", "bob"}
    assert result.groups["alice"].total_usd == pytest.approx(8.379)
    assert result.clusters["rented"].cpu_seconds == 8 * 5400 + 5400
    assert result.clusters["rented"].gpu_seconds == 2 * 5400
    assert [f.kind for f in result.flags] == ["no cost center"]
    assert "(none)" in build([job(cost_center="")]).groups


@pytest.mark.parametrize("over, kind", [
    ({"flags": "unknown TRES gres/fpga"}, "unknown TRES"),
    ({"flags": "running", "end_ts": None}, "running"),
    ({"start_ts": ts("2026-10-31T23:00:00"), "end_ts": ts("2026-11-01T01:00:00")}, None),
    ({"cluster": "nowhere"}, "no price"),
])
def test_report_flags(over, kind):
    result = build([job(**over)])
    assert [f.kind for f in result.flags] == ([kind] if kind else [])


def test_malformed_rows_and_unowned_egress_are_flagged():
    egress = [{"run": "r", "step": 1, "object": "chunks/x", "bytes": 10**9,
               "source_region": "remote",
               "destination_region": "home", "finished_at": ts("2026-11-12"), "job_id": None,
               "job_cluster": "", "logical_id": "", "user": "", "cost_center": ""}]
    result = build([], egress, problems=[{"cluster": "onprem", "line": 3, "text": "x|y",
                                          "reason": "2 fields, expected 16"}])
    assert result.groups["(none)"].egress_usd == pytest.approx(0.09)
    assert [f.kind for f in result.flags] == ["no cost center", "malformed accounting row"]


@pytest.mark.parametrize("fmt", report.FORMATS)
def test_render_formats(fmt):
    text = report.render(build([job(cost_center="it's \"q\"")]), fmt)
    if fmt == "json":
        doc = json.loads(text)
        assert doc["rows"][0]["key"] == "it's \"q\""
        assert doc["total"]["total_usd"] == pytest.approx(8.379)
    elif fmt == "csv":
        assert text.splitlines()[1].startswith('"it\'s ""q"""')
    else:
        assert "TOTAL" in text and "8.38" in text


def test_invoice_csv_and_html():
    lines = list(report.priced([job(), job(cluster="onprem", job_id=9, gpus=0)], [], TABLE,
                               NOV))
    [bill] = invoice.invoices(lines, NOV).values()
    assert bill.total == pytest.approx(8.38 + 0.12)
    csv_text = invoice.invoice_csv(bill)
    assert csv_text.splitlines()[0].startswith("cost_center,cluster,job")
    assert "rented,rented:5,onprem:3,alice,gpu,2026-11-10T08:00:00Z" in csv_text
    html = invoice.invoice_html(bill)
    assert html.count("<svg") == 1 and "<script" not in html and "<rect" in html
    assert "8.50 USD" in html


def test_invoice_html_escapes_names():
    lines = list(report.priced([job(cost_center="<b>&\"x\"", user="<script>")], [], TABLE,
                               NOV))
    html = invoice.invoice_html(next(iter(invoice.invoices(lines, NOV).values())))
    assert "<script>" not in html and "&lt;script&gt;" in html


def egress(run="r", step=1, obj="chunks/x", job_id=None, center="", size=10**9,
           when="2026-11-12", logical=""):
    return {"run": run, "step": step, "object": obj, "bytes": size, "source_region": "remote",
            "destination_region": "home", "finished_at": ts(when), "job_id": job_id,
            "job_cluster": "rented" if job_id else "", "logical_id": logical, "user": "",
            "cost_center": center}


F = report.Flag


@pytest.mark.parametrize("flags, expected", [
    ([], []),
    ([F("running", "rented", "rented:5", "a")], [F("running", "rented", "rented:5", "a")]),
    # one per job (or run) and kind, the first one's detail, counted
    ([F("no cost center", "rented", "run:r", "step 1"),
      F("no cost center", "rented", "run:r", "step 2"),
      F("no price", "rented", "run:r", "at t"),
      F("no cost center", "rented", "run:s", "step 1"),
      F("no cost center", "rented", "run:r", "step 3")],
     [F("no cost center", "rented", "run:r", "step 1", 3), F("no price", "rented", "run:r", "at t"),
      F("no cost center", "rented", "run:s", "step 1")]),
    # counts add up; a run's egress priced by two clusters names both
    ([F("running", "a", "a:1", "x", 2), F("running", "a", "a:1", "y", 3),
      F("no price", "a", "run:r", "x"), F("no price", "b", "run:r", "y"),
      F("no price", "a", "run:r", "z")],
     [F("running", "a", "a:1", "x", 5), F("no price", "a,b", "run:r", "x", 3)]),
])
def test_aggregate_flags(flags, expected):
    assert report.aggregate_flags(flags) == expected


def test_egress_nobody_owns_is_one_flag_per_run_however_many_objects():
    rows = [egress(run=run, step=step, obj=f"chunks/{i}") for run in ("r", "s")
            for step in (100, 200) for i in range(13)]
    result = build([], rows)
    assert [(f.kind, f.subject, f.count) for f in result.flags] == [
        ("no cost center", "run:r", 26), ("no cost center", "run:s", 26)]
    assert "first: step 100, chunks/0" in result.flags[0].detail
    assert "no job is known to own the run" in result.flags[0].detail
    text = report.render(result, "table")
    assert text.count("[no cost center]") == 2 and "run:r (26 times)" in text
    assert json.loads(report.render(result, "json"))["flags"][0]["count"] == 26
    owned = build([], [egress(job_id=5, logical="onprem-3")])
    assert "its logical job onprem-3 was registered without --geo-cost-center" in \
        owned.flags[0].detail


def test_job_flags_count_incarnations():
    result = build([job(flags="accounting not settled"),
                    job(submit_ts=ts("2026-11-10T09:31:00"), restarts=1,
                        start_ts=ts("2026-11-10T09:32:00"), end_ts=ts("2026-11-10T10:00:00"),
                        elapsed_s=1680, flags="accounting not settled")])
    assert [(f.kind, f.subject, f.count) for f in result.flags] == [
        ("accounting not settled", "rented:5", 2)]
    assert "first: incarnation 0" in result.flags[0].detail


def test_invoices_list_a_line_per_job_not_per_object():
    rows = [egress(step=step, obj=f"chunks/{i}", job_id=5, center="ml", logical="onprem-3",
                   size=10**8, when=f"2026-11-{12 + step // 100}")
            for step in (100, 200) for i in range(13)]
    rows += [egress(run="nobody", obj=f"chunks/{i}") for i in range(5)]
    lines = list(report.priced([job(), job(submit_ts=ts("2026-11-10T09:31:00"), restarts=1,
                                          start_ts=ts("2026-11-10T09:32:00"),
                                          end_ts=ts("2026-11-10T10:32:00"), elapsed_s=3600)],
                               rows, TABLE, NOV))
    bills = invoice.invoices(lines, NOV)
    ml, none = bills["ml"], bills["(none)"]
    assert [(li.owner.job, li.line.kind, li.items) for li in ml.lines] == [
        ("rented:5", "cpu", 2), ("rented:5", "gpu", 2), ("rented:5", "marketplace_fee", 2),
        ("rented:5", "egress", 26)]
    cpu, egress_line = ml.lines[0].line, ml.lines[3].line
    assert (cpu.quantity, cpu.start, cpu.end) == (8 * (5400 + 3600), ts("2026-11-10T08:00:00"),
                                                  ts("2026-11-10T10:32:00"))
    assert (egress_line.quantity, egress_line.amount) == (26 * 10**8, pytest.approx(0.234))
    # the invoice's total is the report's
    summed = report.build_report(iter(lines), NOV, "cost-center", [])
    assert ml.total == round(summed.groups["ml"].total_usd, 2) > 0
    assert [(li.owner.job, li.items) for li in none.lines] == [("run:nobody", 5)]
    csv_lines = invoice.invoice_csv(none).splitlines()
    assert csv_lines[0].endswith("amount_usd,items") and len(csv_lines) == 3
    assert csv_lines[1].endswith(",0.450000,5") and csv_lines[2].endswith(",0.45,5")
    assert "<td class=n>26</td>" in invoice.invoice_html(ml)


@pytest.mark.parametrize("center, stem", [
    ("ml-research", "invoice-2026-11-ml-research"),
    ("a/b", "invoice-2026-11-a_b-"),
    ("../../etc", "invoice-2026-11-.._.._etc-"),
])
def test_invoice_file_names_stay_in_their_directory(center, stem):
    name = invoice.file_stem(center, NOV)
    assert name.startswith(stem) and "/" not in name


# --- job_submit.lua records the cost center for billing -------------------------------------

LUA = shutil.which("lua5.1") or shutil.which("lua")
HARNESS = """
slurm = {SUCCESS = 0, ERROR = -1, ESLURM_ACCESS_DENIED = 2002}
function slurm.log_info(...) end
function slurm.log_user(...) end
dofile(arg[1] .. "/job_submit.lua")
for _, before in ipairs({"", "ticket 42", "geo:cost_center=ops"}) do
  local job = {spank_job_env = {"GEO_COST_CENTER=ops"}, requeue = 65534}
  if before ~= "" then job.admin_comment = before end
  local rc = slurm_job_submit(job, {}, 0)
  io.write(rc, "\\t", tostring(job.admin_comment), "\\n")
end
local plain = {requeue = 65534}
io.write(slurm_job_submit(plain, {}, 0), "\\t", tostring(plain.admin_comment), "\\n")
"""


def test_job_submit_lua_records_the_cost_center(tmp_path):
    if LUA is None:
        pytest.skip("no Lua interpreter (apt-get install lua5.1)")
    from slurm_geo.policy.geo import GeoPolicy, GeoRules
    from slurm_geo.policy.lua import export_files

    rules = GeoRules(GeoPolicy(budgets={"ops": 50.0}), {"onprem": "home"})
    for name, text in export_files(rules, "onprem", "test").items():
        (tmp_path / name).write_text(text)
    (tmp_path / "harness.lua").write_text(HARNESS)
    out = subprocess.run([LUA, str(tmp_path / "harness.lua"), str(tmp_path)],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    assert out.splitlines() == ["0\tgeo:cost_center=ops", "0\tticket 42 geo:cost_center=ops",
                                "0\tgeo:cost_center=ops", "0\tnil"]


def test_effective_from_may_be_a_toml_date():
    import tomllib

    prices = 'gpu_hour = 1\ncpu_hour = 1\negress_per_gb = 1\nmarketplace_fee_pct = 1\n'
    raw = tomllib.loads('[[prices]]\ncluster = "rented"\neffective_from = 2026-12-01\n'
                        + prices + '[[prices]]\ncluster = "onprem"\n'
                        'effective_from = 2026-12-01T06:00:00+02:00\n' + prices)
    config = config_of(raw)
    assert [e.effective_from for e in config.prices] == [ts("2026-12-01"),
                                                        ts("2026-12-01T04:00:00")]


# --- a record becomes a row (pure) ------------------------------------------------------------

def record(**over):
    from slurm_geo.slurm.models import AccountingRecord, JobState

    base = dict(cluster="rented", job_id=5, name="n", user="u", account="acct",
                partition="gpu", state=JobState.COMPLETED,
                submit_time=datetime(2026, 11, 10, 7, 59, tzinfo=UTC),
                start_time=datetime(2026, 11, 10, 8, 0, tzinfo=UTC),
                end_time=datetime(2026, 11, 10, 9, 30, tzinfo=UTC), elapsed_s=5400,
                allocated_tres={"cpu": 8, "gres/gpu": 2}, exit_code=0, nodes="n1",
                admin_comment="geo:cost_center=ml")
    return AccountingRecord(**{**base, **over})


@pytest.mark.parametrize("over, reason", [
    ({}, None),
    ({"job_id": 0}, "no job id"),
    ({"submit_time": None}, "no submit time"),
    ({"end_time": datetime(2026, 11, 10, 7, 0, tzinfo=UTC)}, "ends before it starts"),
    ({"elapsed_s": -1}, "negative elapsed time"),
])
def test_records_from_json_that_cannot_be_billed(over, reason):
    from slurm_geo.billing.ingest import malformed_reason

    assert malformed_reason(record(**over)) == reason


@pytest.mark.parametrize("over, lineage, expected", [
    ({}, {}, {"cost_center": "ml", "cost_center_source": "directive", "flags": "",
              "logical_id": "rented:5", "cpus": 8, "gpus": 2}),
    ({"admin_comment": "", "account": ""}, {("rented", 5): LegOwner("onprem:3", "")},
     {"cost_center": "", "cost_center_source": "none", "flags": "no cost center",
      "logical_id": "onprem:3"}),
    # rented:5 is a leg the federation daemon submitted for onprem-3 (ml-research)
    ({"admin_comment": "", "account": "rental"}, {("rented", 5): LegOwner("onprem-3", "ml")},
     {"cost_center": "ml", "cost_center_source": "logical job", "flags": "",
      "logical_id": "onprem-3"}),
    ({}, {("rented", 5): LegOwner("onprem-3", "other")},
     {"cost_center": "ml", "cost_center_source": "directive", "logical_id": "onprem-3"}),
    ({"allocated_tres": {"cpu": 1, "license/x": 1}, "partition": ""}, {},
     {"flags": "unknown TRES license/x; accounting not settled", "gpus": 0}),
    ({"end_time": None}, {}, {"flags": "running", "end_ts": None}),
])
def test_incarnation_row(over, lineage, expected):
    from slurm_geo.billing.db import JOB_COLUMNS
    from slurm_geo.billing.ingest import incarnation_row

    row = dict(zip(JOB_COLUMNS, incarnation_row(record(**over), lineage, 0), strict=True))
    assert {k: row[k] for k in expected} == expected
