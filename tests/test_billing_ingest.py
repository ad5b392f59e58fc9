"""Ingest into a real SQLite database from sacct-format rows (no Slurm): idempotency, names
stored verbatim, bad input flagged, restarts, repricing; and the CLI's one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from slurm_geo.billing import costs, ingest, records, service
from slurm_geo.billing.config import ClusterFacts, PriceEntry
from slurm_geo.billing.db import BillingDB
from slurm_geo.billing.lineage import Owners
from slurm_geo.billing.periods import parse_period
from slurm_geo.slurm import parse
from tests.kit.billing import cli, hook_fixture, sacct_line  # noqa: F401 - the fixture hook

CLUSTERS = {"onprem": ClusterFacts("onprem", "home", "onprem"),
            "rented": ClusterFacts("rented", "remote", "gpu-market")}
PRICES = [PriceEntry(0, 0.0, 0.01, 0.0, 0.0, cluster="onprem", source="t"),
          PriceEntry(0, 2.5, 0.04, 0.09, 5.0, cluster="rented", source="t")]
HOSTILE = ["it's \"quoted\"", "x'); DROP TABLE jobs; --", "Robert\"; DELETE FROM jobs;",
           "ünïcödé ✓"]
PIPE_NAME = "a|b"  # the name is sacct's last field: it may hold the delimiter


LINES = [
    sacct_line(1),
    sacct_line(2, state="REQUEUED", end="2026-11-02T10:30:05", elapsed=1800),
    sacct_line(2, submit="2026-11-02T10:30:06", start="2026-11-02T10:31:00",
               end="2026-11-02T10:41:00", elapsed=600),
    sacct_line(3, alloc="cpu=4,gres/fpga=1,node=1"),
    sacct_line(4, admin="", account=""),
    *(sacct_line(10 + i, name=name, user=name, admin="", account=name)
      for i, name in enumerate(HOSTILE)),
    sacct_line(15, name=PIPE_NAME),
    sacct_line(20, cluster="onprem", alloc="cpu=2,node=1", admin=""),
    "garbage|row",
    sacct_line("20.batch"),
]


def load(db, lines=LINES, prices=PRICES):
    db.set_prices(prices, CLUSTERS)
    table = costs.PriceTable(prices, CLUSTERS)
    stats = ingest.IngestStats("rented", 0, 0)
    items = parse.parsable_accounting(lines, "rented", tz=UTC)
    ingest.ingest_records(db, items, stats, {}, int(datetime(2026, 11, 3, tzinfo=UTC)
                                                    .timestamp()), table, batch=4)
    db.count_restarts()
    return stats


@pytest.fixture
def db(tmp_path):
    with BillingDB(tmp_path / "billing.db") as opened:
        yield opened


def test_ingesting_the_same_rows_twice_changes_nothing(db):
    first = load(db)
    before = db.dump()
    second = load(db)
    assert db.dump() == before
    assert (first.incarnations, first.malformed) == (second.incarnations, second.malformed)
    assert first.incarnations == len(LINES) - 2 and first.malformed == 2


def test_names_with_quotes_or_sql_are_stored_verbatim(db):
    load(db)
    names = {r["name"] for r in db.conn.execute("SELECT name FROM jobs")}
    users = {r["user"] for r in db.conn.execute("SELECT user FROM jobs")}
    centers = {r["cost_center"] for r in db.conn.execute("SELECT cost_center FROM jobs")}
    assert {*HOSTILE, PIPE_NAME} <= names and set(HOSTILE) <= users and set(HOSTILE) <= centers
    assert db.conn.execute("SELECT COUNT(*) FROM jobs").fetchone()[0] == len(LINES) - 2


def test_requeued_incarnations_are_numbered(db):
    load(db)
    rows = db.conn.execute("SELECT restarts, state, elapsed_s FROM jobs WHERE job_id = 2 "
                           "ORDER BY submit_ts").fetchall()
    assert [tuple(r) for r in rows] == [(0, "REQUEUED", 1800), (1, "COMPLETED", 600)]


def test_bad_input_is_flagged_in_the_report(db):
    load(db)
    result = service.report(db, parse_period("2026-11"), "cost-center")
    kinds = {(f.kind, f.subject) for f in result.flags}
    assert ("unknown TRES", "rented:3") in kinds
    assert ("no cost center", "rented:4") in kinds
    malformed = [f for f in result.flags if f.kind == "malformed accounting row"]
    assert {f.detail.split(":")[0] for f in malformed} == {"2 fields, expected 16",
                                                           "JobIDRaw '20.batch' is not a job id"}
    assert "(none)" in result.groups  # job 4: neither directive nor account


def test_report_seconds_equal_the_sum_of_the_rows(db):
    load(db)
    result = service.report(db, parse_period("2026-11"), "cluster")
    rented_cpu = 8 * (3600 * (3 + len(HOSTILE)) + 1800 + 600) + 4 * 3600
    assert result.clusters["rented"].cpu_seconds == rented_cpu
    assert result.clusters["rented"].gpu_seconds == 2 * (3600 * (3 + len(HOSTILE)) + 2400)
    assert result.clusters["onprem"].cpu_seconds == 2 * 3600


def test_cost_lines_in_the_database_match_the_report(db):
    load(db)
    result = service.report(db, parse_period("2026-11"), "cluster")
    stored = db.conn.execute("SELECT TOTAL(cpu_usd) + TOTAL(gpu_usd) + TOTAL(fee_usd) + "
                             "TOTAL(egress_usd) FROM cost_lines WHERE period = '2026-11'"
                             ).fetchone()[0]
    assert stored == pytest.approx(result.total.total_usd)
    line = db.conn.execute("SELECT * FROM cost_lines WHERE owner LIKE 'job:rented:1:%'"
                           ).fetchone()
    assert (line["gpu_seconds"], line["gpu_hour"], line["gpu_usd"]) == (7200, 2.5, 5.0)
    assert (line["cpu_seconds"], line["cpu_hour"], line["cpu_usd"]) == (28800, 0.04, 0.32)
    assert (line["fee_pct"], line["fee_usd"]) == (5.0, 0.266)


def test_a_price_change_reprices_every_line(db):
    load(db)
    cheaper = [PRICES[0], PriceEntry(0, 1.0, 0.04, 0.09, 5.0, cluster="rented", source="t")]
    assert db.set_prices(cheaper, CLUSTERS)
    ingest.reprice_all(db, costs.PriceTable(cheaper, CLUSTERS))
    line = db.conn.execute("SELECT gpu_usd FROM cost_lines WHERE owner LIKE "
                           "'job:rented:1:%'").fetchone()
    assert line["gpu_usd"] == 2.0
    assert not db.set_prices(cheaper, CLUSTERS)


def test_a_period_without_price_is_flagged_not_priced_at_zero(db):
    dated = [PRICES[0], PriceEntry(int(datetime(2026, 12, 1, tzinfo=UTC).timestamp()),
                                   2.5, 0.04, 0.09, 5.0, cluster="rented", source="t")]
    load(db, prices=dated)
    result = service.report(db, parse_period("2026-11"), "cluster")
    assert result.clusters["rented"].unpriced_lines > 0
    assert result.clusters["rented"].cpu_seconds > 0
    assert any(f.kind == "no price" for f in result.flags)


def test_running_incarnations_hold_the_watermark(db):
    lines = [sacct_line(30, state="RUNNING", end="Unknown"), sacct_line(31)]
    stats = load(db, lines)
    started = int(datetime(2026, 11, 2, 10, 0, 5, tzinfo=UTC).timestamp())
    assert stats.unfinished_since == [started]
    row = db.conn.execute("SELECT * FROM jobs WHERE job_id = 30").fetchone()
    assert row["end_ts"] is None and "running" in row["flags"]


# --- the CLI: thin, one-line errors, exit codes ---------------------------------------------


@pytest.fixture
def site_config(tmp_path):
    path = tmp_path / "site.toml"
    path.write_text(f"""
