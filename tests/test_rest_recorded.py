"""The REST backend against slurmrestd 26.05's own replies and OpenAPI description.

tests/data/slurmrestd-26.05 holds what the real 26.05.5 slurmrestd (the provider site of
sandbox.provider, Debian sid's packages) answered per API version, v0.0.42-v0.0.45, as
{"status": HTTP status, "body": JSON}, and its /openapi/v3 (openapi-v3.json.gz). The
backend is driven through a session that serves those replies; its requests are checked
against that version's OpenAPI schema.
"""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from slurm_geo.slurm import parse, rest_backend, windows
from slurm_geo.slurm.errors import (
    ControllerUnreachable,
    JobNotFound,
    SlurmRejected,
    TokenRejected,
)
from slurm_geo.slurm.models import JobSpec, JobState, Owner
from slurm_geo.slurm.rest_backend import (
    RestLogin,
    RestSlurmClient,
    choose_api_version,
    job_properties,
)

DATA = Path(__file__).parent / "data" / "slurmrestd-26.05"
VERSIONS = ("0.0.42", "0.0.43", "0.0.44", "0.0.45")


@pytest.fixture(scope="module")
def spec() -> dict[str, Any]:
    with gzip.open(DATA / "openapi-v3.json.gz", "rt") as handle:
        doc: dict[str, Any] = json.load(handle)
    return doc


def reply(version: str, name: str) -> tuple[int, dict[str, Any]]:
    doc = json.loads((DATA / version / f"{name}.json").read_text())
    return doc["status"], doc["body"]


@dataclass
class Answer:
    status_code: int
    body: dict[str, Any]

    def json(self) -> dict[str, Any]:
        return self.body

    @property
    def text(self) -> str:
        return json.dumps(self.body)


@dataclass
class Recorded:
    """slurmrestd 26.05 serving only `version` (its paths) and the recorded `answers`
    by (method, path after the version)."""

    version: str
    answers: dict[tuple[str, str], str]
    sent: list[dict[str, Any]] = field(default_factory=list)

    def request(self, method: str, url: str, headers: dict[str, str], timeout: float,
                **kwargs: Any) -> Answer:
        self.sent.append({"method": method, "url": url, "user": headers["X-SLURM-USER-NAME"],
                          **kwargs})
        if url.endswith("/openapi/v3"):
            return Answer(200, {"paths": {f"/slurm/v{self.version}/ping/": {}}})
        path = url.split(f"/v{self.version}/", 1)[1]
        name = self.answers.get((method, path))
        if name is None:
            return Answer(404, {"errors": [{"error": f"not recorded: {method} {path}"}]})
        return Answer(*reply(self.version, name))

    def get(self, url: str, headers: dict[str, str], timeout: float, **kwargs: Any) -> Answer:
        return self.request("GET", url, headers, timeout, **kwargs)


def client(tmp_path: Path, version: str, answers: dict[tuple[str, str], str]
           ) -> tuple[RestSlurmClient, Recorded]:
    tokens = []
    for name in ("geo", "alice"):
        path = tmp_path / f"{name}.jwt"
        path.write_text("jwt\n")
        path.chmod(0o600)
        tokens.append(path)
    made = RestSlurmClient("rented", "http://provider.example", "geo", tokens[0], 5.0,
                           {"alice": RestLogin("geo-alice", tokens[1])})
    session = Recorded(version, answers)
    made._http = session  # type: ignore[assignment]
    return made, session


def submitted_id(version: str) -> int:
    return int(reply(version, "submit")[1]["job_id"])


# --- negotiation -----------------------------------------------------------------------------


def test_the_newest_version_26_05_offers_is_chosen(spec):
    offered = sorted(set(re.findall(r"/slurm/v(\d+\.\d+\.\d+)/", " ".join(spec["paths"]))))
    assert offered == list(VERSIONS)
    assert choose_api_version(spec["paths"]) == "0.0.45"


def _paths(*versions: str) -> list[str]:
    return [f"/slurm/v{v}/{endpoint}" for v in versions for endpoint in ("ping", "jobs")]


