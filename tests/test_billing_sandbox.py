"""Billing against the real sandbox: jobs on both clusters (onprem by CLI, rented by
slurmrestd), one requeued on each, ingested and compared with what sacct itself reports."""

from __future__ import annotations

import os
import subprocess
import time
from datetime import UTC, datetime

import pytest

from slurm_geo.billing import service
from slurm_geo.billing.config import billing_config
from slurm_geo.billing.db import BillingDB
from slurm_geo.billing.periods import Period
from slurm_geo.sandbox import remote_site
from slurm_geo.sandbox.users import ALICE
from slurm_geo.slurm import CliSlurmClient, JobSpec, JobState, connect
from slurm_geo.slurm.parse import tres_text
from tests.helpers import eventually

pytestmark = pytest.mark.sandbox

HOSTILE_NAME = "it's \"billing\"; DROP TABLE jobs;--"
CLUSTERS = ("onprem", "rented")


def on_provider(sandbox, cluster: str) -> bool:
    return cluster == sandbox.layout.rented.name and remote_site.is_provider(sandbox.layout)


def sacct_seconds(sandbox, cluster: str, period: Period) -> tuple[int, int]:
    """(CPU-seconds, GPU-seconds) of `period` as sacct itself counts them."""
    layout = sandbox.layout.cluster(cluster)
    local = [datetime.fromtimestamp(t, UTC).astimezone().replace(tzinfo=None)
             .isoformat(timespec="seconds") for t in (period.start, period.end)]
    argv = ["sacct", "-X", "--duplicates", "--allusers", "--truncate", "--parsable2",
            "--noheader", f"--starttime={local[0]}", f"--endtime={local[1]}",
            "--format=JobIDRaw,ElapsedRaw,AllocTRES"]
    if on_provider(sandbox, cluster):  # the provider's own sacct, on its machine
        out = remote_site.admin_output(sandbox.layout, argv)
    else:
        out = subprocess.run(argv, env={**os.environ, "SLURM_CONF": str(layout.slurm_conf)},
                             capture_output=True, text=True, check=True, timeout=30).stdout
    cpu = gpu = 0
    for line in out.splitlines():
        _, elapsed, alloc = line.split("|")
        tres = tres_text(alloc)
        cpu += int(elapsed) * tres.get("cpu", 0)
        gpu += int(elapsed) * tres.get("gres/gpu", 0)
    return cpu, gpu


@pytest.fixture(scope="module")
def workload(site, sandbox):
    """On each cluster: a short job with a cost center and a hostile name, and a job
    requeued once (onprem: `scontrol requeue`; rented: its provider's admin does it, as on
    preemption). Returns (period covering them, {cluster: (short id, requeued id)}).
    Shared by the module's tests (each ingests into a database of its own): the jobs
    take ~25 s of Slurm's time to run, requeue and settle."""
    from tests.kit.sandbox import cluster_dir, user_dir

    home_dir = user_dir(sandbox, ALICE, "billing-workload")
    rented_admin = CliSlurmClient("rented", sandbox.layout.cluster("rented").slurm_conf,
                                  timeout_s=10)
    began = int(time.time()) - 1
    clients = {name: connect(site.cluster(name)) for name in CLUSTERS}
    jobs = {}
    for name, client in clients.items():
        shared_dir = cluster_dir(sandbox, name, home_dir, "billing-workload")
        short = client.submit(JobSpec(
            script="#!/bin/bash\nsleep 2\n", name=HOSTILE_NAME, working_dir=shared_dir,
            environment={"SLURM_GEO_COST_CENTER": "ml-research",
                         "PATH": "/usr/local/bin:/usr/bin:/bin"}, time_limit_minutes=5,
            owner=ALICE.owner))
        requeued = client.submit(JobSpec(script="#!/bin/bash\nsleep 300\n",
                                         working_dir=shared_dir, time_limit_minutes=10,
                                         requeue=True, owner=ALICE.owner))
        jobs[name] = (short, requeued)
    for name, client in clients.items():
        requeued = jobs[name][1]
        eventually(lambda c=client, j=requeued: c.job(j), lambda j: j.state is JobState.RUNNING)
        time.sleep(2)
        # 26.05 requeues over REST (v0.0.45); 22.05's slurmrestd cannot: its admin does
        admin = rented_admin if name == "rented" and not on_provider(sandbox, name) \
            else client
        admin.requeue(requeued)
    for name, client in clients.items():
        requeued = jobs[name][1]
        eventually(lambda c=client, j=requeued: c.job(j),
                   lambda j: j.restart_count == 1 and j.state is JobState.RUNNING, 90)
        time.sleep(1)
        client.cancel(requeued)
    for name, client in clients.items():
        for job_id, count in zip(jobs[name], (1, 2), strict=True):
            eventually(lambda c=client, j=job_id: c.accounting([j]),
                       lambda rs, n=count: len(rs) == n and all(
                           r.settled and r.end_time for r in rs), 60)
    ended = int(time.time()) + 1
    time.sleep(2)  # the window lies wholly in the past when it is ingested
    yield Period("test", began, ended), jobs
    for name, client in clients.items():
        for job_id in jobs[name]:
            try:
                client.cancel(job_id)
            except Exception:  # noqa: BLE001 - already gone is fine
                pass


