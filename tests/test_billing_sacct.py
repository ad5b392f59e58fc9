"""The Slurm layer's additions for billing, table-driven without Slurm: the admin comment in
both JSON generations, and `sacct --parsable2` rows (GPUs, hostile names, bad rows)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from slurm_geo.slurm import parse
from slurm_geo.slurm.models import AccountingRecord, JobState, MalformedAccountingRow

T0 = 1_795_000_000


def wrapped(n):
    return {"set": True, "infinite": False, "number": n}


BASE_V38 = {
    "job_id": 7, "name": "train", "user": "alice", "account": "ml", "partition": "gpu",
    "cluster": "rented", "nodes": "n1",
    "state": {"current": "COMPLETED", "reason": "None"},
    "time": {"elapsed": 60, "start": T0 + 1, "end": T0 + 61, "submission": T0},
    "tres": {"allocated": [{"type": "cpu", "name": None, "id": 1, "count": 8},
                           {"type": "gres", "name": "gpu", "id": 1001, "count": 2},
                           {"type": "gres", "name": "gpu:a100", "id": 1002, "count": 2}]},
    "exit_code": {"status": "SUCCESS", "return_code": 0},
}
V38 = {**BASE_V38, "comment": {"administrator": "geo:cost_center=ml-research",
                               "job": "mine", "system": None}}
V41 = {**BASE_V38, "state": {"current": ["COMPLETED"], "reason": "None"},
       "time": {**BASE_V38["time"], "limit": wrapped(60)},
       "exit_code": {"status": ["SUCCESS"], "return_code": wrapped(0)},
       "comment": {"administrator": "geo:cost_center=ml-research", "job": "mine",
                   "system": ""}}
NO_ADMIN = {**BASE_V38, "comment": {"administrator": None, "job": None, "system": None}}


@pytest.mark.parametrize("raw, admin, comment", [
    (V38, "geo:cost_center=ml-research", "mine"),
    (V41, "geo:cost_center=ml-research", "mine"),
    (NO_ADMIN, "", ""),
    ({**BASE_V38, "admin_comment": "flat"}, "flat", ""),
], ids=["v0.0.38", "v0.0.41", "none", "flat"])
def test_admin_comment_from_both_shapes(raw, admin, comment):
    [record] = parse.accounting({"jobs": [raw]}, cluster="x")
    assert (record.admin_comment, record.comment) == (admin, comment)
    assert record.allocated_tres == {"cpu": 8, "gres/gpu": 2, "gres/gpu:a100": 2}


HEADER = "|".join(parse.PARSABLE_FIELDS)


def row(job_id="42", cluster="onprem", user="alice", account="ml", partition="gpu",
        state="COMPLETED", submit="2026-11-02T10:00:00", start="2026-11-02T10:00:05",
        end="2026-11-02T11:00:05", elapsed="3600",
        alloc="billing=8,cpu=8,gres/gpu=2,gres/gpu:a100=2,mem=64G,node=1", exit_code="0:0",
        nodes="gpu-n1", admin="geo:cost_center=ml-research", comment="", name="train"):
    return "|".join([job_id, cluster, user, account, partition, state, submit, start, end,
                     elapsed, alloc, exit_code, nodes, admin, comment, name])


def parsed(*lines):
    return list(parse.parsable_accounting(lines, "onprem", tz=UTC))


def test_parsable_row_reads_every_field():
    [record] = parsed(HEADER, row())
    assert record == AccountingRecord(
        cluster="onprem", job_id=42, name="train", user="alice", account="ml",
        partition="gpu", state=JobState.COMPLETED,
        submit_time=datetime(2026, 11, 2, 10, 0, 0, tzinfo=UTC),
        start_time=datetime(2026, 11, 2, 10, 0, 5, tzinfo=UTC),
        end_time=datetime(2026, 11, 2, 11, 0, 5, tzinfo=UTC), elapsed_s=3600,
        allocated_tres={"billing": 8, "cpu": 8, "gres/gpu": 2, "gres/gpu:a100": 2,
                        "mem": 65536, "node": 1},
        exit_code=0, nodes="gpu-n1", comment="", admin_comment="geo:cost_center=ml-research")


@pytest.mark.parametrize("kwargs, expected", [
    ({"name": "it's \"x\"; DROP TABLE jobs;--"}, "it's \"x\"; DROP TABLE jobs;--"),
    ({"name": "a|b|c"}, "a|b|c"),  # the last field may hold the delimiter
    ({"name": ""}, ""),
    ({"name": "Robert'); DELETE FROM jobs; --"}, "Robert'); DELETE FROM jobs; --"),
])
def test_parsable_names_are_verbatim(kwargs, expected):
    [record] = parsed(row(**kwargs))
    assert record.name == expected


@pytest.mark.parametrize("kwargs, field, value", [
    ({"state": "CANCELLED by 0"}, "state", JobState.CANCELLED),
    ({"state": "REQUEUED"}, "state", JobState.REQUEUED),
    ({"start": "Unknown", "end": "Unknown", "elapsed": "0", "alloc": ""}, "start_time", None),
    ({"end": "Unknown", "state": "RUNNING"}, "end_time", None),
    ({"exit_code": "1:0"}, "exit_code", 1),
    ({"exit_code": ""}, "exit_code", None),
    ({"alloc": "cpu=2,mem=500M,node=1"}, "allocated_tres", {"cpu": 2, "mem": 500, "node": 1}),
    ({"alloc": "cpu=2,mem=1.5G"}, "allocated_tres", {"cpu": 2, "mem": 1536}),
    ({"alloc": "cpu=4,gres/fpga=1"}, "allocated_tres", {"cpu": 4, "gres/fpga": 1}),
    ({"cluster": ""}, "cluster", "onprem"),
])
def test_parsable_field_values(kwargs, field, value):
    [record] = parsed(row(**kwargs))
    assert getattr(record, field) == value


@pytest.mark.parametrize("line, reason", [
    (row(job_id="42.batch"), "JobIDRaw '42.batch' is not a job id"),
    (row(job_id=""), "JobIDRaw '' is not a job id"),
    (row(elapsed="01:00:00"), "ElapsedRaw '01:00:00' is not a number of seconds"),
    (row(start="yesterday"), "time 'yesterday' is not YYYY-MM-DDTHH:MM:SS"),
    (row(alloc="cpu=two"), "TRES entry 'cpu=two' has no count"),
    (row(alloc="cpu"), "TRES entry 'cpu' is not NAME=COUNT"),
    ("42|onprem|alice", "3 fields, expected 16"),
])
def test_malformed_rows_come_out_flagged_not_dropped(line, reason):
    [item] = parsed(row(), line)[1:]
    assert item == MalformedAccountingRow("onprem", 2, line, reason)


def test_blank_lines_and_header_are_skipped():
    assert len(parsed("", HEADER, row(), "\n")) == 1


def test_argv_asks_for_the_fields_the_parser_reads():
    argv = parse.sacct_parsable_argv()
    assert "--duplicates" in argv and "--allocations" in argv and "--allusers" in argv
    assert f"--format={','.join(parse.PARSABLE_FIELDS)}" in argv


def test_times_without_zone_are_read_in_the_given_zone():
    from datetime import timedelta, timezone

    [record] = list(parse.parsable_accounting([row()], "onprem",
                                              tz=timezone(timedelta(hours=2))))
    assert record.submit_time == datetime(2026, 11, 2, 8, 0, 0, tzinfo=UTC)
