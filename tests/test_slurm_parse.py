"""Pure parsers of Slurm output, table-driven over both JSON shapes, without Slurm."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest

from slurm_geo.slurm import parse
from slurm_geo.slurm.cli_backend import sbatch_arguments
from slurm_geo.slurm.models import JobInfo, JobSpec, JobState, NodeInfo, Owner
from slurm_geo.slurm.rest_backend import choose_api_version, estimate_start, job_properties

T0 = 1_700_000_000


def wrapped(n):
    return {"set": True, "infinite": False, "number": n}


UNSET = {"set": False, "infinite": False, "number": 0}

JOB_V38 = {
    "job_id": 12, "name": "train", "job_state": "RUNNING", "state_reason": "None",
    "user_name": "alice", "account": "ml", "partition": "gpu", "nodes": "n1",
    "restart_cnt": 1, "submit_time": T0, "start_time": T0 + 100, "end_time": T0 + 3700,
    "time_limit": 60, "exit_code": 0, "cluster": "rented",
    "user_id": 2001, "group_id": 2100, "group_name": "ml",
}
JOB_V41 = {
    **JOB_V38, "job_state": ["RUNNING"], "submit_time": wrapped(T0),
    "start_time": wrapped(T0 + 100), "end_time": wrapped(T0 + 3700), "time_limit": wrapped(60),
    "restart_cnt": 1, "job_id": 12,
    "exit_code": {"status": ["SUCCESS"], "return_code": wrapped(0)},
}


@pytest.mark.parametrize("raw", [JOB_V38, JOB_V41], ids=["v0.0.38", "v0.0.41"])
def test_job_reads_the_same_from_both_shapes(raw):
    [job] = parse.jobs_from_ctld({"jobs": [raw]}, cluster="fallback")
    assert job == JobInfo(
        cluster="rented", job_id=12, name="train", state=JobState.RUNNING, reason="None",
        user="alice", account="ml", partition="gpu", nodes="n1", restart_count=1,
        submit_time=datetime.fromtimestamp(T0, UTC),
        start_time=datetime.fromtimestamp(T0 + 100, UTC),
        end_time=datetime.fromtimestamp(T0 + 3700, UTC),
        time_limit_minutes=60, exit_code=0, uid=2001, gid=2100,
    )
    assert job.owner == Owner("alice", 2001, 2100)


@pytest.mark.parametrize("fields, work_dir", [
    ({"current_working_directory": "/home/alice/w"}, "/home/alice/w"),  # both versions
    ({"current_working_directory": ""}, None), ({}, None),
])
def test_the_working_directory_comes_from_the_job_record(fields, work_dir):
    raw = {k: v for k, v in JOB_V41.items() if k != "current_working_directory"}
    [job] = parse.jobs_from_ctld({"jobs": [{**raw, **fields}]}, cluster="rented")
    assert job.work_dir == work_dir


# The owner's fields as each version prints them (src/plugins/openapi/v0.0.38/jobs.c in
# 22.05: plain ints, group_id null for NO_VAL; data_parser v0.0.42 in 24.11: UINT32, plain).
@pytest.mark.parametrize("fields, uid, gid, owner", [
    ({"user_name": "alice", "user_id": 2001, "group_id": 2001}, 2001, 2001,
     Owner("alice", 2001, 2001)),
    ({"user_name": "alice", "user_id": 2001, "group_id": None}, 2001, None, None),
    ({"user_name": "", "user_id": 2001, "group_id": 2001}, 2001, 2001, None),
    ({"user_name": "root", "user_id": 0, "group_id": 0}, 0, 0, Owner("root", 0, 0)),
    ({"user_name": "alice"}, None, None, None),  # accounting-only records carry no ids
], ids=["22.05 and 24.11", "22.05 NO_VAL group", "no name", "root", "no ids"])
def test_the_owner_comes_from_the_job_record(fields, uid, gid, owner):
    raw = {k: v for k, v in JOB_V41.items() if k not in ("user_name", "user_id", "group_id")}
    [job] = parse.jobs_from_ctld({"jobs": [{**raw, **fields}]}, cluster="rented")
    assert (job.uid, job.gid, job.owner) == (uid, gid, owner)


@pytest.mark.parametrize("value, expected", [
    (5, 5), (None, None), (wrapped(7), 7), (UNSET, None),
    ({"set": True, "infinite": True, "number": 0}, None), (True, None), ("12", None),
])
def test_number(value, expected):
    assert parse.number(value) == expected


@pytest.mark.parametrize("text, expected", [
    ("RUNNING", JobState.RUNNING), (["PENDING", "REQUEUED"], JobState.PENDING),
    ("CANCELLED by 0", JobState.CANCELLED), ("", JobState.UNKNOWN), ([], JobState.UNKNOWN),
    ("BRAND_NEW_STATE", JobState.UNKNOWN), ("node_fail", JobState.NODE_FAIL),
])
def test_job_state(text, expected):
    assert parse.job_state(text) is expected


@pytest.mark.parametrize("state, terminal", [
    (JobState.COMPLETED, True), (JobState.TIMEOUT, True), (JobState.PENDING, False),
    (JobState.REQUEUED, False), (JobState.RUNNING, False), (JobState.NODE_FAIL, True),
])
def test_terminal_states(state, terminal):
    assert state.is_terminal() is terminal


ACCT_V38 = {
    "job_id": 12, "name": "train", "user": "alice", "account": "ml", "partition": "gpu",
    "cluster": "rented", "nodes": "n1", "comment": "",
    "state": {"current": "REQUEUED", "reason": "None"},
    "time": {"elapsed": 3600, "start": T0 + 100, "end": T0 + 3700, "submission": T0},
    "tres": {"allocated": [{"type": "cpu", "name": None, "id": 1, "count": 4},
                           {"type": "energy", "name": None, "id": 3, "count": None},
                           {"type": "gres", "name": "gpu", "id": 1001, "count": 2}]},
    "exit_code": {"status": "SUCCESS", "return_code": 0},
}
ACCT_V41 = {
    **ACCT_V38, "state": {"current": ["REQUEUED"], "reason": "None"},
    "time": {**ACCT_V38["time"], "limit": wrapped(60)},
    "tres": {"allocated": [{"type": "cpu", "name": "", "id": 1, "count": 4},
                           {"type": "gres", "name": "gpu", "id": 1001, "count": 2}]},
    "exit_code": {"status": ["SUCCESS"], "return_code": wrapped(0)},
    "comment": {"administrator": "", "job": "cc=ml", "system": ""},
}


@pytest.mark.parametrize("raw", [ACCT_V38, ACCT_V41], ids=["v0.0.38", "v0.0.41"])
def test_accounting_record_from_both_shapes(raw):
    [record] = parse.accounting({"jobs": [raw]}, cluster="x")
    assert record.state is JobState.REQUEUED
    assert record.elapsed_s == 3600
    assert record.allocated_tres == {"cpu": 4, "gres/gpu": 2}
    assert record.start_time == datetime.fromtimestamp(T0 + 100, UTC)
    assert record.exit_code == 0
    assert record.cluster == "rented"


@pytest.mark.parametrize("raw, expected", [
    ({"name": "n1", "state": "idle", "state_flags": [], "cpus": 2, "partitions": ["b"]},
     NodeInfo("n1", "idle", (), "", 2, ("b",))),
    ({"name": "n1", "state": "idle", "state_flags": ["DRAIN"], "reason": "maint", "cpus": 2},
     NodeInfo("n1", "idle", ("DRAIN",), "maint", 2, ())),
    ({"name": "n2", "state": ["IDLE", "DRAIN"], "reason": "maint", "cpus": 8,
      "partitions": ["gpu"]},
     NodeInfo("n2", "idle", ("DRAIN",), "maint", 8, ("gpu",))),
    ({"name": "n3", "state": ["DOWN", "NOT_RESPONDING"], "cpus": 8},
     NodeInfo("n3", "down", ("NOT_RESPONDING",), "", 8, ())),
])
def test_nodes(raw, expected):
    assert parse.nodes({"nodes": [raw]}) == [expected]


@pytest.mark.parametrize("node, available", [
    (NodeInfo("n", "idle", (), "", 2, ()), True),
    (NodeInfo("n", "mixed", (), "", 2, ()), True),
    (NodeInfo("n", "idle", ("DRAIN",), "", 2, ()), False),
    (NodeInfo("n", "down", (), "", 2, ()), False),
])
def test_node_availability(node, available):
    assert node.available is available


@pytest.mark.parametrize("doc, up", [
    ({"pings": [{"hostname": "h", "ping": "UP", "status": 0}]}, True),
    ({"pings": [{"hostname": "h", "ping": "DOWN", "status": 0}]}, False),
    ({"pings": [{"hostname": "h", "pinged": "UP", "latency": 10}]}, True),
    ({"pings": [{"hostname": "h", "pinged": "UP", "responding": False}]}, False),
    ({"pings": []}, False),
])
def test_ping_json(doc, up):
    assert parse.ping_is_up_json(doc) is up


@pytest.mark.parametrize("text, up", [
    ("Slurmctld(primary) at vm is UP\n", True),
    ("Slurmctld(primary) at vm is DOWN\n****\n** RESTORE SLURMCTLD DAEMON TO SERVICE **", False),
    ("Slurmctld(primary) at a is UP\nSlurmctld(backup) at b is DOWN\n", False),
])
def test_ping_text(text, up):
    assert parse.ping_is_up_text(text) is up


def test_expected_start_from_test_only():
    text = ("sbatch: Job 2 to start at 2026-11-29T14:47:54 using 1 processors on nodes "
            "onprem-n1 in partition batch\n")
    tz = timezone(timedelta(hours=1))
    assert parse.expected_start_from_test_only(text, tz) == datetime(2026, 11, 29, 13, 47, 54,
                                                                      tzinfo=UTC)
    with pytest.raises(ValueError, match="no start time"):
        parse.expected_start_from_test_only("sbatch: error: Batch job submission failed")


@pytest.mark.parametrize("text, job_id", [("42\n", 42), ("42;rented\n", 42)])
def test_submitted_job_id(text, job_id):
    assert parse.submitted_job_id(text) == job_id


def test_submitted_job_id_refuses_garbage():
    with pytest.raises(ValueError):
        parse.submitted_job_id("sbatch: error: invalid partition")


@pytest.mark.parametrize("doc, expected", [
    ({"errors": [{"error": "Invalid job id specified", "error_number": 2017,
                  "description": "Unable to find JobId=77"}]},
     "Unable to find JobId=77 (Invalid job id specified)"),
    ({"errors": [{"error_code": 2042, "error": "Job is held"}]}, "Job is held"),
    ({"errors": []}, ""),
])
def test_error_text(doc, expected):
    assert parse.error_text(doc) == expected


HOSTILE = JobSpec(script="#!/bin/bash\ntrue\n", name="a 'b' \"c\"; echo x",
                  working_dir=Path("/tmp/with space"), time_limit_minutes=30, requeue=True,
                  signal="B:USR1@90", hold=True, partition="batch", comment="cc=ml")


def test_sbatch_arguments_pass_hostile_values_as_single_arguments():
    args = sbatch_arguments(HOSTILE)
    assert "--job-name=a 'b' \"c\"; echo x" in args
    assert "--chdir=/tmp/with space" in args
    assert {"--time=30", "--requeue", "--signal=B:USR1@90", "--hold", "--partition=batch",
            "--comment=cc=ml"} <= set(args)


def test_sbatch_arguments_never_name_a_uid_and_export_sbatchs_own_environment():
    owned = sbatch_arguments(replace(HOSTILE, owner=Owner("alice", 2001, 2100)))
    assert owned == sbatch_arguments(HOSTILE)  # the helper, not sbatch, makes her the owner
    assert "--export=ALL" in owned
    assert not [a for a in owned if a.startswith(("--uid", "--gid"))]


# 0.0.40 and later have no `signal` (slurmrestd 26.05 ignores it with a warning, recorded
# in tests/data/slurmrestd-26.05/*/submit-unknown-field.json): kill_warning_* instead.
KILL_WARNING = {"kill_warning_signal": "USR1", "kill_warning_flags": ["BATCH_JOB"],
                "kill_warning_delay": {"set": True, "infinite": False, "number": 90}}


@pytest.mark.parametrize("version, env, nodes, limit, signal", [
    ("0.0.38", {"PATH": "/usr/local/bin:/usr/bin:/bin"}, [1, 1], 30, {"signal": "B:USR1@90"}),
    ("0.0.39", {"PATH": "/usr/local/bin:/usr/bin:/bin"}, [1, 1], 30, {"signal": "B:USR1@90"}),
    ("0.0.40", ["PATH=/usr/local/bin:/usr/bin:/bin"], "1", wrapped(30), KILL_WARNING),
    ("0.0.42", ["PATH=/usr/local/bin:/usr/bin:/bin"], "1", wrapped(30), KILL_WARNING),
    ("0.0.45", ["PATH=/usr/local/bin:/usr/bin:/bin"], "1", wrapped(30), KILL_WARNING),
])
def test_job_properties_follow_the_api_version(version, env, nodes, limit, signal):
    props = job_properties(HOSTILE, version)
    assert props["environment"] == env
    assert props["nodes"] == nodes
    assert props["time_limit"] == limit
    assert {k: v for k, v in props.items() if "signal" in k or "kill_warning" in k} == signal
    assert props["requeue"] is True and props["hold"] is True
    assert props["name"] == HOSTILE.name


@pytest.mark.parametrize("paths, expected", [
    (["/slurm/v0.0.38/ping", "/slurmdb/v0.0.38/jobs"], "0.0.38"),
    (["/slurm/v0.0.40/ping", "/slurm/v0.0.41/ping", "/slurm/v0.0.42/ping"], "0.0.42"),
    (["/slurm/v0.0.42/ping", "/slurm/v0.0.99/ping"], "0.0.42"),
    # Slurm 26.05: 0.0.42-0.0.45, the newest wins.
    (["/slurm/v0.0.42/ping", "/slurm/v0.0.43/ping", "/slurm/v0.0.44/ping",
      "/slurm/v0.0.45/ping"], "0.0.45"),
    (["/slurm/v0.0.43/ping", "/slurm/v0.0.44/ping", "/slurm/v0.0.46/ping"], "0.0.44"),
])
def test_choose_api_version(paths, expected):
    assert choose_api_version(paths) == expected


def test_choose_api_version_refuses_unknown_servers():
    with pytest.raises(ValueError, match="0.0.36"):
        choose_api_version(["/slurm/v0.0.36/ping"])


NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def node(name, state="idle"):
    return NodeInfo(name, state, (), "", 2, ("batch",))


def running(job_id, started_min_ago, limit_min):
    return JobInfo("c", job_id, "j", JobState.RUNNING, "None", "u", "a", "batch", "n", 0, None,
                   NOW - timedelta(minutes=started_min_ago), None, limit_min, None)


@pytest.mark.parametrize("nodes_, jobs, wanted, expected", [
    ([node("n1"), node("n2", "allocated")], [running(1, 5, 60)], 1, NOW),
    ([node("n1", "allocated"), node("n2", "allocated")],
     [running(1, 5, 60), running(2, 50, 60)], 1, NOW + timedelta(minutes=10)),
    ([node("n1", "allocated"), node("n2", "allocated")],
     [running(1, 5, 60), running(2, 50, 60)], 2, NOW + timedelta(minutes=55)),
    ([node("n1", "allocated")], [running(1, 5, None)], 1, None),
    ([node("n1", "allocated")], [running(1, 5, 60)], 2, None),
])
def test_estimate_start(nodes_, jobs, wanted, expected):
    spec = JobSpec(script="", nodes=wanted)
    assert estimate_start(NOW, spec, nodes_, jobs) == expected


# --- sacct --env-vars -------------------------------------------------------------------------

HEADER = ("Environment used for 12 (must be batch to display)\n"
          + "-" * 80 + "\n")
ENV = "PATH=/usr/bin:/bin\nHOME=/home/alice\nPS1=a=b c\nEMPTY=\n"
FUNCTION = "BASH_FUNC_ml%%=() {  eval \"$(lmod ml \"$@\")\"\n}\n"


@pytest.mark.parametrize("text, expected", [
    # 22.05 (src/sacct/options.c _print_env): header always, "%s\n" after the stored env
    (HEADER + ENV + "\n", {"PATH": "/usr/bin:/bin", "HOME": "/home/alice", "PS1": "a=b c",
                           "EMPTY": ""}),
    # 24.11 with --noheader: the stored env as it is
    (ENV, {"PATH": "/usr/bin:/bin", "HOME": "/home/alice", "PS1": "a=b c", "EMPTY": ""}),
    (HEADER + ENV, {"PATH": "/usr/bin:/bin", "HOME": "/home/alice", "PS1": "a=b c",
                    "EMPTY": ""}),
    # an exported bash function spans lines
    (FUNCTION + "LANG=C.UTF-8\n",
     {"BASH_FUNC_ml%%": '() {  eval "$(lmod ml "$@")"\n}', "LANG": "C.UTF-8"}),
    ("A=1\r\nB=2\n", {"A": "1\r", "B": "2"}),  # only newlines separate variables
    # slurmdbd keeps none (no AccountingStoreFlags=job_env), or has no record yet
    (HEADER + "NONE\n\n", None),
    ("NONE\n", None),
    ("", None),
    (HEADER, None),
], ids=["22.05", "24.11 --noheader", "24.11 header", "bash function", "carriage return",
        "22.05 none", "24.11 none", "no record", "header only"])
def test_batch_environment(text, expected):
    assert parse.batch_environment(text) == expected


@pytest.mark.parametrize("api_version, nodes", [("0.0.38", [1, 2]), ("0.0.40", "1-2")])
def test_a_job_that_reshards_asks_for_a_node_range_and_its_tasks_per_node(api_version, nodes):
    spec = JobSpec(script="#!/bin/bash\n", nodes=1, max_nodes=2, tasks_per_node=2)
    assert {"--nodes=1-2", "--ntasks-per-node=2"} <= set(sbatch_arguments(spec))
    props = job_properties(spec, api_version)
    assert (props["nodes"], props["tasks_per_node"]) == (nodes, 2)
    assert "tasks_per_node" not in job_properties(JobSpec(script="#!/bin/bash\n"), api_version)