@pytest.mark.parametrize("release, offered, chosen", [
    ("22.05 (Debian 12, home)", ("0.0.36", "0.0.37", "0.0.38"), "0.0.38"),
    ("23.02", ("0.0.37", "0.0.38", "0.0.39"), "0.0.39"),
    ("24.11 (Debian 13)", ("0.0.40", "0.0.41", "0.0.42"), "0.0.42"),
    ("25.05", ("0.0.40", "0.0.41", "0.0.42", "0.0.43"), "0.0.43"),
    ("25.11", ("0.0.41", "0.0.42", "0.0.43", "0.0.44"), "0.0.44"),
    ("26.05 (the provider)", ("0.0.42", "0.0.43", "0.0.44", "0.0.45"), "0.0.45"),
    ("26.11 (newer than slurm-geo)", ("0.0.43", "0.0.44", "0.0.45", "0.0.46"), "0.0.45"),
])
def test_the_newest_version_both_sides_speak_is_chosen_for_each_release(release, offered,
                                                                         chosen):
    assert choose_api_version(_paths(*offered)) == chosen, release


def test_a_server_offering_no_version_slurm_geo_reads_is_one_clear_error():
    with pytest.raises(ValueError, match="server offers API versions"):
        choose_api_version(_paths("0.0.35", "0.0.99"))


# --- requests against each version's schema --------------------------------------------------

SPEC = JobSpec(name="train", script="#!/bin/bash\ntrue\n", working_dir=Path("/home/geo-alice"),
               nodes=1, partition="gpu", time_limit_minutes=30, requeue=True,
               signal="B:USR1@90", output="/home/geo-alice/train.out", hold=True,
               comment="geo", tasks_per_node=1, environment={"A": "1"},
               owner=Owner("alice", 2001, 2001))
SCALARS = {"string": str, "integer": int, "boolean": bool, "array": list, "object": dict}