[site]
home_cluster = "onprem"
[clusters.onprem]
region = "home"
access = "cli"
slurm_conf = "/nonexistent/slurm.conf"
timeout_s = 2
[billing]
database = "{tmp_path / 'billing.db'}"
[billing.budgets]
ml-research = 10
ops = 1000  # budget keys follow the name grammar; hostile names come from accounts
""")
    return {"SLURM_GEO_CONFIG": str(path)}


def test_cli_report_budgets_and_invoices(tmp_path, site_config):
    with BillingDB(tmp_path / "billing.db") as db:
        load(db)
    report = cli("report", "--period", "2026-11", "--by", "user", "--format", "json",
                 env=site_config)
    assert report.returncode == 0, report.stderr
    doc = json.loads(report.stdout)
    assert {r["key"] for r in doc["rows"]} >= set(HOSTILE)

    over = cli("budgets", "--period", "2026-11", env=site_config)
    assert over.returncode == 51
    assert "cost center 'ml-research' spent" in over.stderr
    assert over.stderr.strip().splitlines()[-1] == \
        "slurm-geo: error: 1 budget(s) exceeded in 2026-11"

    out = tmp_path / "invoices"
    made = cli("invoices", "--period", "2026-11", "--out", str(out), env=site_config)
    assert made.returncode == 0, made.stderr
    names = sorted(p.name for p in out.iterdir())
    assert "invoice-2026-11-ml-research.csv" in names and "invoice-2026-11-ml-research.html" \
        in names
    assert all(p.parent == out for p in out.iterdir())


@pytest.mark.parametrize("args, code, message", [
    (["report", "--period", "2026-13"], 50, "period '2026-13': month must be 01-12"),
    (["report", "--period", "2026-11", "--db", "/nonexistent/b.db"], 50,
     "no billing database at /nonexistent/b.db"),
    (["report", "--by", "team"], 2, "Invalid value for '--by'"),
])
def test_cli_user_mistakes_are_one_line(args, code, message, site_config):
    run = cli(*args, env=site_config)
    assert run.returncode == code
    assert message in run.stderr and "Traceback" not in run.stderr


def test_cli_ingest_reports_an_unreachable_cluster(tmp_path, site_config):
    run = cli("ingest", "--db", str(tmp_path / "x.db"), env=site_config)
    assert run.returncode == 52
    first, last = run.stderr.strip().splitlines()
    assert first.startswith("slurm-geo: error: accounting:onprem not read: ")
    assert last == "slurm-geo: error: billing ingest: 1 source(s) not read (accounting:onprem);" \
        " their watermarks stay, the next run reads those windows again"
    assert "Traceback" not in run.stderr
    assert "accounting:onprem  failed" in run.stdout and "no watermark yet" in run.stdout


def test_help_lists_billing():
    run = subprocess.run([sys.executable, "-m", "slurm_geo", "--help"], capture_output=True,
                         text=True, timeout=30)
    assert "billing" in run.stdout


def test_db_path_not_writable_is_one_line(tmp_path, site_config):
    blocker = tmp_path / "file"
    blocker.write_text("")
    run = cli("report", "--period", "2026-11", "--db", str(Path(blocker) / "b.db"),
              env=site_config)
    assert run.returncode == 50 and "Traceback" not in run.stderr


@pytest.mark.parametrize("by", ["cost-center", "user", "cluster", "job"])
def test_stored_lines_and_pricing_on_the_fly_agree(db, by):
    dated = [*PRICES, PriceEntry(int(datetime(2026, 11, 2, 10, 30, tzinfo=UTC).timestamp()),
                                 2.0, 0.05, 0.09, 4.0, cluster="rented", source="t")]
    load(db, LINES + [sacct_line(40, state="RUNNING", end="Unknown")], prices=dated)
    period = parse_period("2026-11")
    stored = service.report(db, period, by, stored=True)
    fly = service.report(db, period, by, stored=False)
    assert {k: v.as_dict() for k, v in stored.groups.items()} == \
        {k: v.as_dict() for k, v in fly.groups.items()}
    assert {k: v.as_dict() for k, v in stored.clusters.items()} == \
        {k: v.as_dict() for k, v in fly.clusters.items()}
    assert sorted(map(repr, stored.flags)) == sorted(map(repr, fly.flags))


def test_budget_alerts_reach_the_webhook(tmp_path, site_config, hook):
    url, received = hook
    with BillingDB(tmp_path / "billing.db") as db:
        load(db)
    run = cli("budgets", "--period", "2026-11", "--webhook", url, "--json", env=site_config)
    assert run.returncode == 51
    [body] = received
    assert body["period"] == "2026-11"
    assert [(a["level"], a["cost_center"]) for a in body["alerts"]] == [("exceeded",
                                                                         "ml-research")]
    assert json.loads(run.stdout)["alerts"][0]["cost_center"] == "ml-research"


def test_a_database_of_another_schema_is_refused(tmp_path):
    from slurm_geo.billing.errors import BillingError

    path = tmp_path / "old.db"
    with BillingDB(path) as db, db.conn:
        db.conn.execute("UPDATE meta SET value = '0' WHERE key = 'schema_version'")
    with pytest.raises(BillingError, match="has billing schema 0"):
        BillingDB(path)


# --- egress: checkpoint-sync's transfers, charged to the job that owns the run ---------------

def test_egress_is_charged_to_the_job_that_owns_the_run(tmp_path):
    from slurm_geo.registry.db import Registry
    from slurm_geo.sync.state import StateDB

    nov = datetime(2026, 11, 12, tzinfo=UTC).timestamp()
    state = StateDB(tmp_path / "sync.db")
    [replica_id] = state.add([{"root": "pfs", "run": "llm-7b", "step": 100,
                               "destination": "offsite", "sequence": 1,
                               "status": "pending"}], now=nov)
    replica = state.replica(replica_id)
    for kind, size, source, dest in (("chunks", 3 * 10**9, "home", "remote"),
                                     ("verify", 2 * 10**9, "remote", "home"),
                                     ("local", 10**9, "home", "home")):
        state.record_transfer(replica, {
            "object": f"{kind}/x", "kind": kind, "bytes": size, "source": "file:///pfs",
            "source_region": source, "destination_region": dest,
            "started_at": nov, "finished_at": nov + 10})
    [orphan] = state.add([{"root": "pfs", "run": "nobody", "step": 1, "destination": "offsite",
                           "sequence": 1, "status": "pending"}], now=nov)
    state.record_transfer(state.replica(orphan), {
        "object": "chunks/y", "kind": "chunks", "bytes": 10**9, "source": "file:///pfs",
        "source_region": "remote", "destination_region": "home", "started_at": nov,
        "finished_at": nov + 5})
    state.close()
    with Registry(tmp_path / "registry.db") as registry:
        registry.job_started("onprem", 3, 0, name="llm", user="alice", nodes="n1",
                             directives={"geo-ckpt-dir": "/pfs/ckpt/llm-7b",
                                         "geo-cost-center": "ml-research"}, now=nov - 100)
        registry.link("rented", 5, "onprem", 3, now=nov - 50)
    lineage, jobs = records.read_registry(tmp_path / "registry.db")
    assert lineage[("rented", 5)] == "onprem:3"
    owners = Owners(registry=jobs, registry_lineage=lineage)

    with BillingDB(tmp_path / "billing.db") as db:
        db.set_prices(PRICES, CLUSTERS)
        table = costs.PriceTable(PRICES, CLUSTERS)
        for _ in range(2):  # the second time changes nothing
            count = ingest.ingest_egress(db, tmp_path / "sync.db", None, owners, table, 0,
                                         int(nov) + 60)
            if _ == 0:
                before = db.dump()
        assert db.dump() == before and count == 4
        result = service.report(db, parse_period("2026-11"), "cost-center")
    # 3 GB leave `home` (onprem: 0 USD/GB); 2 GB of verification reads leave `remote`
    # (rented: 0.09 USD/GB); traffic inside `home` is free; nobody owns run "nobody".
    assert result.groups["ml-research"].egress_bytes == 5 * 10**9
    assert result.groups["ml-research"].egress_usd == pytest.approx(0.18)
    assert result.groups["(none)"].egress_usd == pytest.approx(0.09)
    assert [(f.kind, f.subject) for f in result.flags] == [("no cost center", "run:nobody")]


@pytest.mark.parametrize("content, message", [
    (b"not a database at all, just text" * 100, "file is not a database"),
    (None, "table cost_lines is not the one this slurm-geo writes"),
])
def test_a_foreign_database_is_one_line(tmp_path, site_config, content, message):
    import sqlite3

    path = tmp_path / "foreign.db"
    if content is None:
        with sqlite3.connect(path) as conn:
            conn.execute("CREATE TABLE cost_lines (owner TEXT, kind TEXT)")
    else:
        path.write_bytes(content)
    run = cli("ingest", "--db", str(path), env=site_config)
    assert run.returncode == 50
    assert message in run.stderr and "Traceback" not in run.stderr


# --- egress: the federation daemon's copies when a job moves, from its audit log -------------

def _copy_entry(audit, **detail):
    full = {"bytes": 2 * 10**9, "seconds": 4.0, "packs_copied": 3, "run": "llm-7b",
            "step": 120, "source": "offsite", "destination": "pfs",
            "source_region": "remote", "destination_region": "home", **detail}
    return audit.append("transfer", "onprem-3", "copied llm-7b@120 from offsite to pfs",
                        "the job moves; its newest checkpoint goes with it", **full)


def test_the_daemons_copies_are_transfers_as_checkpoint_sync_records_them(tmp_path):
    from slurm_geo.federation.state.audit import AuditLog

    nov = datetime(2026, 11, 12, tzinfo=UTC).timestamp()
    with AuditLog(tmp_path / "audit.db", clock=lambda: nov) as audit:
        entries = [
            _copy_entry(audit),
            audit.append("requeue", "onprem-3", "moved", "outage", cluster="rented"),
            audit.append("transfer", "onprem-3", "copied x", "older daemon", bytes=5,
                         seconds=1.0, packs_copied=1),  # no destination recorded: skipped
        ]
    assert ingest.federation_transfers(entries, int(nov), int(nov) + 1) == [{
        "logical_job": "onprem-3", "run": "llm-7b", "step": 120,
        "object": "manifests/llm-7b/00000000000000000120",
        "kind": "move", "started_at": nov - 4.0, "finished_at": nov, "bytes": 2 * 10**9,
        "source": "offsite", "destination": "pfs", "source_region": "remote",
        "destination_region": "home"}]
    assert ingest.federation_transfers(entries, int(nov) + 1, int(nov) + 60) == []


def test_a_failback_copy_is_charged_as_egress_to_the_job(tmp_path):
    from slurm_geo.federation.state.audit import AuditLog
    from slurm_geo.registry.db import Registry

    nov = datetime(2026, 11, 12, tzinfo=UTC).timestamp()
    with AuditLog(tmp_path / "audit.db", clock=lambda: nov) as audit:
        _copy_entry(audit)  # 2 GB leave `remote` (rented: 0.09 USD/GB)
        _copy_entry(audit, step=80, source="pfs", destination="offsite",
                    source_region="home", destination_region="home")  # free: one region
    with Registry(tmp_path / "registry.db") as registry:
        registry.job_started("onprem", 3, 0, name="llm", user="alice", nodes="n1",
                             directives={"geo-ckpt-dir": "/pfs/ckpt/llm-7b",
                                         "geo-cost-center": "ml-research"}, now=nov - 100)
    # The audit log names the copies' logical job; the registry its directives.
    owners = records.read_ownership(tmp_path / "registry.db", None,
                                    tmp_path / "audit.db").owners
    with BillingDB(tmp_path / "billing.db") as db:
        db.set_prices(PRICES, CLUSTERS)
        table = costs.PriceTable(PRICES, CLUSTERS)
        dumps = []
        for _ in range(2):  # the second time changes nothing
            count = ingest.ingest_egress(db, None, tmp_path / "audit.db", owners, table, 0,
                                         int(nov) + 60)
            dumps.append(db.dump())
        assert count == 2 and dumps[0] == dumps[1]
        result = service.report(db, parse_period("2026-11"), "cost-center")
    assert result.groups["ml-research"].egress_bytes == 2 * 10**9
    assert result.groups["ml-research"].egress_usd == pytest.approx(0.18)


# --- a source billing is configured to read, but cannot: ingest fails, loudly ---------------

@pytest.fixture
def synced_site(tmp_path):
    """A site whose [sync] state and [registry] path billing reads."""
    path = tmp_path / "synced.toml"
    path.write_text(f"""
