"""`billing check`: the comparison, pure and table-driven; then `run_check` over FakeSlurm
and real databases (billing, checkpoint-sync's state, the federation audit log)."""

from __future__ import annotations

import pytest

from slurm_geo.billing import check, service, sources
from slurm_geo.billing.db import BillingDB
from slurm_geo.billing.periods import Period, parse_period
from slurm_geo.slurm.models import JobSpec
from tests.kit.billing import (  # noqa: F401 - the fixtures clock and clusters
    HOUR,
    T0,
    clock_fixture,
    clusters_fixture,
    config,
)

W = Period("w", T0, T0 + 10 * HOUR)
INC = check.Incarnation(job_id=7, submit_ts=T0, start_ts=T0 + 60, end_ts=T0 + 60 + HOUR,
                        elapsed_s=HOUR, cpus=2, gpus=1, as_of=T0 + 2 * HOUR)


# --- pure: usage of a window -------------------------------------------------------------

@pytest.mark.parametrize("inc, expected", [
    (INC, (2 * HOUR, HOUR)),
    (INC._replace(elapsed_s=HOUR - 100), (2 * (HOUR - 100), HOUR - 100)),  # suspended 100 s
    (INC._replace(start_ts=T0 - HOUR, end_ts=T0 + 60), (120, 60)),  # cut by the start
    (INC._replace(end_ts=None, as_of=T0 + 60 + 600), (1200, 600)),  # running: up to as_of
    (INC._replace(end_ts=None, as_of=T0 + 20 * HOUR), (2 * (10 * HOUR - 60), 10 * HOUR - 60)),
    (INC._replace(start_ts=None, end_ts=None), None),  # never started
    (INC._replace(start_ts=T0 + 10 * HOUR, end_ts=T0 + 11 * HOUR), None),  # after the window
    (INC._replace(end_ts=T0 + 60, elapsed_s=0), (0, 0)),  # requeued itself within a second
    (INC._replace(start_ts=T0, end_ts=T0, elapsed_s=0), (0, 0)),  # ... at the window's start
    (INC._replace(start_ts=T0 + 10 * HOUR, end_ts=T0 + 10 * HOUR, elapsed_s=0), None),
], ids=["whole", "suspended", "cut", "running", "running past the window", "pending",
        "outside", "zero seconds", "zero seconds at the start", "zero seconds at the end"])
def test_usage_counts_what_the_cost_lines_count(inc, expected):
    assert check.usage([inc], W).get((7, T0)) == expected


# --- pure: the comparison ----------------------------------------------------------------

A, B, C = (7, T0), (7, T0 + 600), (8, T0)  # B: job 7 requeued
BOTH = {A: (7200, 3600), B: (600, 0), C: (100, 0)}


def lines(billed, accounted):
    return [d.message for d in check.compare_usage("accounting:rented", "rented", W, billed,
                                                   accounted)]


@pytest.mark.parametrize("billed, accounted, expected", [
    (BOTH, BOTH, []),
    ({}, {}, []),
    ({A: BOTH[A], C: BOTH[C]}, BOTH, [
        "accounting:rented w: incarnations: Slurm accounts for 3, billing holds 2",
        "accounting:rented w: cpu-seconds: Slurm accounts for 7900, billing holds 7300",
        "accounting:rented w: incarnation rented:7 submitted 2026-11-02T10:10:00Z (600 cpu-s "
        "and 0 gpu-s) is in Slurm's accounting, not in billing"]),
    ({**BOTH, (9, T0): (50, 0)}, BOTH, [
        "accounting:rented w: jobs: Slurm accounts for 2, billing holds 3",
        "accounting:rented w: incarnations: Slurm accounts for 3, billing holds 4",
        "accounting:rented w: cpu-seconds: Slurm accounts for 7900, billing holds 7950",
        "accounting:rented w: incarnation rented:9 submitted 2026-11-02T10:00:00Z (50 cpu-s "
        "and 0 gpu-s) is in billing, not in Slurm's accounting"]),
    ({**BOTH, A: (7200, 1800)}, BOTH, [
        "accounting:rented w: gpu-seconds: Slurm accounts for 3600, billing holds 1800",
        "accounting:rented w: incarnation rented:7 submitted 2026-11-02T10:00:00Z: billing "
        "holds 7200 cpu-s and 1800 gpu-s, Slurm accounts for 7200 cpu-s and 3600 gpu-s"]),
    ({A: BOTH[A], B: (500, 0), C: BOTH[C]}, {A: BOTH[A], B: BOTH[B], C: (100, 100)}, [
        "accounting:rented w: cpu-seconds: Slurm accounts for 7900, billing holds 7800",
        "accounting:rented w: gpu-seconds: Slurm accounts for 3700, billing holds 3600",
        "accounting:rented w: incarnation rented:7 submitted 2026-11-02T10:10:00Z: billing "
        "holds 500 cpu-s and 0 gpu-s, Slurm accounts for 600 cpu-s and 0 gpu-s",
        "accounting:rented w: incarnation rented:8 submitted 2026-11-02T10:00:00Z: billing "
        "holds 100 cpu-s and 0 gpu-s, Slurm accounts for 100 cpu-s and 100 gpu-s"]),
], ids=["agree", "both empty", "a requeue missing", "one too many", "gpu-seconds differ",
        "two differ"])
