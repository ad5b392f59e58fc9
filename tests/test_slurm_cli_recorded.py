"""The CLI backend's parsers on what Slurm 24.11's commands printed (tests/data/slurm-24.11,
recorded by tests/record_slurm_cli.py from Debian 13's Slurm: one job of alice's submitted
held through slurm-geo-submit-as, released, running, requeued, held by an operator,
cancelled; two nodes, one drained). The same parsers read 22.05's output
(tests/test_slurm_parse.py); where 24.11 prints otherwise the parsers say so."""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from slurm_geo.slurm import parse
from slurm_geo.slurm.cli_backend import PARSABLE_DELIMITER, CliSlurmClient
from slurm_geo.slurm.errors import JobNotFound, SlurmRejected
from slurm_geo.slurm.models import JobSpec, JobState, Owner

DATA = Path(__file__).parent / "data" / "slurm-24.11"
# Prints a recorded command's output and exits with its status, whatever argv follows.
REPLAY = ("import json, sys; d = json.load(open(sys.argv[1])); sys.stdout.write(d['stdout']);"
          " sys.stderr.write(d['stderr']); sys.exit(d['rc'])")


def recorded(name: str) -> dict[str, Any]:
    return dict(json.loads((DATA / f"{name}.json").read_text()))


def out(name: str) -> str:
    return str(recorded(name)["stdout"])


def doc(name: str) -> dict[str, Any]:
    return dict(json.loads(out(name)))


def replaying(name: str) -> CliSlurmClient:
    """The CLI backend, each of its commands answered by the recording `name`."""
    return CliSlurmClient("home24", Path("/etc/slurm/slurm.conf"), timeout_s=10,
                          command_prefix=[sys.executable, "-c", REPLAY, str(DATA / f"{name}.json")],
                          sbatch="/usr/bin/sbatch")


JOB_ID = parse.submitted_job_id(out("sbatch-parsable"))
SPEC = JobSpec(script="#!/bin/bash\ntrue\n", name="replayed", working_dir=Path("/home/alice"),
               owner=Owner("alice", 2001, 2001))


def test_it_was_slurm_24_11():
    assert out("version").startswith("slurm-wlm 24.11.")
    assert parse.ping_is_up_text(out("ping"))


@pytest.mark.parametrize("name, state, reason, restarts, nodes, comment", [
    ("squeue-held", JobState.PENDING, "JobHeldUser", 0, "", "c1"),
    ("squeue-running", JobState.RUNNING, "None", 0, "home24-n", "c1"),
    # 24.11 says ["PENDING", "REQUEUED"] or ["PENDING"]: a requeued job is pending again.
    ("squeue-requeued", JobState.PENDING, None, 1, "", "c1"),
    ("squeue-admin-held", JobState.PENDING, "JobHeldAdmin", 1, "", "held"),
    ("squeue-cancelled", JobState.CANCELLED, None, 1, "", "held"),
])
def test_squeue_json(name, state, reason, restarts, nodes, comment):
    [job] = [j for j in parse.jobs_from_ctld(doc(name), "home24") if j.job_id == JOB_ID]
    assert job.state is state and job.restart_count == restarts
    assert reason is None or job.reason == reason
    assert job.nodes.startswith(nodes) and (nodes or job.nodes == "")
    assert (job.user, job.uid, job.gid, job.account) == ("alice", 2001, 2001, "tenants")
    assert (job.name, job.work_dir, job.time_limit_minutes) == ("rec-24.11", "/home/alice", 10)
    assert job.submit_time is not None and job.submit_time.tzinfo is UTC
    [raw] = [j for j in doc(name)["jobs"] if j["job_id"] == JOB_ID]
    assert raw["comment"] == comment


def test_a_running_job_has_its_start_and_end():
    [job] = parse.jobs_from_ctld(doc("squeue-running"), "home24")
    assert job.start_time is not None and job.end_time is not None
    assert (job.end_time - job.start_time).total_seconds() == 600


def test_sbatch_test_only_prints_its_estimate_on_stderr():
    both = out("sbatch-test-only") + recorded("sbatch-test-only")["stderr"]
    start = parse.expected_start_from_test_only(both, UTC)
    assert start.tzinfo is UTC and start.year >= 2026


def test_batch_script_and_environment():
    assert out("batch-script") == "#!/bin/bash\necho started\nsleep 300\n"
    env = parse.batch_environment(out("sacct-env-vars"))
    assert env is not None and env["GEO_RECORDED"] == "yes"
    assert env["PATH"] == "/usr/local/bin:/usr/bin:/bin"
    # 24.11 prints nothing at all (no header, no NONE) for a job slurmdbd does not know.
    assert out("sacct-env-vars-none") == ""
    assert parse.batch_environment(out("sacct-env-vars-none")) is None


