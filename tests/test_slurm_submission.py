"""How each backend submits a job as its owner, with nothing of the caller's environment,
and how slurmrestd's token refusals are told from outages: without Slurm. The CLI backend
runs stand-in `sbatch` and `sacct` executables that record what they were given; the REST
backend talks to a stub HTTP session that answers with slurmrestd's JSON bodies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slurm_geo.slurm.cli_backend import CliSlurmClient
from slurm_geo.slurm.errors import (
    ControllerUnreachable,
    SlurmRejected,
    TokenRejected,
)
from slurm_geo.slurm.models import DEFAULT_JOB_PATH, JobSpec, Owner
from slurm_geo.slurm.rest_backend import token_problem
from tests.kit.slurm import (  # noqa: F401 - slurm_bin_fixture: the fixture slurm_bin
    EXPIRED_PING,
    MARKER,
    OK_PING,
    RECORDER,
    Answer,
    StubSession,
    rest_client,
    slurm_bin_fixture,
    stand_in,
    token,
)

ALICE = Owner("alice", 2001, 2100)

# --- the CLI backend ------------------------------------------------------------------------


def request_fields(stdin: str) -> list[str]:
    return stdin.split("\0")


def test_an_owned_job_goes_to_the_helper_as_data_never_with_uid(slurm_bin: Path):
    """The owner, the options, the job's environment and its script travel as one request
    on the helper's stdin; the helper itself gets a fixed environment, no argument, and
    nothing of the job's (tests/test_submit_as.py runs the real one)."""
    record = stand_in(slurm_bin, "submit-as", "42")
    client = CliSlurmClient("onprem", Path("/etc/slurm/onprem.conf"), timeout_s=10,
                            submit_as=slurm_bin / "submit-as")
    spec = JobSpec(script="#!/bin/bash\ntrue\n", owner=ALICE,
                   environment={"PATH": "/home/alice/venv/bin:/usr/bin", "SLURM_GEO_RUN": "r",
                                "LD_PRELOAD": "/home/alice/x.so"})

    assert client.submit(spec) == 42
    seen = json.loads(record.read_text())
    assert seen["argv"] == []
    assert seen["env"] == {"PATH": DEFAULT_JOB_PATH}
    fields = request_fields(seen["stdin"])
    assert fields[:5] == ["slurm-geo-submit-as/1", "alice", "2001", "2100",
                          "/etc/slurm/onprem.conf"]
    options = fields[6:6 + int(fields[5])]
    assert {"--parsable", "--export=ALL"} <= set(options)
    assert not [a for a in options if a.startswith(("--uid", "--gid"))]
    assert fields[6 + len(options)] == "3"
    environment = fields[7 + len(options):-1]
    assert environment == ["PATH=/home/alice/venv/bin:/usr/bin", "SLURM_GEO_RUN=r",
                           "LD_PRELOAD=/home/alice/x.so"]
    assert fields[-1] == spec.script


def test_a_job_without_a_path_gets_the_default_one_not_the_callers(slurm_bin: Path):
    record = stand_in(slurm_bin, "sbatch", "7;onprem")
    client = CliSlurmClient("onprem", Path("/c.conf"), timeout_s=10)

    assert client.submit(JobSpec(script="#!/bin/bash\n")) == 7
    seen = json.loads(record.read_text())
    assert seen["env"] == {"PATH": DEFAULT_JOB_PATH, "SLURM_CONF": "/c.conf"}
    assert not [a for a in seen["argv"] if a.startswith(("--uid", "--gid"))]


def test_sbatch_test_only_goes_to_the_helper_too(slurm_bin: Path):
    record = stand_in(slurm_bin, "submit-as",
                      "sbatch: Job 3 to start at 2026-12-01T10:00:00 using 1 processors")
    client = CliSlurmClient("onprem", Path("/c.conf"), timeout_s=10,
                            submit_as=slurm_bin / "submit-as")
    client.expected_start(JobSpec(script="#!/bin/bash\n", owner=ALICE))
    seen = json.loads(record.read_text())
    assert MARKER not in seen["env"] and seen["argv"] == []
    assert "--test-only" in request_fields(seen["stdin"])


def test_the_batch_environment_is_read_from_sacct(slurm_bin: Path):
    stored = "PATH=/home/alice/bin:/usr/bin\nVIRTUAL_ENV=/home/alice/venv"
    record = stand_in(slurm_bin, "sacct", stored)
    client = CliSlurmClient("onprem", Path("/c.conf"), timeout_s=10)

    assert client.batch_environment(12) == {"PATH": "/home/alice/bin:/usr/bin",
                                            "VIRTUAL_ENV": "/home/alice/venv"}
    argv = json.loads(record.read_text())["argv"]
    assert {"--env-vars", "--jobs=12"} <= set(argv)


def test_no_stored_environment_is_a_refusal_that_names_the_slurm_conf_flag(slurm_bin: Path):
    stand_in(slurm_bin, "sacct", "NONE")
    client = CliSlurmClient("onprem", Path("/c.conf"), timeout_s=10)
    with pytest.raises(SlurmRejected, match="AccountingStoreFlags=job_env"):
        client.batch_environment(12)


# --- the REST backend -----------------------------------------------------------------------


