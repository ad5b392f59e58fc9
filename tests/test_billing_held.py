"""Billing of a job held at its restart cap, against the real sandbox (issue 29).

A geo job that requeues itself (`scontrol requeue`) is held by EpilogSlurmctld once it was
queued again more than [policy] max_restarts (2 in the sandbox) times. slurmctld clears the
eligible time of the last requeued incarnation's record as it holds the job, and a plain
sacct window never returns that record: billing held two of its three incarnations while
`sacct -D` showed three. Here: billed CPU-seconds equal `sacct -D`'s, `billing check`
agrees, then fails naming the incarnation whose row was deleted, and `--strict` fails on
what was billed but could not be compared yet.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import time
from datetime import UTC, datetime

import pytest
from helpers import eventually, sbatch_as

from slurm_geo.billing import service
from slurm_geo.billing.config import billing_config
from slurm_geo.billing.db import BillingDB
from slurm_geo.billing.periods import Period
from slurm_geo.exitcodes import ExitCode
from slurm_geo.sandbox.users import ALICE
from slurm_geo.slurm import CliSlurmClient, JobState
from slurm_geo.slurm.parse import tres_text
from tests.kit.sandbox import user_dir

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]


def sacct_duplicates(sandbox, job_id: int) -> list[tuple[str, int, int]]:
    """(state, elapsed seconds, CPUs) of each incarnation, as `sacct -D -j ID` shows them."""
    out = subprocess.run(
        ["sacct", "-D", "-X", "--parsable2", "--noheader", f"--jobs={job_id}",
         "--format=State,ElapsedRaw,AllocTRES"],
        env={**os.environ, "SLURM_CONF": str(sandbox.layout.onprem.slurm_conf)},
        capture_output=True, text=True, check=True, timeout=30).stdout
    found = []
    for line in out.splitlines():
        state, elapsed, alloc = line.split("|")
        found.append((state.split()[0], int(elapsed), tres_text(alloc).get("cpu", 0)))
    return found


@pytest.fixture(scope="module")
def held_job(sandbox, site):
    """A geo job of alice's that requeues itself until it is held at max_restarts: (job id,
    the period from before it was submitted to after its last incarnation ended)."""
    work = user_dir(sandbox, ALICE, "billing-held")
    script = "\n".join([
        "#!/bin/bash",
        f'#SBATCH --geo-ckpt-dir="{work / "ckpt"}"',
        "#SBATCH --geo-cost-center=ml-research",
        "#SBATCH --geo-residency=home",
        f"#SBATCH --output={work / 'held.out'}",
        'scontrol requeue "$SLURM_JOB_ID"',
        "sleep 60",
    ]) + "\n"
    began = int(time.time()) - 1
    submitted = sbatch_as(sandbox, ALICE, script)
    assert submitted.returncode == 0, submitted.stderr
    job_id = int(submitted.stdout.strip())
    client = CliSlurmClient("onprem", sandbox.layout.onprem.slurm_conf, timeout_s=10)
    limit = site.policy.max_restarts
    try:
        eventually(lambda: client.job(job_id), lambda j: j.held, 40 * (limit + 1), 1)
        eventually(lambda: sacct_duplicates(sandbox, job_id),
                   lambda rows: [r[0] for r in rows].count("REQUEUED") == limit + 1, 60, 1)
        eventually(lambda: client.accounting([job_id]), lambda rs: all(
            r.settled and r.end_time for r in rs if r.state is JobState.REQUEUED), 60, 1)
        ended = int(time.time()) + 1
        time.sleep(2)  # the window lies wholly in the past when it is ingested
        yield job_id, Period(f"{datetime.fromtimestamp(began, UTC):%Y-%m-%dT%H:%M:%S}.."
                             f"{datetime.fromtimestamp(ended, UTC):%Y-%m-%dT%H:%M:%S}",
                             began, ended)
    finally:
        client.cancel(job_id)


def accounting_only(site):
    """billing's config, comparing accounting alone (egress is other tests' business)."""
    return dataclasses.replace(billing_config(site), sync_state=None, federation_audit=None,
                               federation_etcd=None)


def onprem(site):
    from slurm_geo.slurm import connect

    return [connect(site.cluster("onprem"))]


def test_every_incarnation_of_a_held_job_is_billed_and_checked(site, sandbox, held_job,
                                                               tmp_path):
    job_id, period = held_job
    shown = sacct_duplicates(sandbox, job_id)
    requeued = [(elapsed, cpus) for state, elapsed, cpus in shown if state == "REQUEUED"]
    assert len(requeued) == site.policy.max_restarts + 1, shown
    config = accounting_only(site)
    with BillingDB(tmp_path / "billing.db") as db:
        result = service.run_ingest(db, config, onprem(site), int(time.time()),
                                    since=period.start, until=period.end)
        assert not result.failures
        rows = db.conn.execute("SELECT state, elapsed_s, cpus FROM jobs WHERE cluster = "
                               "'onprem' AND job_id = ? ORDER BY submit_ts", [job_id]).fetchall()
        assert [r["state"] for r in rows] == ["REQUEUED"] * len(requeued)
        billed = service.report(db, period, "job").groups[f"onprem:{job_id}"].cpu_seconds
        assert billed == sum(elapsed * cpus for elapsed, cpus in requeued) > 0

        clean = service.run_check(db, config, onprem(site), period, int(time.time()),
                                  strict=True)
        assert clean.exit_code == 0, [d.message for d in clean.differences]
        # the window holds only this job's incarnations and the sandbox's others: both sides
        assert clean.totals["accounting:onprem"]["billed"] == \
            clean.totals["accounting:onprem"]["accounted"]

        db.conn.execute("DELETE FROM jobs WHERE cluster = 'onprem' AND job_id = ? AND "
                        "submit_ts = (SELECT MAX(submit_ts) FROM jobs WHERE cluster = "
                        "'onprem' AND job_id = ?)", [job_id, job_id])
        db.conn.commit()
    env = {**os.environ, "SLURM_GEO_CONFIG": str(sandbox.layout.site_config)}
    cli = subprocess.run(
        ["python3", "-m", "slurm_geo", "billing", "check", "--db", str(tmp_path / "billing.db"),
         "--period", period.label, "--cluster", "onprem"],
        env=env, capture_output=True, text=True, timeout=120)
    assert cli.returncode == ExitCode.BILLING_DIFFERS, cli.stderr
    named = [line for line in cli.stderr.splitlines()
             if f"incarnation onprem:{job_id} submitted" in line]
    assert len(named) == 1 and "is in Slurm's accounting, not in billing" in named[0], \
        cli.stderr


def test_strict_check_fails_on_what_was_billed_but_not_compared_yet(site, sandbox, held_job,
                                                                   tmp_path):
    """Ingested until now, the job lies in accounting's last five minutes, which the check
    cannot compare yet: named either way, a failure (54) only with --strict."""
    job_id, period = held_job
    now = int(time.time())
    config = accounting_only(site)
    with BillingDB(tmp_path / "billing.db") as db:
        assert not service.run_ingest(db, config, onprem(site), now,
                                      since=period.start).failures
    env = {**os.environ, "SLURM_GEO_CONFIG": str(sandbox.layout.site_config)}
    window = Period("x", period.start, now)
    label = f"{period.label.split('..')[0]}..{datetime.fromtimestamp(now, UTC):%Y-%m-%dT%H:%M:%S}"

    def check(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["python3", "-m", "slurm_geo", "billing", "check", "--db",
             str(tmp_path / "billing.db"), "--period", label, "--cluster", "onprem", *extra],
            env=env, capture_output=True, text=True, timeout=120)

    assert window.end - 300 < period.end  # the job ended in the window not yet settled
    lenient = check()
    assert lenient.returncode == 0, lenient.stderr
    assert "not compared yet" in lenient.stdout
    strict = check("--strict")
    assert strict.returncode == ExitCode.BILLING_UNCOMPARED, strict.stderr
    lines = [line for line in strict.stderr.splitlines() if "not compared yet" in line
             and line.startswith("slurm-geo: error: accounting:onprem ")]
    assert len(lines) == 1, strict.stderr
    assert "run `slurm-geo billing ingest` after" in lines[0]