def test_compare_usage(billed, accounted, expected):
    assert lines(billed, accounted) == expected


def test_only_the_first_few_differing_incarnations_are_named():
    accounted = {(job, T0): (10, 0) for job in range(1, 13)}
    found = lines({}, accounted)
    assert len(found) == 3 + check.NAMED + 1  # jobs, incarnations, cpu-seconds; names; rest
    assert found[-1] == "accounting:rented w: and 7 more incarnation(s) that differ"


def test_a_difference_carries_both_sides_for_scripts():
    [totals, *_] = check.compare_usage("accounting:rented", "rented", W, {}, {A: (1, 2)})
    assert totals.as_dict() == {"source": "accounting:rented", "measure": "jobs", "billed": 0,
                                "accounted": 1, "message": totals.message}
    named = check.compare_usage("accounting:rented", "rented", W, {}, {A: (1, 2)})[-1]
    assert (named.measure, named.billed, named.accounted) == ("incarnation", None, [1, 2])


X = ("llm-7b", 100, "chunks/x", "chunks", float(T0))
Y = ("llm-7b", 100, "manifests/llm-7b/100", "manifest", float(T0) + 0.5)


@pytest.mark.parametrize("billed, recorded, expected", [
    ({X: 10, Y: 1}, {X: 10, Y: 1}, []),
    ({X: 10}, {X: 10, Y: 1}, [
        "egress:checkpoint-sync w: transfers: checkpoint-sync recorded 2, billing holds 1",
        "egress:checkpoint-sync w: bytes: checkpoint-sync recorded 11, billing holds 10",
        "egress:checkpoint-sync w: transfer llm-7b@100 manifests/llm-7b/100 (manifest, "
        "started 2026-11-02T10:00:00Z) (1 bytes) is in checkpoint-sync, not in billing"]),
    ({X: 9, Y: 1}, {X: 10, Y: 1}, [
        "egress:checkpoint-sync w: bytes: checkpoint-sync recorded 11, billing holds 10",
        "egress:checkpoint-sync w: transfer llm-7b@100 chunks/x (chunks, started "
        "2026-11-02T10:00:00Z): billing holds 9 bytes, checkpoint-sync recorded 10 bytes"]),
], ids=["agree", "one missing", "bytes differ"])
def test_compare_transfers(billed, recorded, expected):
    assert [d.message for d in check.compare_transfers(
        "egress:checkpoint-sync", "checkpoint-sync", W, billed, recorded)] == expected


# --- run_check over FakeSlurm and real files -------------------------------------------------

NOV = parse_period("2026-11")


def ingest_and_check(tmp_path, clusters, clock, **extra):
    cfg = config(tmp_path, **extra)
    with BillingDB(tmp_path / "billing.db") as db:
        ingested = service.run_ingest(db, cfg, list(clusters.values()), clock.now)
        assert not ingested.failures
        return service.run_check(db, cfg, list(clusters.values()), NOV, clock.now + 60)


def test_a_clean_ingest_checks_clean(tmp_path, clusters, clock):
    result = ingest_and_check(tmp_path, clusters, clock)
    assert result.differences == [] and result.exit_code == 0
    assert [(r.source, r.detail) for r in result.sources] == [
        ("accounting:onprem", "agrees"), ("accounting:rented", "agrees")]
    assert result.totals["accounting:rented"]["accounted"] == {
        "jobs": 1, "incarnations": 1, "cpu_seconds": 2 * HOUR, "gpu_seconds": 0}
    # Compared up to where ingest read completely: its "now", less what slurmdbd may still
    # be recording.
    [rented] = [r for r in result.sources if r.source == "accounting:rented"]
    assert rented.until == clock.now - sources.ACCOUNTING_SETTLE_S