def _resolve(spec: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


@pytest.mark.parametrize("version", VERSIONS)
def test_a_submission_names_only_fields_of_that_versions_job_description(spec, version):
    body = {"script": SPEC.script, "job": job_properties(SPEC, version)}
    request = _resolve(spec, spec["paths"][f"/slurm/v{version}/job/submit"]["post"]
                       ["requestBody"]["content"]["application/json"]["schema"])
    assert set(body) <= set(request["properties"])
    described = _resolve(spec, request["properties"]["job"])["properties"]
    for name, value in body["job"].items():
        assert name in described, f"v{version} has no job field {name!r}"
        schema = _resolve(spec, described[name])
        assert isinstance(value, SCALARS[schema.get("type", "object")]), name
        if isinstance(value, dict):
            assert set(value) <= set(schema["properties"]), name
        if schema.get("type") == "array" and "enum" in schema["items"]:
            assert set(value) <= set(schema["items"]["enum"]), name


@pytest.mark.parametrize("version", VERSIONS)
def test_what_the_backend_calls_is_in_that_versions_paths(spec, version):
    paths = {re.sub(r"\{[^}]+\}", "{}", p.rstrip("/")): set(ops)
             for p, ops in spec["paths"].items()}
    used = [("get", "ping"), ("get", "jobs"), ("get", "nodes"), ("get", "partitions"),
            ("post", "job/submit"), ("get", "job/{}"), ("post", "job/{}"),
            ("delete", "job/{}")]
    if version == "0.0.45":
        used.append(("get", "job/{}/requeue"))
    for method, path in used:
        assert method in paths.get(f"/slurm/v{version}/{path}", set()), (method, path)


# --- replies ---------------------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_a_running_job_reads_the_same_in_every_version(version):
    status, body = reply(version, "job-running")
    assert status == 200
    (job,) = parse.jobs_from_ctld(body, "rented")
    assert job.job_id == submitted_id(version)
    assert job.state is JobState.RUNNING
    assert (job.user, job.uid, job.gid) == ("geo-alice", 3101, 3101)
    assert job.time_limit_minutes == 5
    assert job.work_dir == "/home/geo-alice"
    assert job.partition == "gpu" and job.nodes == "provider-n1"
    assert job.start_time is not None and job.submit_time is not None
    assert job.start_time - job.submit_time < timedelta(minutes=5)


@pytest.mark.parametrize("version", VERSIONS)
def test_held_and_cancelled_jobs(version):
    (held,) = parse.jobs_from_ctld(reply(version, "job-held")[1], "rented")
    assert held.state is JobState.PENDING and held.reason == "JobHeldUser"
    (cancelled,) = parse.jobs_from_ctld(reply(version, "job-cancelled")[1], "rented")
    assert cancelled.state is JobState.CANCELLED


def test_a_requeued_job_is_pending_again_with_a_restart():
    (job,) = parse.jobs_from_ctld(reply("0.0.45", "job-requeued")[1], "rented")
    assert job.state is JobState.PENDING and job.restart_count == 1


@pytest.mark.parametrize("version", VERSIONS)
def test_nodes_and_ping(version):
    (node,) = parse.nodes(reply(version, "nodes")[1])
    assert (node.name, node.cpus, node.partitions) == ("provider-n1", 2, ("gpu",))
    assert parse.ping_is_up_json(reply(version, "ping")[1])
    assert not parse.ping_is_up_json(reply(version, "ping-bad-token")[1])


# --- the backend, end to end on the replies --------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_submit_read_and_cancel(tmp_path, version):
    job_id = submitted_id(version)
    rest, session = client(tmp_path, version, {
        ("POST", "job/submit"): "submit", ("GET", f"job/{job_id}"): "job-running",
        ("DELETE", f"job/{job_id}"): "cancel", ("GET", "ping"): "ping"})
    assert rest.api_version == version
    assert rest.submit(replace(SPEC, hold=False)) == job_id
    assert session.sent[-1]["user"] == "geo-alice"  # her job, as her account there
    assert session.sent[-1]["json"]["job"]["kill_warning_signal"] == "USR1"
    assert rest.job(job_id).state is JobState.RUNNING
    rest.cancel(job_id)
    assert rest.ping() >= 0


@pytest.mark.parametrize("version", VERSIONS)
def test_an_unknown_job_is_not_found_whether_read_cancelled_or_requeued(tmp_path, version):
    rest, _ = client(tmp_path, version, {
        ("GET", "job/999999"): "job-unknown", ("DELETE", "job/999999"): "cancel-unknown",
        ("GET", "job/999999/requeue"): "requeue-unknown"})
    with pytest.raises(JobNotFound):
        rest.job(999999)
    # HTTP 200 with the error only in status[]: never a silent success.
    with pytest.raises(JobNotFound):
        rest.cancel(999999)
    if version == "0.0.45":
        with pytest.raises(JobNotFound):
            rest.requeue(999999)


@pytest.mark.parametrize("version", VERSIONS)
def test_requeue_uses_26_05s_endpoint_where_offered(tmp_path, version):
    job_id = submitted_id(version)
    rest, session = client(tmp_path, version, {("GET", f"job/{job_id}/requeue"): "requeue"}
                           if version == "0.0.45" else {})
    if version == "0.0.45":
        rest.requeue(job_id)
        assert session.sent[-1]["method"] == "GET"
        assert session.sent[-1]["url"].endswith(f"/slurm/v0.0.45/job/{job_id}/requeue")
    else:
        with pytest.raises(SlurmRejected, match="v0.0.45"):
            rest.requeue(job_id)
        assert not [s for s in session.sent if "requeue" in s["url"]]


@pytest.mark.parametrize("version", VERSIONS)
def test_a_refused_token_on_ping_is_a_token_problem_never_an_outage(tmp_path, version):
    """26.05 answers the ping HTTP 200, `responding: false`, whatever the cause; v0.0.45
    says why in `status`, the others only DOWN, and the next call answers 511."""
    rest, _ = client(tmp_path, version, {("GET", "ping"): "ping-bad-token",
                                         ("GET", "partitions"): "partitions-bad-token"})
    with pytest.raises(TokenRejected) as raised:
        rest.ping()
    assert not isinstance(raised.value, ControllerUnreachable)


@pytest.mark.parametrize(("api", "query"), [
    ("0.0.38", [("state", "BF,CA,CD,DL,F,NF,OOM,PR,RQ,TO")]),
    ("0.0.39", [("state", "BF,CA,CD,DL,F,NF,OOM,PR,RQ,TO")]),
    ("0.0.40", [("state", name) for name in windows.ENDED_STATE_NAMES]),
    ("0.0.45", [("state", name) for name in windows.ENDED_STATE_NAMES]),
])
def test_the_ended_states_query_is_one_the_version_parses(api: str, query: list) -> None:
    """26.05's slurmrestd answers 500 "Unknown flag" to sacct's codes or to a list of
    names in one `state=` (seen live on the sandbox's provider remote)."""
    assert rest_backend.ended_states_query(api) == query
    assert len(windows.ENDED_STATE_NAMES) == len(windows.ENDED_STATES)
