"""Ingest is never silently incomplete: a source that cannot be read (a refused token, a
controller or slurmdbd that does not answer, an error in slurmrestd's answer, a database
that does not open) ends FAILED with its watermark where it was, the others are read, and
the next run bills what was missed. Over FakeSlurm, a stub slurmrestd and real files."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_geo.billing import service, sources
from slurm_geo.billing.db import BillingDB
from slurm_geo.billing.errors import SourceUnreadable
from slurm_geo.billing.periods import parse_period
from slurm_geo.billing.sources import Outcome, SourceRun
from tests.kit.billing import (  # noqa: F401 - the fixtures clock and clusters
    CLUSTERS,
    HOUR,
    PRICES,
    T0,
    clock_fixture,
    clusters_fixture,
    config,
)
from tests.kit.slurm import NO_SLURMDBD, OK_PING, Answer, rest_client


def outcomes(result) -> dict[str, str]:
    return {run.source: run.outcome.value for run in result.sources}


def rented_cpu_seconds(db) -> int:
    report = service.report(db, parse_period("2026-11"), "cluster")
    return report.clusters["rented"].cpu_seconds if "rented" in report.clusters else 0


def test_an_expired_rented_token_fails_loudly_and_the_next_run_bills_the_missed_job(
        tmp_path, clusters, clock):
    rented = clusters["rented"]
    rented.refuse_token()
    with BillingDB(tmp_path / "billing.db") as db:
        first = service.run_ingest(db, config(tmp_path), list(clusters.values()), clock.now)
        assert outcomes(first) == {"accounting:onprem": "read", "accounting:rented": "failed",
                                   "egress": "read"}
        assert first.exit_code == SourceUnreadable.exit_code == 52
        assert "token problem" in first.failures["accounting:rented"]
        assert "scontrol token username=fake-user" in first.failures["accounting:rented"]
        assert db.watermark("accounting:rented") is None
        assert db.watermark(sources.covered_key("accounting:rented")) is None
        assert rented_cpu_seconds(db) == 0
        assert db.watermark("accounting:onprem") == clock.now

        rented.accept_token()  # a new JWT was written
        clock.now += HOUR
        second = service.run_ingest(db, config(tmp_path), list(clusters.values()), clock.now)
        assert second.exit_code == 0 and not second.failures
        assert rented_cpu_seconds(db) == 2 * HOUR


def test_a_failure_after_a_good_run_keeps_the_watermark_it_had(tmp_path, clusters, clock):
    with BillingDB(tmp_path / "billing.db") as db:
        service.run_ingest(db, config(tmp_path), list(clusters.values()), clock.now)
        before = db.watermark("accounting:rented")
        covered = db.watermark(sources.covered_key("accounting:rented"))
        clusters["rented"].go_down()
        clock.now += HOUR
        result = service.run_ingest(db, config(tmp_path), list(clusters.values()), clock.now)
        [run] = [r for r in result.sources if r.source == "accounting:rented"]
        assert run.outcome is Outcome.FAILED and run.watermark == before
        assert "controller unreachable" in run.detail
        assert db.watermark("accounting:rented") == before
        assert db.watermark(sources.covered_key("accounting:rented")) == covered
        assert db.watermark("accounting:onprem") == clock.now


def test_slurmrestd_saying_it_cannot_reach_slurmdbd_is_not_an_empty_window(tmp_path, clock):
    """22.05 answers HTTP 200, "jobs": [] and "Failed connecting to slurmdbd" when
    slurmdbd is down: that window is not billed as empty, its watermark stays."""
    client, _ = rest_client(tmp_path, {("GET", "jobs"): Answer(200, NO_SLURMDBD),
                                       ("GET", "ping"): OK_PING})
    with BillingDB(tmp_path / "billing.db") as db:
        result = service.run_ingest(db, config(tmp_path), [client], clock.now)
        assert result.failures["accounting:rented"].startswith(
            "cluster 'rented': accounting (slurmdbd) unreachable")
        assert db.watermark("accounting:rented") is None


def _damage(path: Path) -> None:
    path.write_bytes(b"not a database, whatever it is\n" * 100)


def test_an_unreadable_registry_reads_nothing_else(tmp_path, clusters, clock):
    _damage(tmp_path / "registry.db")
    with BillingDB(tmp_path / "billing.db") as db:
        result = service.run_ingest(db, config(tmp_path, registry=tmp_path / "registry.db"),
                                    list(clusters.values()), clock.now)
        assert outcomes(result) == {"ownership": "failed", "accounting:onprem": "skipped",
                                    "accounting:rented": "skipped", "egress": "skipped"}
        assert result.exit_code == 42
        assert not any(db.watermark(s) for s in ("accounting:onprem", "accounting:rented",
                                                 "egress"))


def test_an_unreadable_sync_state_fails_egress_alone(tmp_path, clusters, clock):
    _damage(tmp_path / "sync.db")
    with BillingDB(tmp_path / "billing.db") as db:
        db.set_watermark("egress", T0 - HOUR)
        result = service.run_ingest(db, config(tmp_path, sync_state=tmp_path / "sync.db"),
                                    list(clusters.values()), clock.now)
        assert outcomes(result)["egress"] == "failed" and result.exit_code == 40
        assert "cannot read checkpoint-sync's state" in result.failures["egress"]
        assert db.watermark("egress") == T0 - HOUR
        assert rented_cpu_seconds(db) == 2 * HOUR  # the clusters were read all the same


def _audit_with_a_damaged_page(path: Path) -> None:
    """An audit log that opens (its first page is whole) but cannot be read to its end."""
    from slurm_geo.federation.state.audit import AuditLog

    with AuditLog(path, clock=lambda: T0) as audit:
        for i in range(200):
            audit.append("transfer", "onprem-3", f"copied {i}", "x" * 200, run="r", step=i)
    data = bytearray(path.read_bytes())
    page = 4096
    data[3 * page:len(data) - page] = b"\xff" * (len(data) - 4 * page)
    path.write_bytes(bytes(data))
    for suffix in ("-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


@pytest.mark.parametrize("make", [_damage, _audit_with_a_damaged_page],
                         ids=["does not open", "damaged page"])
def test_an_unreadable_audit_log_stops_ingest_with_the_audit_logs_code(tmp_path, clusters,
                                                                       clock, make):
    """The audit log says which Slurm jobs are legs of which logical job: without it
    nothing would be billed under the right job, so nothing is read."""
    make(tmp_path / "audit.db")
    with BillingDB(tmp_path / "billing.db") as db:
        result = service.run_ingest(db, config(tmp_path, federation_audit=tmp_path / "audit.db"),
                                    list(clusters.values()), clock.now)
        assert outcomes(result)["ownership"] == "failed" and result.exit_code == 55
        assert outcomes(result)["egress"] == "skipped"
        assert "audit log" in result.failures["ownership"]
        assert db.watermark("egress") is None


def test_the_result_reports_each_source_for_scripts(tmp_path, clusters, clock):
    clusters["rented"].refuse_token()
    with BillingDB(tmp_path / "billing.db") as db:
        doc = service.run_ingest(db, config(tmp_path), list(clusters.values()),
                                 clock.now).as_dict()
    rented = next(s for s in doc["sources"] if s["source"] == "accounting:rented")
    assert rented["outcome"] == "failed" and rented["exit_code"] == 52
    assert rented["watermark"] is None and rented["until"] == "2026-11-02T12:00:00Z"
    assert doc["exit_code"] == 52 and list(doc["failures"]) == ["accounting:rented"]


def run(source: str, outcome: Outcome, code: int = 0) -> SourceRun:
    return SourceRun(source, outcome, "", code)


READ, FAILED, SKIPPED = Outcome.READ, Outcome.FAILED, Outcome.SKIPPED


@pytest.mark.parametrize("runs, code", [
    ([], 0),
    ([run("accounting:a", READ), run("egress", READ)], 0),
    ([run("accounting:a", FAILED, 52), run("egress", READ)], 52),
    ([run("accounting:a", FAILED, 52), run("accounting:b", FAILED, 52)], 52),
    ([run("accounting:a", READ), run("egress", FAILED, 40)], 40),
    ([run("ownership", FAILED, 42), run("accounting:a", SKIPPED), run("egress", SKIPPED)], 42),
    ([run("egress", FAILED, 55)], 55),
    ([run("accounting:a", FAILED, 52), run("egress", FAILED, 40)], 52),
    ([run("egress:checkpoint-sync", FAILED, 40), run("egress:federation", FAILED, 55)], 52),
], ids=["nothing", "all read", "a cluster", "two clusters", "sync state", "registry",
        "audit log", "a cluster and the sync state", "two databases"])
def test_exit_codes(runs, code):
    assert sources.exit_code(runs) == code


def test_a_clusters_failure_is_52_whatever_its_slurm_reason():
    from slurm_geo.registry import RegistryUnreadable
    from slurm_geo.slurm.errors import ControllerUnreachable, SlurmRejected

    assert sources.failed("accounting:a", SlurmRejected("a", "accounting", "no")).code == 52
    assert sources.failed("accounting:a", ControllerUnreachable("a", "gone", 1)).code == 52
    assert sources.failed("ownership", RegistryUnreadable(Path("r"), "x")).code == 42