def test_a_row_deleted_from_the_billing_database_is_named(tmp_path, clusters, clock):
    ingest_and_check(tmp_path, clusters, clock)
    with BillingDB(tmp_path / "billing.db") as db:
        db.conn.execute("DELETE FROM jobs WHERE cluster = 'rented'")
        db.conn.commit()
        result = service.run_check(db, config(tmp_path), list(clusters.values()), NOV,
                                   clock.now + 60)
    assert result.exit_code == 53
    assert [d.message for d in result.differences] == [
        "accounting:rented 2026-11: jobs: Slurm accounts for 1, billing holds 0",
        "accounting:rented 2026-11: incarnations: Slurm accounts for 1, billing holds 0",
        "accounting:rented 2026-11: cpu-seconds: Slurm accounts for 7200, billing holds 0",
        "accounting:rented 2026-11: incarnation rented:1 submitted 2026-11-02T10:00:00Z "
        "(7200 cpu-s and 0 gpu-s) is in Slurm's accounting, not in billing"]


def test_requeues_and_jobs_still_running_agree(tmp_path, clusters, clock):
    """A requeue is an incarnation on both sides; a job running at ingest is compared up
    to the same moment on both sides, however long it has run since."""
    rented = clusters["rented"]
    job = rented.submit(JobSpec(script="#!/bin/bash\n", cpus_per_task=1, requeue=True))
    rented.start(job)
    clock.now += 600
    rented.requeue(job)
    rented.start(job)
    clock.now += 600
    result = ingest_and_check(tmp_path, clusters, clock)
    assert result.differences == []
    assert result.totals["accounting:rented"]["billed"]["incarnations"] == 3
    clock.now += HOUR  # the job runs on; check again, later
    with BillingDB(tmp_path / "billing.db") as db:
        again = service.run_check(db, config(tmp_path), list(clusters.values()), NOV,
                                  clock.now)
    assert again.differences == []


def test_a_zero_second_incarnation_deleted_from_billing_is_named(tmp_path, clusters,
                                                                  clock):
    """A job that requeues itself within the second it started is worth nothing, yet its
    record missing from billing is still a difference, named (it once passed unseen)."""
    rented = clusters["rented"]
    job = rented.submit(JobSpec(script="#!/bin/bash\n", cpus_per_task=1, requeue=True))
    clock.now += 1
    rented.start(job)
    rented.requeue(job)  # in the same second
    clock.now += 1
    rented.start(job)
    clock.now += 600
    ingest_and_check(tmp_path, clusters, clock)
    with BillingDB(tmp_path / "billing.db") as db:
        [zero] = db.conn.execute("SELECT submit_ts FROM jobs WHERE cluster = 'rented' AND "
                                 "job_id = ? AND elapsed_s = 0 AND end_ts IS NOT NULL",
                                 [job]).fetchall()
        db.conn.execute("DELETE FROM jobs WHERE cluster = 'rented' AND job_id = ? AND "
                        "submit_ts = ?", [job, zero["submit_ts"]])
        db.conn.commit()
        result = service.run_check(db, config(tmp_path), list(clusters.values()), NOV,
                                   clock.now + 60)
    assert result.exit_code == 53
    assert any(f"incarnation rented:{job} submitted" in d.message and "(0 cpu-s and 0 gpu-s) "
               "is in Slurm's accounting, not in billing" in d.message
               for d in result.differences), [d.message for d in result.differences]


def test_a_cluster_never_ingested_shows_every_job_it_ran(tmp_path, clusters, clock):
    clusters["rented"].refuse_token()
    with BillingDB(tmp_path / "billing.db") as db:
        service.run_ingest(db, config(tmp_path), list(clusters.values()), clock.now)
        clusters["rented"].accept_token()
        result = service.run_check(db, config(tmp_path), list(clusters.values()), NOV,
                                   clock.now + 600)
    assert result.exit_code == 53
    assert any("incarnation rented:1 submitted 2026-11-02T10:00:00Z (7200 cpu-s and 0 "
               "gpu-s) is in Slurm's accounting, not in billing" in d.message
               for d in result.differences)


def test_a_cluster_that_cannot_be_read_is_reported_not_passed(tmp_path, clusters, clock):
    with BillingDB(tmp_path / "billing.db") as db:
        service.run_ingest(db, config(tmp_path), list(clusters.values()), clock.now)
        clusters["rented"].go_down()
        result = service.run_check(db, config(tmp_path), list(clusters.values()), NOV,
                                   clock.now)
    assert result.differences == [] and result.exit_code == 52
    [failed] = [r for r in result.sources if r.outcome is sources.Outcome.FAILED]
    assert failed.source == "accounting:rented" and "controller unreachable" in failed.detail


