"""The Grafana dashboard and the Prometheus alerts under contrib/: promtool accepts the
rules and their unit tests, every dashboard query parses, and every metric they name is
one the running daemons export (checkpoint-sync as systemd runs it, the federation
daemon's endpoint on a real port)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.request

import lease_site
import pytest
import requests
import yaml

from slurm_geo.federation.daemon.service import Metrics
from tests.kit.sync import (
    ROOT,
    free_port,
    master_key,
    site_config,
    start_daemon,
    stop,
    wait_for,
)

RULES = ROOT / "contrib" / "prometheus" / "slurm-geo-rules.yml"
RULE_TESTS = ROOT / "contrib" / "prometheus" / "slurm-geo-rules.test.yml"
DASHBOARD = ROOT / "contrib" / "grafana" / "slurm-geo.json"
METRIC = re.compile(r"\bslurm_geo_[a-z_]+\b")

promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                              reason="promtool is not installed (Debian: apt-get install "
                              "prometheus, as `make install` does)")


def rule_expressions() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


def dashboard_expressions() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [target["expr"] for panel in panels for target in panel.get("targets", [])]


def exported_names(text: str) -> set[str]:
    """Every name a scrape shows: those declared (a counter's with _total) and sampled."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            names.add(line.split()[2])
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


@promtool
def test_promtool_accepts_the_rules_and_their_unit_tests():
    subprocess.run(["promtool", "check", "rules", str(RULES)], check=True,
                   capture_output=True)
    tested = subprocess.run(["promtool", "test", "rules", RULE_TESTS.name],
                            cwd=RULE_TESTS.parent, capture_output=True, text=True)
    assert tested.returncode == 0, tested.stdout + tested.stderr


@promtool
def test_every_dashboard_query_parses(tmp_path):
    """As recording rules, which promtool parses as PromQL."""
    rules = [{"record": f"slurm_geo:dashboard_query_{n}", "expr": expr}
             for n, expr in enumerate(dashboard_expressions())]
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    checked = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True,
                             text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_every_alert_says_what_it_is_about_and_the_runbook_explains_it():
    groups = yaml.safe_load(RULES.read_text())["groups"]
    runbook = (ROOT / "docs" / "runbook.md").read_text()
    for rule in (r for group in groups for r in group["rules"]):
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]
        assert f"`{rule['alert']}`" in runbook, rule["alert"]


@pytest.fixture
def sync_scrape(tmp_path):
    (tmp_path / "root").mkdir()
    (tmp_path / "offsite").mkdir()
    key_file, _ = master_key(tmp_path)
    config = site_config(tmp_path / "site.toml", {"pfs": tmp_path / "root"},
                         f"file://{tmp_path / 'offsite'}", key_file=key_file,
                         state=tmp_path / "state.db")
    port = free_port()
    proc = start_daemon(config, "--metrics-port", str(port), log=tmp_path / "log")
    try:
        yield wait_for(lambda: _scanned(port), 20, "checkpoint-sync's first scan")
    finally:
        stop(proc)


def _scanned(port: int) -> str | None:
    try:
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    except requests.RequestException:
        return None
    return text if "slurm_geo_sync_last_scan_timestamp_seconds " in text else None


@pytest.fixture
def federation_site(tmp_path):
    (tmp_path / "federation").mkdir()
    site = lease_site.start(tmp_path / "federation")
    yield site
    site.close()


def test_dashboard_and_alerts_name_only_metrics_the_daemons_export(sync_scrape,
                                                                     federation_site):
    with urllib.request.urlopen(f"{federation_site.url}/metrics", timeout=5) as response:
        exported = exported_names(sync_scrape) | exported_names(response.read().decode())
    queried = {name for expr in rule_expressions() + dashboard_expressions()
               for name in METRIC.findall(expr)}
    assert queried <= exported, f"named but not exported: {sorted(queried - exported)}"
    assert all(METRIC.search(expr) for expr in rule_expressions() + dashboard_expressions())


def test_the_federation_counts_moves_awaiting_approval_and_lease_replies(federation_site):
    federation = federation_site.federation
    federation.state.await_approval("onprem-5", "onprem", time.time())
    metrics = Metrics()
    metrics.observe(federation)
    assert metrics.registry.get_sample_value(
        "slurm_geo_federation_moves_awaiting_approval") == 1
    for path in ("/v1/lease", "/v1/lease", "/v1/no-such-path"):
        request = urllib.request.Request(f"{federation_site.url}{path}", data=b"[]",
                                         method="POST")
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(request, timeout=5)
    with urllib.request.urlopen(f"{federation_site.url}/metrics", timeout=5) as response:
        text = response.read().decode()
    assert 'slurm_geo_federation_lease_replies_total{code="400",path="/v1/lease"} 2.0' in text
    assert "no-such-path" not in text  # a path of a client's choosing makes no series


def test_a_scrape_names_what_it_declares_and_samples():
    text = ("# HELP a_total x\n# TYPE a_total counter\na_total{x=\"1\"} 2.0\n"
            "a_created 1.0\n# TYPE b gauge\nb 1\n")
    assert exported_names(text) == {"a_total", "a_created", "b"}