[site]
home_cluster = "onprem"
[clusters.onprem]
region = "home"
access = "cli"
slurm_conf = "/nonexistent/slurm.conf"
timeout_s = 2
[stores.pfs]
url = "file://{tmp_path / 'pfs'}"
region = "home"
[stores.offsite]
url = "file://{tmp_path / 'offsite'}"
region = "remote"
[sync]
roots = ["pfs"]
destination = "offsite"
state = "{tmp_path / 'sync.db'}"
[registry]
path = "{tmp_path / 'registry.db'}"
[billing]
database = "{tmp_path / 'billing.db'}"
""")
    return {"SLURM_GEO_CONFIG": str(path)}


def _damage(path):
    path.write_bytes(b"not a database, whatever it is\n" * 100)


def _drop_transfers(path):
    import sqlite3

    from slurm_geo.sync.state import StateDB

    StateDB(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute("ALTER TABLE transfers RENAME TO transfers_v2")


@pytest.mark.parametrize("make, message", [
    (None, "there is no such file; is checkpoint-sync running on this host?"),
    (_damage, "file is not a database"),
    (_drop_transfers, "no such table: transfers"),
])
def test_an_unreadable_sync_state_fails_egress_ingest_and_keeps_the_watermark(
        tmp_path, make, message):
    from slurm_geo.sync.reader import SyncStateUnreadable

    sync = tmp_path / "sync.db"
    if make is not None:
        make(sync)
    with BillingDB(tmp_path / "billing.db") as db:
        db.set_prices(PRICES, CLUSTERS)
        db.set_watermark(ingest.EGRESS_SOURCE, 123)
        with pytest.raises(SyncStateUnreadable, match=message):
            ingest.ingest_egress(db, sync, None, Owners(), costs.PriceTable(PRICES, CLUSTERS),
                                 0, 10**10)
        assert db.watermark(ingest.EGRESS_SOURCE) == 123
        assert db.conn.execute("SELECT COUNT(*) FROM egress").fetchone()[0] == 0


DAMAGED = ": file is not a database: the file is damaged or is another database; check " \
    "the configured path"


def test_cli_ingest_stops_at_an_unreadable_registry(tmp_path, synced_site):
    """Nothing is read without the registry's lineage: every other source is skipped, so
    no watermark moves past what would be billed without it. Exit 42, the registry's."""
    from slurm_geo.sync.state import StateDB

    StateDB(tmp_path / "sync.db").close()
    _damage(tmp_path / "registry.db")
    run = cli("ingest", "--json", env=synced_site)
    assert run.returncode == 42, run.stderr
    assert run.stderr.strip().splitlines()[0] == "slurm-geo: error: ownership not read: " \
        f"cannot read the job registry {tmp_path}/registry.db{DAMAGED}"
    outcomes = {s["source"]: s["outcome"] for s in json.loads(run.stdout)["sources"]}
    assert outcomes == {"ownership": "failed", "accounting:onprem": "skipped",
                        "egress": "skipped"}
    assert "Traceback" not in run.stderr