def test_sacct_json_has_one_record_per_incarnation():
    first, second = parse.accounting(doc("sacct-jobs"), "home24")
    # 24.11: state.current ["PENDING", "REQUEUED"]; sacct's text (and 22.05's JSON) REQUEUED.
    assert first.state is JobState.REQUEUED
    assert first.start_time is not None and first.end_time is not None
    assert first.elapsed_s == (first.end_time - first.start_time).total_seconds()
    # 24.11 counts the energy it never measured as -2: not a TRES the job had.
    assert first.allocated_tres == {"cpu": 1, "mem": 2000, "node": 1, "billing": 1}
    assert first.nodes.startswith("home24-n") and first.cancelled_by == ""
    # Cancelled before it started again: 24.11 prints a start of 4294967294 (NO_VAL).
    assert second.state is JobState.CANCELLED and second.start_time is None
    assert second.allocated_tres == {} and second.cancelled_by == "slurm-geo"
    assert first.submit_time is not None and second.submit_time is not None
    assert second.submit_time >= first.submit_time


@pytest.mark.parametrize("name", ["sacct-parsable", "sacct-parsable-ended"])
def test_sacct_parsable_reads_as_the_json_does(name):
    assert f"--delimiter={PARSABLE_DELIMITER}" in recorded(name)["argv"]
    rows = list(parse.parsable_accounting(out(name).splitlines(), "home24", tz=UTC,
                                          delimiter=PARSABLE_DELIMITER))
    json_records = parse.accounting(doc("sacct-jobs"), "home24")
    assert len(rows) == len(json_records) == 2
    for row, record in zip(rows, json_records, strict=True):
        assert not isinstance(row, parse.MalformedAccountingRow)
        # sacct's text names the canceller by uid, the JSON by name.
        assert row == record.__class__(**{**record.__dict__,
                                          "cancelled_by": row.cancelled_by})
    assert rows[1].cancelled_by == "3100"  # the service account, an operator


@pytest.mark.parametrize("name, drained", [("sinfo", ()), ("sinfo-drained", ("home24-n2",))])
def test_sinfo_json_groups_nodes_alike(name, drained):
    nodes = {n.name: n for n in parse.nodes(doc(name))}
    assert sorted(nodes) == ["home24-n1", "home24-n2"]
    for node in nodes.values():
        assert (node.state, node.cpus, node.partitions) == ("idle", 2, ("gpu",))
        assert (node.flags == ("DRAIN",)) is (node.name in drained)
        assert (node.reason == "recorded drain") is (node.name in drained)


def test_sinfo_json_lists_a_node_in_two_partitions_once():
    entries = doc("sinfo")["sinfo"]
    other = json.loads(json.dumps(entries[0]))
    other["partition"]["name"] = "cpu"
    nodes = parse.nodes({"sinfo": [*entries, other]})
    assert [n.partitions for n in nodes] == [("gpu", "cpu")] * len(nodes)


@pytest.mark.parametrize("name, call", [
    ("cancel-unknown", lambda c: c.cancel(999999)),  # scancel exits 0, says it on stderr
    ("requeue-unknown", lambda c: c.requeue(999999)),
])
def test_the_backend_says_an_unknown_job_is_unknown(name, call):
    with pytest.raises(JobNotFound):
        call(replaying(name))


def test_the_backend_reads_each_recorded_answer():
    assert replaying("sbatch-parsable").submit(SPEC) == JOB_ID
    assert [j.state for j in replaying("squeue-running").jobs()] == [JobState.RUNNING]
    assert len(replaying("sinfo-drained").nodes()) == 2
    assert replaying("batch-script").batch_script(JOB_ID).startswith("#!/bin/bash")
    assert replaying("sacct-env-vars").batch_environment(JOB_ID)["GEO_RECORDED"] == "yes"
    states = [r.state for r in replaying("sacct-jobs").accounting([JOB_ID])]
    assert states == [JobState.REQUEUED, JobState.CANCELLED]
    assert replaying("ping").ping() >= 0
    with pytest.raises(SlurmRejected, match="Invalid user id"):
        replaying("drain-as-operator").hold(JOB_ID)


def test_the_estimate_reads_from_sbatch_through_the_backend():
    start = replaying("sbatch-test-only").expected_start(SPEC)
    assert start is not None and start > datetime(2026, 1, 1, tzinfo=UTC)