def ingest(site, db, period):
    config = billing_config(site)
    clients = [connect(site.cluster(name)) for name in CLUSTERS]
    return service.run_ingest(db, config, clients, int(time.time()), since=period.start,
                              until=period.end)


@pytest.mark.slow
def test_cpu_and_gpu_seconds_equal_sacct_and_reingest_changes_nothing(
        site, sandbox, workload, tmp_path):
    period, jobs = workload
    with BillingDB(tmp_path / "billing.db") as db:
        def compare():
            result = ingest(site, db, period)
            assert not result.failures
            report = service.report(db, period, "cluster")
            ours = {c: (report.clusters[c].cpu_seconds, report.clusters[c].gpu_seconds)
                    if c in report.clusters else (0, 0) for c in CLUSTERS}
            return ours, {c: sacct_seconds(sandbox, c, period) for c in CLUSTERS}

        # Other engineers' jobs share the sandbox; accounting of a job that just ended may
        # lag by a moment, so the comparison is repeated until slurmdbd has settled.
        ours, theirs = eventually(compare, lambda pair: pair[0] == pair[1], 30, 1)
        assert ours == theirs
        assert all(ours[c][0] > 0 for c in CLUSTERS)

        before = db.dump()
        ingest(site, db, period)
        assert db.dump() == before

        for cluster, (short, requeued) in jobs.items():
            rows = db.conn.execute("SELECT * FROM jobs WHERE cluster = ? AND job_id = ? "
                                   "ORDER BY submit_ts", [cluster, requeued]).fetchall()
            assert [r["restarts"] for r in rows] == [0, 1]
            assert rows[0]["state"] == "REQUEUED" and rows[0]["elapsed_s"] >= 1
            [row] = db.conn.execute("SELECT * FROM jobs WHERE cluster = ? AND job_id = ?",
                                    [cluster, short]).fetchall()
            # Stored exactly as Slurm's accounting reports it. (slurmdbd itself stores a
            # double quote in a job name as a backtick; that is Slurm's, not ours.)
            [record] = connect(site.cluster(cluster)).accounting([short])
            assert row["name"] == record.name
            assert row["name"].replace("`", '"') == HOSTILE_NAME
            # The host's Slurm tags it (our job_submit.lua); a stock provider's does not,
            # and a job submitted there directly is billed to its account there (a moved
            # job is billed to its logical job's cost center).
            assert (row["cost_center"], row["cost_center_source"]) == (
                ("tenants", "account") if on_provider(sandbox, cluster)
                else ("ml-research", "directive"))
            assert row["cpus"] == 1 and row["elapsed_s"] >= 2