def test_cli_ingest_names_every_source_it_could_not_read(tmp_path, synced_site):
    """An unreachable cluster (exit 52 alone) and a damaged checkpoint-sync state (exit 40
    alone): together, 52; each on its own line, naming its fix."""
    _damage(tmp_path / "sync.db")
    run = cli("ingest", env=synced_site)
    assert run.returncode == 52, run.stderr
    lines = run.stderr.strip().splitlines()
    assert lines[0].startswith("slurm-geo: error: accounting:onprem not read: ")
    assert lines[1] == "slurm-geo: error: egress not read: cannot read checkpoint-sync's " \
        f"state {tmp_path}/sync.db{DAMAGED}"
    assert lines[2].startswith("slurm-geo: error: billing ingest: 2 source(s) not read "
                               "(accounting:onprem, egress)")
    assert "Traceback" not in run.stderr


def test_cli_ingest_with_readable_sources_and_no_registry_yet(tmp_path, synced_site):
    from slurm_geo.sync.state import StateDB

    StateDB(tmp_path / "sync.db").close()  # checkpoint-sync ran; no geo job started yet
    run = cli("ingest", "--json", env=synced_site)
    assert run.returncode == 52  # only the unreachable cluster is reported
    assert "accounting:onprem not read" in run.stderr and "Traceback" not in run.stderr
    doc = json.loads(run.stdout)
    assert doc["transfers"] == 0 and list(doc["failures"]) == ["accounting:onprem"]
    assert [(s["source"], s["outcome"]) for s in doc["sources"]] == [
        ("ownership", "read"), ("accounting:onprem", "failed"), ("egress", "read")]
