"""`slurm-geo billing ingest` and `billing check` as the timer runs them, end to end without
Slurm: a stand-in `sacct` prints `--parsable2` rows, the databases are real files, the
budget webhook a local HTTP server."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from tests.kit.billing import cli, hook_fixture, sacct_line  # noqa: F401 - the fixture hook
from tests.kit.slurm import slurm_bin_fixture  # noqa: F401 - the fixture slurm_bin

ROWS = [sacct_line(1, cluster="onprem"),
        sacct_line(2, cluster="onprem", state="REQUEUED", end="2026-11-02T10:30:05",
                   elapsed=1800),
        sacct_line(2, cluster="onprem", submit="2026-11-02T10:30:06",
                   start="2026-11-02T10:31:00", end="2026-11-02T10:41:00", elapsed=600)]
SACCT = """#!{python} -I
import sys
sys.stdout.write(open({rows!r}).read())
"""
DOWN = """#!/bin/sh
echo 'sacct: error: Problem talking to the database: Connection refused' >&2
exit 1
"""


@pytest.fixture
def site(tmp_path, slurm_bin, hook) -> dict[str, str]:
    """One CLI cluster whose sacct is the stand-in; sacct prints times in UTC here."""
    import sys

    rows = tmp_path / "rows.txt"
    rows.write_text("".join(line.replace("|", "\x1f") + "\n" for line in ROWS))
    sacct = slurm_bin / "sacct"
    sacct.write_text(SACCT.format(python=sys.executable, rows=str(rows)))
    sacct.chmod(0o755)
    config = tmp_path / "site.toml"
    config.write_text(f"""
[site]
home_cluster = "onprem"
[clusters.onprem]
region = "home"
access = "cli"
slurm_conf = "/nonexistent/slurm.conf"
timeout_s = 10
[clusters.onprem.prices]
gpu_hour = 2.5
cpu_hour = 0.04
egress_per_gb = 0.0
marketplace_fee_pct = 0
[billing]
database = "{tmp_path / 'billing.db'}"
webhook_url = "{hook[0]}"
""")
    return {"SLURM_GEO_CONFIG": str(config), "TZ": "UTC"}


WINDOW = ["--since", "2026-11-02T00:00:00", "--until", "2026-11-03T00:00:00"]


def test_check_passes_after_a_clean_ingest(site):
    ingest = cli("ingest", *WINDOW, env=site)
    assert ingest.returncode == 0, ingest.stderr
    run = cli("check", "--period", "2026-11", env=site)
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""
    lines = run.stdout.splitlines()
    assert lines[0] == "billing check 2026-11"
    [onprem] = [line for line in lines if line.startswith("accounting:onprem")]
    assert onprem.split()[1:] == ["2026-11-01T00:00:00Z", "..", "2026-11-03T00:00:00Z",
                                  "agrees:", "2", "jobs,", "3", "incarnations,", "48000",
                                  "cpu-s,", "12000", "gpu-s"]


def test_check_fails_naming_a_row_deleted_from_the_billing_database(tmp_path, site, hook):
    assert cli("ingest", *WINDOW, env=site).returncode == 0
    with sqlite3.connect(tmp_path / "billing.db") as conn:
        conn.execute("DELETE FROM jobs WHERE job_id = 2 AND state = 'REQUEUED'")
    run = cli("check", "--period", "2026-11", "--alert", env=site)
    assert run.returncode == 53, run.stderr
    lines = run.stderr.strip().splitlines()
    assert lines == [
        "slurm-geo: difference: accounting:onprem 2026-11: incarnations: Slurm accounts for 3, "
        "billing holds 2",
        "slurm-geo: difference: accounting:onprem 2026-11: cpu-seconds: Slurm accounts for "
        "48000, billing holds 33600",
        "slurm-geo: difference: accounting:onprem 2026-11: gpu-seconds: Slurm accounts for "
        "12000, billing holds 8400",
        "slurm-geo: difference: accounting:onprem 2026-11: incarnation onprem:2 submitted "
        "2026-11-02T10:00:00Z (14400 cpu-s and 3600 gpu-s) is in Slurm's accounting, not in "
        "billing",
        "slurm-geo: error: billing check 2026-11: 4 difference(s) between billing and its "
        "sources"]
    [body] = hook[1]
    assert body["period"] == "2026-11" and len(body["alerts"]) == 4
    assert {a["level"] for a in body["alerts"]} == {"error"}
    assert body["alerts"][0]["subject"] == "accounting:onprem"
    assert body["text"].startswith("billing check: accounting:onprem 2026-11: incarnations")


def test_check_json_for_scripts(tmp_path, site):
    assert cli("ingest", *WINDOW, env=site).returncode == 0
    with sqlite3.connect(tmp_path / "billing.db") as conn:
        conn.execute("UPDATE jobs SET elapsed_s = 60 WHERE job_id = 1")
    run = cli("check", "--period", "2026-11", "--json", env=site)
    assert run.returncode == 53
    doc = json.loads(run.stdout)
    assert doc["exit_code"] == 53 and doc["period"] == "2026-11"
    [source] = doc["sources"]
    assert source["billed"]["cpu_seconds"] == source["accounted"]["cpu_seconds"] - 8 * 3540
    assert [d["measure"] for d in doc["differences"]] == ["cpu-seconds", "gpu-seconds",
                                                          "incarnation"]


def test_ingest_exits_non_zero_and_alerts_when_slurmdbd_is_down(tmp_path, site, hook,
                                                                 slurm_bin):
    (slurm_bin / "sacct").write_text(DOWN)
    run = cli("ingest", "--alert", env=site)
    assert run.returncode == 52
    first = run.stderr.splitlines()[0]
    assert first.startswith("slurm-geo: error: accounting:onprem not read: cluster 'onprem': "
                            "accounting (slurmdbd) unreachable within 10 s (sacct: error: "
                            "Problem talking to the database: Connection refused)")
    [body] = hook[1]
    assert [(a["level"], a["subject"]) for a in body["alerts"]] == [("error",
                                                                     "accounting:onprem")]
    with sqlite3.connect(tmp_path / "billing.db") as conn:
        assert conn.execute("SELECT COUNT(*) FROM watermarks WHERE source LIKE "
                            "'%accounting%'").fetchone()[0] == 0


def test_check_with_no_billing_database_is_one_line(tmp_path, site):
    run = cli("check", "--period", "2026-11", env=site)
    assert run.returncode == 50
    assert run.stderr.strip() == f"slurm-geo: error: no billing database at {tmp_path}/" \
        "billing.db; run `slurm-geo billing ingest` first (or give --db PATH)"


def test_an_alert_that_cannot_be_delivered_is_said_and_the_exit_code_stays(tmp_path, site):
    text = Path(site["SLURM_GEO_CONFIG"]).read_text()
    Path(site["SLURM_GEO_CONFIG"]).write_text(
        text.replace("webhook_url = ", 'webhook_url = "http://127.0.0.1:9/x"\n# '))
    assert cli("ingest", *WINDOW, env=site).returncode == 0
    with sqlite3.connect(tmp_path / "billing.db") as conn:
        conn.execute("DELETE FROM jobs")
    run = cli("check", "--period", "2026-11", "--alert", env=site)
    assert run.returncode == 53
    assert "slurm-geo: warning: webhook http://127.0.0.1:9/x: ConnectionError; the lines " \
        "above were not delivered" in run.stderr
