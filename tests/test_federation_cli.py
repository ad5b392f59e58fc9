"""`slurm-geo status`, `plan` and `approve` as a user meets them: one line and an exit
code for each mistake, never a traceback."""

from __future__ import annotations

import json
import time

from slurm_geo.federation.model import JobStatus, LogicalJob
from slurm_geo.federation.state.sqlite import FederationState
from tests.kit.cli import on_call_site, slurm_geo
from tests.kit.site import write_site


def test_status_lists_logical_jobs_and_shows_one(tmp_path):
    config = write_site(tmp_path)
    now = time.time()
    state = FederationState(tmp_path / "fed.db")
    state.add_job(LogicalJob(logical_job="onprem-7", run="run-x", home="onprem",
                             script="#!/bin/bash\n", spec={}, directives={}, generation=0,
                             cluster="onprem", job_id=7, resume_step=None, status=JobStatus.RUNNING,
                             created_at=now, updated_at=now))
    state.close()
    listing = slurm_geo("status", config=config)
    assert listing.returncode == 0, listing.stderr
    assert "onprem-7" in listing.stdout and "onprem:7" in listing.stdout
    one = slurm_geo("status", "onprem-7", "--json", config=config)
    assert one.returncode == 0, one.stderr
    assert '"run": "run-x"' in one.stdout and '"generation": 0' in one.stdout


def test_an_unknown_job_is_one_line_and_exit_12(tmp_path):
    config = write_site(tmp_path)
    result = slurm_geo("status", "onprem-404", config=config)
    assert result.returncode == 12  # JOB_NOT_FOUND
    assert result.stderr.strip().splitlines() == [
        "slurm-geo: error: no logical job 'onprem-404' in the federation state; "
        "`slurm-geo status` without an argument lists them"]


def test_a_config_without_federation_says_what_to_add(tmp_path):
    config = write_site(tmp_path, federation=None)
    result = slurm_geo("status", config=config)
    assert result.returncode == 3
    assert "has no [federation] table" in result.stderr
    assert "Traceback" not in result.stderr


# --- what on-call sees, cancel, resubmit, logs ----------------------------------------------


def test_status_shows_what_on_call_needs(tmp_path):
    config, job_fields = on_call_site(tmp_path)
    listing = slurm_geo("status", config=config)
    assert listing.returncode == 0, listing.stderr
    header, *rows = listing.stdout.splitlines()
    assert header.split() == ["LOGICAL", "JOB", "RUN", "STATUS", "GEN", "RECOVERIES",
                              "RESUMED", "AT", "WHERE", "REASON"]
    by_job = {row.split()[0]: row.split() for row in rows}
    assert by_job["onprem-7"][:6] == ["onprem-7", "run-7", "running", "1", "1", "40"]
    assert by_job["onprem-7"][6] == "rented:3"
    assert by_job["onprem-8"][2] == "awaiting-approval"
    assert by_job["onprem-3"][2] == "cluster-out"
    assert by_job["onprem-9"][2] == "completed"
    one = slurm_geo("status", "rented:3", "--json", config=config)
    assert one.returncode == 0, one.stderr
    view = json.loads(one.stdout)
    assert job_fields - {"spec"} <= set(view) and "options" in view
    assert (view["logical_job"], view["shown"], view["recoveries"], view["resume_step"],
            view["where"]) == ("onprem-7", {"state": "running", "reason": ""}, 1, 40,
                               "rented:3")
    assert [i["cluster"] for i in view["incarnations"]] == ["onprem", "rented"]
    by_run = slurm_geo("status", "run-8", config=config)
    assert "awaiting-approval (move to rented" in by_run.stdout.splitlines()[0]


def test_every_job_command_refuses_a_bad_reference_in_one_line(tmp_path):
    config, _ = on_call_site(tmp_path)
    for command in ("status", "cancel", "resubmit", "logs", "plan"):
        unknown = slurm_geo(command, "onprem-404", config=config)
        assert (unknown.returncode, len(unknown.stderr.splitlines())) == (12, 1), command
        assert "no logical job 'onprem-404'" in unknown.stderr
        ambiguous = slurm_geo(command, "3", config=config)
        assert (ambiguous.returncode, ambiguous.stderr.strip()) == (2, (
            "slurm-geo: error: '3' names more than one logical job: onprem:3 (onprem-3), "
            "rented:3 (onprem-7); name one by its logical job id or as CLUSTER:JOBID")), command


def test_cancel_and_resubmit_refuse_the_wrong_status_in_one_line(tmp_path):
    config, _ = on_call_site(tmp_path)
    done = slurm_geo("cancel", "onprem-9", config=config)
    assert (done.returncode, done.stderr.strip()) == (44, (
        "slurm-geo: error: logical job onprem-9 is completed; there is nothing to cancel"))
    running = slurm_geo("resubmit", "onprem-7", "--json", config=config)
    assert (running.returncode, running.stderr.strip()) == (44, (
        "slurm-geo: error: logical job onprem-7 is running; only a failed job can be "
        "resubmitted"))


def test_logs_prints_each_incarnation_under_its_header(tmp_path):
    config, _ = on_call_site(tmp_path)
    (tmp_path / "out-7.txt").write_text("step 10\n")
    result = slurm_geo("logs", "onprem-7", config=config)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"==> onprem:7 generation 0: {tmp_path}/out-7.txt <==", "step 10",
        f"==> rented:3 generation 1: {tmp_path}/out-3.txt <==",
        f"(cannot be read here yet: {tmp_path}/out-3.txt is not written yet, or on "
        "rented's filesystem)"]