def test_a_period_not_ingested_yet_is_skipped(tmp_path, clusters, clock):
    with BillingDB(tmp_path / "billing.db") as db:
        service.run_ingest(db, config(tmp_path), list(clusters.values()), clock.now)
        result = service.run_check(db, config(tmp_path), list(clusters.values()),
                                   parse_period("2026-12"), clock.now)
    assert result.exit_code == 0
    assert {r.outcome for r in result.sources} == {sources.Outcome.SKIPPED}


# --- egress: checkpoint-sync's transfers and the daemon's copies ------------------------------

def sync_state(path, transfers):
    from slurm_geo.sync.state import StateDB

    state = StateDB(path)
    [replica_id] = state.add([{"root": "pfs", "run": "llm-7b", "step": 100,
                               "destination": "offsite", "sequence": 1,
                               "status": "pending"}], now=T0)
    replica = state.replica(replica_id)
    for name, size, finished in transfers:
        state.record_transfer(replica, {
            "object": name, "kind": "chunks", "bytes": size, "source": "file:///pfs",
            "source_region": "home", "destination_region": "remote", "started_at": finished - 5,
            "finished_at": finished})
    state.close()


def audit_log(path, copies):
    from slurm_geo.federation.state.audit import AuditLog

    for step, when in copies:
        with AuditLog(path, clock=lambda w=when: w) as audit:
            audit.append("transfer", "onprem-3", "copied", "the job moves", bytes=2 * 10**9,
                         seconds=4.0, packs_copied=3, run="llm-7b", step=step,
                         source="offsite", destination="pfs", source_region="remote",
                         destination_region="home")


def test_egress_agrees_then_names_what_billing_lacks(tmp_path, clusters, clock):
    sync_state(tmp_path / "sync.db", [("chunks/a", 10**9, T0 + 10), ("chunks/b", 5, T0 + 20)])
    audit_log(tmp_path / "audit.db", [(120, T0 + 30)])
    extra = {"sync_state": tmp_path / "sync.db", "federation_audit": tmp_path / "audit.db"}
    clock.now = T0 + 3 * HOUR  # egress is compared up to an hour before the ingest
    result = ingest_and_check(tmp_path, clusters, clock, **extra)
    assert result.differences == []
    assert result.totals["egress:checkpoint-sync"]["billed"] == {"transfers": 2,
                                                                 "bytes": 10**9 + 5}
    assert result.totals["egress:federation"]["accounted"] == {"transfers": 1,
                                                               "bytes": 2 * 10**9}

    with BillingDB(tmp_path / "billing.db") as db:
        db.conn.execute("DELETE FROM egress WHERE object = 'chunks/b' OR kind = 'move'")
        db.conn.commit()
        later = service.run_check(db, config(tmp_path, **extra), list(clusters.values()), NOV,
                                  clock.now)
    messages = [d.message for d in later.differences]
    assert later.exit_code == 53
    assert "egress:checkpoint-sync 2026-11: transfer llm-7b@100 chunks/b (chunks, started " \
        "2026-11-02T10:00:15Z) (5 bytes) is in checkpoint-sync, not in billing" in messages
    assert "egress:federation 2026-11: bytes: the federation daemon recorded 2000000000, " \
        "billing holds 0" in messages


def test_an_unreadable_sync_state_is_reported_by_check_too(tmp_path, clusters, clock):
    sync_state(tmp_path / "sync.db", [])
    extra = {"sync_state": tmp_path / "sync.db"}
    clock.now = T0 + 3 * HOUR
    with BillingDB(tmp_path / "billing.db") as db:
        service.run_ingest(db, config(tmp_path, **extra), list(clusters.values()), clock.now)
        (tmp_path / "sync.db").write_bytes(b"garbage" * 1000)
        result = service.run_check(db, config(tmp_path, **extra), list(clusters.values()), NOV,
                                   clock.now)
    assert result.exit_code == 40
    assert "cannot read checkpoint-sync's state" in result.as_dict()["sources"][-1]["detail"]


@pytest.mark.parametrize("until, now, expected", [
    (None, T0, T0 - sources.ACCOUNTING_SETTLE_S),  # until now: less what is still settling
    (T0 - 5, T0, T0 - 5),                          # an --until given: taken at its word
    (T0 + HOUR, T0, T0),                           # ... but nothing after now has happened
])
def test_how_far_a_source_is_covered(until, now, expected):
    assert sources.covered_until(until, now, sources.ACCOUNTING_SETTLE_S) == expected
