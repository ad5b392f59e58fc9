"""Accounting that cannot be read completely raises, never reads as an empty window: the
REST backend against a stub slurmrestd answering with 22.05's and 24.11's bodies, the CLI
backend with a stand-in sacct. Billing moves its watermark past whatever `accounting`
returns, so a refusal returned as [] is a window of jobs never billed."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
import requests

from slurm_geo.slurm.cli_backend import CliSlurmClient
from slurm_geo.slurm.errors import (
    ControllerUnreachable,
    JobNotFound,
    SlurmdbdUnreachable,
    SlurmRejected,
    TokenRejected,
)
from slurm_geo.slurm.fake import FakeSlurm
from slurm_geo.slurm.models import JobSpec
from slurm_geo.slurm.rest_backend import accounting_problem
from tests.kit.slurm import (  # noqa: F401 - slurm_bin_fixture: the fixture slurm_bin
    EXPIRED_PING,
    NO_SLURMDBD,
    OK_PING,
    Answer,
    rest_client,
    slurm_bin_fixture,
    stand_in,
)

START = datetime(2026, 11, 2, tzinfo=UTC)
END = datetime(2026, 11, 3, tzinfo=UTC)
T0 = int(START.timestamp())
RECORD = {"job_id": 7, "name": "train", "user": "alice", "account": "ml", "partition": "gpu",
          "cluster": "rented", "nodes": "n1", "state": {"current": "COMPLETED"},
          "time": {"elapsed": 60, "start": T0 + 60, "end": T0 + 120, "submission": T0},
          "tres": {"allocated": [{"type": "cpu", "name": None, "id": 1, "count": 2}]}}
# What src/plugins/openapi/dbv0.0.38 (Slurm 22.05) answers, with HTTP 200 in each case:
# resp_error() appends to `errors`, and _dump_jobs still returns SLURM_SUCCESS.
NOTHING_FOUND = {"errors": [{"description": "Nothing found", "error_number": 9003,
                             "error": "Nothing found with query", "source": "slurmdb_jobs_get"}],
                 "jobs": []}
EXPIRED_JOBS = {"errors": [{"error_number": 1007, "error": "Protocol authentication error",
                            "source": "slurmdb_jobs_get"}], "jobs": []}
NO_QOS = {"errors": [{"description": "Nothing found", "error_number": 9003,
                      "error": "Nothing found with query", "source": "slurmdb_qos_get"}],
          "jobs": []}
BAD_QUERY = {"errors": [{"description": "Unknown Query field", "error_number": 9000,
                         "error": "Query empty or incorrect type"}], "jobs": []}


@pytest.mark.parametrize("doc, problem", [
    ({"jobs": [RECORD], "errors": []}, ""),
    ({"jobs": []}, ""),
    (NOTHING_FOUND, ""),
    ({**NOTHING_FOUND, "errors": [{"error_number": 9003}]}, ""),
    (NO_SLURMDBD, "Failed connecting to slurmdbd (Unable to connect to database)"),
    (EXPIRED_JOBS, "Protocol authentication error"),
    (NO_QOS, "Nothing found (Nothing found with query)"),
    (BAD_QUERY, "Unknown Query field (Query empty or incorrect type)"),
    ({"errors": [{"error_number": 7001}], "jobs": []}, "error 7001"),
    ({"errors": [{"error": "HTTP 200: <html>proxy</html>"}]}, "HTTP 200: <html>proxy</html>"),
    ({}, "the answer holds no job list"),
    ({"jobs": None, "errors": []}, "the answer holds no job list"),
], ids=["records", "no jobs, no errors", "22.05 nothing found", "nothing found, no source",
        "slurmdbd down or token refused", "token refused", "no QOS list", "bad query",
        "bare 7001", "not JSON", "empty body", "jobs null"])
def test_an_answer_is_a_complete_set_of_records_or_says_why_not(doc, problem):
    assert accounting_problem(doc) == problem


def window(client):
    return client.accounting(start=START, end=END)


def test_records_are_read(tmp_path):
    client, _ = rest_client(tmp_path, {("GET", "jobs"): Answer(200, {"jobs": [RECORD],
                                                                     "errors": []})})
    assert [r.job_id for r in window(client)] == [7]


def test_a_window_slurmdbd_has_no_job_in_is_empty_not_an_error(tmp_path):
    client, _ = rest_client(tmp_path, {("GET", "jobs"): Answer(200, NOTHING_FOUND)})
    assert window(client) == []


@pytest.mark.parametrize("status", [200, 500])
def test_an_expired_token_on_the_accounting_endpoint_is_a_token_problem(tmp_path, status):
    client, _ = rest_client(tmp_path, {("GET", "jobs"): Answer(status, EXPIRED_JOBS)})
    with pytest.raises(TokenRejected, match="scontrol token username=geo"):
        window(client)


@pytest.mark.parametrize("status", [200, 500])
def test_slurmdbd_refusing_the_token_is_a_token_problem_not_an_empty_window(tmp_path, status):
    """22.05 says "Failed connecting to slurmdbd" for a JWT slurmdbd refused; slurmctld,
    pinged with the same token, refuses it too."""
    client, session = rest_client(tmp_path, {("GET", "jobs"): Answer(status, NO_SLURMDBD),
                                             ("GET", "ping"): EXPIRED_PING})
    with pytest.raises(TokenRejected) as raised:
        window(client)
    assert not isinstance(raised.value, ControllerUnreachable)
    assert "slurmdbd refused the connection" in str(raised.value)
    assert raised.value.action == "accounting"
    assert [r["url"].rsplit("/", 1)[1] for r in session.requests][-2:] == ["jobs", "ping"]


@pytest.mark.parametrize("status", [200, 500])
def test_slurmdbd_down_with_slurmctld_up_is_an_accounting_outage(tmp_path, status):
    client, _ = rest_client(tmp_path, {("GET", "jobs"): Answer(status, NO_SLURMDBD),
                                       ("GET", "ping"): OK_PING})
    with pytest.raises(SlurmdbdUnreachable, match=r"accounting \(slurmdbd\) unreachable.*"
                                                  "check that slurmdbd"):
        window(client)


@pytest.mark.parametrize("doc", [NO_QOS, BAD_QUERY, {}], ids=["no QOS", "bad query", "{}"])
def test_any_other_error_in_a_200_answer_is_a_refusal(tmp_path, doc):
    client, _ = rest_client(tmp_path, {("GET", "jobs"): Answer(200, doc)})
    with pytest.raises(SlurmRejected, match="slurmrestd answered without the records"):
        window(client)


def test_an_unknown_job_is_still_job_not_found(tmp_path):
    """slurmctld forgot it, slurmdbd has nothing: "Nothing found" on /slurmdb/job/ID."""
    client, _ = rest_client(tmp_path, {("GET", "job/9"): Answer(200, NOTHING_FOUND)})
    assert client.accounting([9]) == []
    with pytest.raises(JobNotFound):
        client.job(9)


def test_an_answer_cut_off_is_an_outage(tmp_path):
    client, session = rest_client(tmp_path, {})

    def cut_off(*_args, **_kwargs):
        raise requests.exceptions.ChunkedEncodingError("Connection broken: IncompleteRead")

    session.request = cut_off  # type: ignore[method-assign]
    with pytest.raises(ControllerUnreachable, match="ChunkedEncodingError"):
        client.ping()


# --- the CLI backend: sacct talks to slurmdbd --------------------------------------------

def test_sacct_that_cannot_reach_slurmdbd_is_an_accounting_outage(slurm_bin: Path):
    stand_in(slurm_bin, "sacct", "")
    script = slurm_bin / "sacct"
    script.write_text("#!/bin/sh\necho 'sacct: error: Problem talking to the database: "
                      "Connection refused' >&2\nexit 1\n")
    client = CliSlurmClient("onprem", Path("/nonexistent/slurm.conf"), 5.0)
    with pytest.raises(SlurmdbdUnreachable, match="Problem talking to the database"):
        list(client.accounting_rows(START, END))
    with pytest.raises(SlurmdbdUnreachable):
        client.accounting(start=START, end=END)


# --- the fake -------------------------------------------------------------------------------

def test_the_fake_refuses_a_token_until_a_new_one_is_accepted():
    fake = FakeSlurm("rented", clock=lambda: T0)
    fake.submit(JobSpec(script="#!/bin/bash\n"))
    fake.refuse_token()
    with pytest.raises(TokenRejected, match="Protocol authentication error"):
        fake.accounting(start=START, end=END)
    fake.accept_token()
    assert len(fake.accounting(start=START, end=END)) == 1