EXPIRED_SUBMIT = Answer(200, {"errors": [
    {"description": "Batch job submission failed", "error_number": 1007,
     "error": "Protocol authentication error", "source": "slurm_submit_batch_job()"}]})
EXPIRED_2411 = Answer(500, {"errors": [{"error_number": 6001,
                                        "error": "Authentication credential expired"}]})
DOWN_PING = Answer(500, {"errors": [
    {"description": "slurmctld config is unable to load", "error_number": 1800,
     "error": "Unable to contact slurm controller (connect failure)"}]})


@pytest.mark.parametrize("answer, problem", [
    (EXPIRED_PING, "slurmctld config is unable to load (Protocol authentication error)"),
    (EXPIRED_SUBMIT, "Batch job submission failed (Protocol authentication error)"),
    (EXPIRED_2411, "Authentication credential expired"),
    (Answer(401, {}), "HTTP 401 from slurmrestd"),
    (Answer(403, {"errors": []}), "HTTP 403 from slurmrestd"),
    (Answer(200, {"errors": [{"error_number": 6000}]}), "error 6000"),
    (Answer(500, {"errors": [{"error": "Invalid authentication credential"}]}),
     "Invalid authentication credential"),
    (DOWN_PING, ""),
    (OK_PING, ""),
    (Answer(500, {"errors": [{"error_number": 2017, "error": "Invalid job id specified"}]}),
     ""),
], ids=["22.05 ping", "22.05 submit", "24.11 expired", "401", "403", "bare 6000",
        "message only", "controller down", "ok", "unknown job"])
def test_token_problems_are_told_from_everything_else(answer, problem):
    assert token_problem(answer.status_code, answer.body) == problem


@pytest.mark.parametrize("answer", [EXPIRED_PING, EXPIRED_2411, Answer(401, {})],
                         ids=["22.05 error 1007 on HTTP 500", "24.11 error 6001", "401"])
def test_an_expired_token_is_a_token_problem_never_an_outage(tmp_path, answer):
    client, _ = rest_client(tmp_path, {("GET", "ping"): answer})
    with pytest.raises(TokenRejected) as raised:
        client.ping()
    assert not isinstance(raised.value, ControllerUnreachable)
    message = str(raised.value)
    assert "token problem" in message and "scontrol token username=geo" in message


def test_a_controller_that_is_gone_is_still_an_outage(tmp_path):
    client, _ = rest_client(tmp_path, {("GET", "ping"): DOWN_PING})
    with pytest.raises(ControllerUnreachable):
        client.ping()


def test_a_job_is_submitted_as_its_owners_mapped_account_with_its_token(tmp_path):
    client, session = rest_client(tmp_path, {("POST", "job/submit"): Answer(
        200, {"job_id": 77, "errors": []})})
    spec = JobSpec(script="#!/bin/bash\n", owner=ALICE, environment={"SLURM_GEO_RUN": "r"})

    assert client.submit(spec) == 77
    submit = session.requests[-1]
    assert submit["headers"] == {"X-SLURM-USER-NAME": "geo-alice",
                                 "X-SLURM-USER-TOKEN": "jwt-of-alice"}
    assert submit["json"]["job"]["environment"] == {"PATH": DEFAULT_JOB_PATH,
                                                    "SLURM_GEO_RUN": "r"}


def test_the_daemons_own_calls_go_as_rest_user(tmp_path):
    client, session = rest_client(tmp_path, {("GET", "ping"): OK_PING})
    client.ping()
    assert session.requests[-1]["headers"]["X-SLURM-USER-NAME"] == "geo"


def test_an_owner_without_an_account_there_is_refused_before_anything_is_sent(tmp_path):
    client, session = rest_client(tmp_path, {})
    with pytest.raises(SlurmRejected, match=r"\[clusters.rented.users.bob\]"):
        client.submit(JobSpec(script="#!/bin/bash\n", owner=Owner("bob", 2002, 2002)))
    assert session.requests == []


def test_an_expired_owner_token_names_that_account(tmp_path):
    client, _ = rest_client(tmp_path, {("POST", "job/submit"): EXPIRED_SUBMIT})
    with pytest.raises(TokenRejected, match="scontrol token username=geo-alice") as raised:
        client.submit(JobSpec(script="#!/bin/bash\n", owner=ALICE))
    assert raised.value.token_file == tmp_path / "alice.jwt"


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660])
def test_a_token_file_others_can_read_is_never_sent(tmp_path, mode):
    client, session = rest_client(tmp_path, {("GET", "ping"): OK_PING}, daemon_mode=mode)
    with pytest.raises(TokenRejected, match="chmod 600"):
        client.ping()
    assert session.requests == []


def test_a_missing_token_file_is_a_token_problem(tmp_path):
    client, _ = rest_client(tmp_path, {("GET", "ping"): OK_PING})
    (tmp_path / "geo.jwt").unlink()
    with pytest.raises(TokenRejected, match="cannot read it"):
        client.ping()


def test_slurmrestd_keeps_no_batch_environment(tmp_path):
    client, _ = rest_client(tmp_path, {})
    with pytest.raises(SlurmRejected, match="does not serve a job's environment"):
        client.batch_environment(12)