@pytest.mark.slow
def test_cli_ingest_and_report_on_the_sandbox(site, sandbox, workload, tmp_path):
    period, jobs = workload
    env = {**os.environ, "SLURM_GEO_CONFIG": str(sandbox.layout.site_config)}
    db = tmp_path / "cli.db"
    window = [datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S")
              for t in (period.start, period.end)]
    ingest_run = subprocess.run(
        ["python3", "-m", "slurm_geo", "billing", "ingest", "--db", str(db), "--since",
         window[0], "--until", window[1], "--json"], env=env, capture_output=True, text=True,
        timeout=120)
    assert ingest_run.returncode == 0, ingest_run.stderr
    report_run = subprocess.run(
        ["python3", "-m", "slurm_geo", "billing", "report", "--db", str(db), "--period",
         "..".join(window), "--by", "job", "--format", "csv"], env=env, capture_output=True,
        text=True, timeout=60)
    assert report_run.returncode == 0, report_run.stderr
    keys = {line.split(",")[0] for line in report_run.stdout.splitlines()[1:]}
    for cluster, ids in jobs.items():
        assert {f"{cluster}:{job_id}" for job_id in ids} <= keys


def test_cli_parsable_and_json_accounting_agree(site, sandbox):
    """The onprem CLI backend's `sacct --parsable2` reader (what billing ingests) returns
    what its `sacct --json` reader does, field for field (the exit code of a job cancelled
    before it ran aside: JSON leaves it unset, sacct prints 0:0; and who cancelled it,
    which sacct names by uid, "CANCELLED by 0", and slurmdbd's JSON by user name, none
    for root's on 22.05: federation.cancels reads either, billing neither)."""
    from dataclasses import replace
    from datetime import timedelta

    client = connect(site.cluster("onprem"))
    end = datetime.now(UTC)
    start = end - timedelta(hours=6)

    def key(record):
        return (record.job_id, record.submit_time)

    def comparable(records):
        return sorted((replace(r, exit_code=None, cancelled_by="") for r in records), key=key)

    from_json = client.accounting(start=start, end=end)
    from_rows = list(client.accounting_rows(start, end))
    assert comparable(from_rows) == comparable(from_json)


def rented_job(client, shared_dir) -> int:
    """A short job of alice's on rented, ended and settled in its accounting."""
    job_id = client.submit(JobSpec(script="#!/bin/bash\nsleep 1\n", working_dir=shared_dir,
                                   time_limit_minutes=5, owner=ALICE.owner,
                                   environment={"SLURM_GEO_COST_CENTER": "ml-research"}))
    eventually(lambda: client.accounting([job_id]),
               lambda rs: len(rs) == 1 and rs[0].settled and rs[0].end_time, 90)
    return job_id


@pytest.mark.slow
def test_an_expired_rented_token_fails_ingest_and_a_later_ingest_bills_the_missed_job(
        site, sandbox, shared_dir, tmp_path):
    import dataclasses

    from slurm_geo.slurm import admin
    from tests.kit.sandbox import cluster_dir

    config = billing_config(site)
    good = connect(site.cluster("rented"))
    expired = tmp_path / "expired.jwt"
    expired.write_text((remote_site.issue_token(sandbox.layout, "root", 1)
                        if on_provider(sandbox, "rented") else
                        admin.issue_token(sandbox.layout.rented.slurm_conf, "root", 1)) + "\n")
    expired.chmod(0o600)
    bad = connect(dataclasses.replace(site.cluster("rented"), token_file=expired))
    with BillingDB(tmp_path / "billing.db") as db:
        assert not service.run_ingest(db, config, [good], int(time.time())).failures
        watermark = db.watermark("accounting:rented")
        job_id = rented_job(good, cluster_dir(sandbox, "rented", shared_dir, "billing-token"))
        time.sleep(2)  # the token's one second is over
        failed = service.run_ingest(db, config, [bad], int(time.time()))
        assert failed.exit_code == 52
        assert "token problem" in failed.failures["accounting:rented"]
        assert db.watermark("accounting:rented") == watermark  # read again next time
        missed = "SELECT count(*) FROM jobs WHERE cluster = 'rented' AND job_id = ?"
        assert db.conn.execute(missed, [job_id]).fetchone()[0] == 0
        later = service.run_ingest(db, config, [good], int(time.time()))
        assert not later.failures
        assert db.conn.execute(missed, [job_id]).fetchone()[0] == 1


@pytest.mark.slow
def test_billing_check_passes_after_a_clean_ingest_and_names_a_deleted_row(
        site, sandbox, workload, tmp_path):
    import dataclasses

    period, jobs = workload
    # Transfers of other tests' runs settle on their own schedule: this compares accounting.
    config = dataclasses.replace(billing_config(site), sync_state=None, federation_audit=None)
    clients = [connect(site.cluster(name)) for name in CLUSTERS]
    with BillingDB(tmp_path / "billing.db") as db:
        def clean():
            service.run_ingest(db, config, clients, int(time.time()), since=period.start,
                               until=period.end)
            return service.run_check(db, config, clients, period, int(time.time()))
        eventually(clean, lambda result: result.exit_code == 0, 60, 2)
        short = jobs["rented"][0]
        db.conn.execute("DELETE FROM jobs WHERE cluster = 'rented' AND job_id = ?", [short])
        db.conn.commit()
        found = service.run_check(db, config, clients, period, int(time.time()))
        assert found.exit_code == 53
        named = [d.message for d in found.differences if d.measure == "incarnation"]
        assert any(f"incarnation rented:{short} submitted" in m
                   and "is in Slurm's accounting, not in billing" in m for m in named), named


@pytest.mark.slow
def test_a_job_requeued_four_times_has_all_five_incarnations_billed(site, sandbox, shared_dir,
                                                                     tmp_path):
    """Each incarnation as sacct --duplicates counts it, CPU-seconds equal."""
    began = int(time.time()) - 1
    client = connect(site.cluster("onprem"))
    job_id = client.submit(JobSpec(script="#!/bin/bash\nsleep 300\n", working_dir=shared_dir,
                                   time_limit_minutes=10, requeue=True, owner=ALICE.owner))
    try:
        for restart in range(4):
            eventually(lambda: client.job(job_id), lambda j, r=restart: j.restart_count == r
                       and j.state is JobState.RUNNING, 120, 1)
            time.sleep(2)
            client.requeue(job_id)
        eventually(lambda: client.job(job_id), lambda j: j.restart_count == 4
                   and j.state is JobState.RUNNING, 120, 1)
        time.sleep(2)
    finally:
        client.cancel(job_id)
    eventually(lambda: client.accounting([job_id]),
               lambda rs: len(rs) == 5 and all(r.settled and r.end_time for r in rs), 60)
    ended = int(time.time()) + 1
    time.sleep(2)
    period = Period("test", began, ended)
    with BillingDB(tmp_path / "billing.db") as db:
        service.run_ingest(db, billing_config(site), [client], int(time.time()),
                           since=period.start, until=period.end)
        rows = db.conn.execute("SELECT restarts, elapsed_s, cpus FROM jobs WHERE cluster = "
                               "'onprem' AND job_id = ? ORDER BY submit_ts", [job_id]).fetchall()
        assert len(rows) == 5, [tuple(r) for r in rows]
        billed = sum(r["elapsed_s"] * r["cpus"] for r in rows)
        accounted = sum(r.elapsed_s * r.allocated_tres.get("cpu", 0)
                        for r in client.accounting([job_id]))
        assert billed == accounted > 0
