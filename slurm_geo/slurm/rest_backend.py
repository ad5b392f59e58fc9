"""A cluster reached only through slurmrestd over HTTP with a JWT, as across the internet."""

from __future__ import annotations

import os
import re
import stat
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import requests

from slurm_geo.slurm import parse
from slurm_geo.slurm.client import WINDOW_SLACK, SlurmClient, job_from_records, overlaps
from slurm_geo.slurm.errors import ControllerUnreachable, JobNotFound, SlurmRejected
from slurm_geo.slurm.models import AccountingRecord, JobInfo, JobSpec, JobState, NodeInfo

# OpenAPI versions whose shapes `parse` reads, newest first. 0.0.38: Slurm 22.05;
# 0.0.39: 23.02; 0.0.40+: 23.11 and later.
SUPPORTED_API_VERSIONS = ("0.0.42", "0.0.41", "0.0.40", "0.0.39", "0.0.38")
JOB_NOT_FOUND = 2017  # ESLURM_INVALID_JOB_ID
UNREACHABLE_MARKERS = ("Unable to contact slurm controller", "Socket timed out",
                       "Communication connection failure", "Connection refused")


def choose_api_version(paths: Iterable[str]) -> str:
    """The newest API version this server offers and `parse` understands."""
    offered = set(re.findall(r"/slurm/v(\d+\.\d+\.\d+)/", " ".join(paths)))
    for version in SUPPORTED_API_VERSIONS:
        if version in offered:
            return version
    raise ValueError(f"server offers API versions {sorted(offered) or 'none'}, "
                     f"slurm-geo reads {', '.join(SUPPORTED_API_VERSIONS)}")


def job_properties(spec: JobSpec, api_version: str) -> dict[str, Any]:
    """The `job` object of a submission for this API version."""
    modern = api_version >= "0.0.40"
    env = spec.environment or {"PATH": "/usr/local/bin:/usr/bin:/bin"}
    props: dict[str, Any] = {
        "name": spec.name,
        "current_working_directory": str(spec.working_dir),
        "environment": [f"{k}={v}" for k, v in env.items()] if modern else dict(env),
        "nodes": str(spec.nodes) if modern else [spec.nodes, spec.nodes],
        "cpus_per_task": spec.cpus_per_task,
    }
    if spec.partition:
        props["partition"] = spec.partition
    if spec.time_limit_minutes is not None:
        props["time_limit"] = (
            {"set": True, "infinite": False, "number": spec.time_limit_minutes}
            if modern else spec.time_limit_minutes
        )
    if spec.requeue is not None:
        props["requeue"] = spec.requeue
    if spec.signal:
        props["signal"] = spec.signal
    if spec.output:
        props["standard_output"] = spec.output
    if spec.hold:
        props["hold"] = True
    if spec.comment:
        props["comment"] = spec.comment
    return props


def estimate_start(
    now: datetime, spec: JobSpec, nodes: list[NodeInfo], jobs: list[JobInfo]
) -> datetime | None:
    """When `spec` could start, from node states and the queue (slurmrestd has no test-only).

    Now if enough nodes are idle; otherwise when enough running jobs reach their time
    limit, and never before a job already pending in the same partition is expected to.
    None when a running job has no time limit to count on.
    """
    def in_partition(partitions: Iterable[str], partition: str) -> bool:
        return not spec.partition or spec.partition in partitions or partition == spec.partition

    idle = [n for n in nodes if n.available and n.state == "idle"
            and in_partition(n.partitions, spec.partition or "")]
    pending_starts = [j.start_time for j in jobs if j.state is JobState.PENDING
                      and in_partition((), j.partition) and j.start_time]
    floor = max([now, *pending_starts])
    if len(idle) >= spec.nodes and not pending_starts:
        return now
    running = [j for j in jobs if j.state is JobState.RUNNING and in_partition((), j.partition)]
    ends = []
    for job in running:
        if job.start_time is None or job.time_limit_minutes is None:
            return None
        ends.append(job.start_time.timestamp() + job.time_limit_minutes * 60)
    needed = spec.nodes - len(idle)
    if needed <= 0:
        return floor
    if needed > len(ends):
        return None
    freed = datetime.fromtimestamp(sorted(ends)[needed - 1], UTC)
    return max(freed, floor)


class RestSlurmClient(SlurmClient):
    def __init__(self, cluster: str, url: str, user: str, token_file: Path, timeout_s: float):
        self.cluster = cluster
        self.url = url.rstrip("/")
        self.user = user
        self.token_file = token_file
        self.timeout_s = timeout_s
        self._http = requests.Session()
        self._version: str | None = None

    # --- jobs ----------------------------------------------------------------------------

    def submit(self, spec: JobSpec) -> int:
        body = {"script": spec.script, "job": job_properties(spec, self.api_version)}
        doc = self._call("POST", "slurm", "job/submit", "submit", json=body)
        job_id = parse.number(doc.get("job_id"))
        if not job_id:
            raise SlurmRejected(self.cluster, "submit", parse.error_text(doc) or "no job id")
        return job_id

    def job(self, job_id: int) -> JobInfo:
        doc = self._call("GET", "slurm", f"job/{job_id}", "job info", job_id=job_id)
        found = [j for j in parse.jobs_from_ctld(doc, self.cluster) if j.job_id == job_id]
        if found:
            return found[0]
        records = self.accounting([job_id])
        if not records:
            raise JobNotFound(self.cluster, job_id)
        return job_from_records(records)

    def jobs(self) -> list[JobInfo]:
        return parse.jobs_from_ctld(self._call("GET", "slurm", "jobs", "list jobs"), self.cluster)

    def cancel(self, job_id: int) -> None:
        self._call("DELETE", "slurm", f"job/{job_id}", "cancel", job_id=job_id)

    def requeue(self, job_id: int) -> None:
        raise SlurmRejected(
            self.cluster, "requeue",
            f"slurmrestd (API v{self.api_version}) has no requeue operation; submit jobs "
            "with requeue=True so Slurm requeues them itself, or resubmit",
        )

    def batch_script(self, job_id: int) -> str:
        raise SlurmRejected(
            self.cluster, "read the batch script",
            f"slurmrestd (API v{self.api_version}) does not return batch scripts; keep the "
            "script from the submission",
        )

    def hold(self, job_id: int) -> None:
        self._call("POST", "slurm", f"job/{job_id}", "hold", job_id=job_id, json={"hold": True})

    def release(self, job_id: int) -> None:
        self._call("POST", "slurm", f"job/{job_id}", "release", job_id=job_id,
                   json={"hold": False})

    # --- cluster -------------------------------------------------------------------------

    def ping(self) -> float:
        began = time.monotonic()
        doc = self._call("GET", "slurm", "ping", "ping")
        if not parse.ping_is_up_json(doc):
            raise ControllerUnreachable(self.cluster, "slurmrestd reports slurmctld DOWN",
                                        self.timeout_s)
        return time.monotonic() - began

    def nodes(self) -> list[NodeInfo]:
        return parse.nodes(self._call("GET", "slurm", "nodes", "list nodes"))

    def expected_start(self, spec: JobSpec) -> datetime | None:
        return estimate_start(datetime.now(UTC), spec, self.nodes(), self.jobs())

    def accounting(
        self,
        job_ids: Iterable[int] = (),
        start: datetime | None = None,
        end: datetime | None = None,
    ) -> list[AccountingRecord]:
        ids = list(job_ids)
        if ids:
            records = []
            for job_id in ids:
                doc = self._call("GET", "slurmdb", f"job/{job_id}", "accounting", job_id=job_id,
                                 missing_ok=True)
                records += parse.accounting(doc, self.cluster)
            return records
        if start is None or end is None:
            raise ValueError("accounting needs job ids or a start and an end")
        # slurmrestd 22.05 cannot parse a raw ':' in a query; urlencode escapes it.
        params = urlencode({"start_time": _server_time(start - WINDOW_SLACK),
                            "end_time": _server_time(end + WINDOW_SLACK)})
        doc = self._call("GET", "slurmdb", "jobs", "accounting", params=params)
        return [r for r in parse.accounting(doc, self.cluster) if overlaps(r, start, end)]

    # --- HTTP ----------------------------------------------------------------------------

    @property
    def api_version(self) -> str:
        if self._version is None:
            doc = self._get_json(f"{self.url}/openapi/v3", "discover API")
            try:
                self._version = choose_api_version(doc.get("paths", {}))
            except ValueError as exc:
                raise SlurmRejected(self.cluster, "discover API", str(exc)) from None
        return self._version

    def _call(self, method: str, family: str, path: str, action: str, job_id: int | None = None,
              missing_ok: bool = False, **kwargs: Any) -> dict[str, Any]:
        began = time.monotonic()
        response = self._send(method, self._url(family, path), action, **kwargs)
        doc = _decode(response)
        message = parse.error_text(doc)
        if any(marker in message for marker in UNREACHABLE_MARKERS):
            raise ControllerUnreachable(self.cluster, message, self.timeout_s)
        codes = {parse.number(e.get("error_number") or e.get("error_code"))
                 for e in parse.errors(doc)}
        if job_id is not None and (JOB_NOT_FOUND in codes or "Invalid job id" in message):
            if missing_ok:
                return {}
            raise JobNotFound(self.cluster, job_id)
        if response.status_code >= 500 and not self._controller_answers(began):
            raise ControllerUnreachable(self.cluster, f"{action} failed: {message}",
                                        self.timeout_s)
        if response.status_code >= 400:
            raise SlurmRejected(self.cluster, action,
                                message or f"HTTP {response.status_code} from slurmrestd")
        return doc

    def _controller_answers(self, began: float) -> bool:
        """After a vague server error: is it Slurm saying no, or slurmctld being gone?"""
        remaining = self.timeout_s - (time.monotonic() - began)
        if remaining <= 0.1:
            return False
        try:
            response = self._http.get(self._url("slurm", "ping"), headers=self._headers(),
                                      timeout=remaining)
        except (requests.ConnectionError, requests.Timeout):
            return False
        return parse.ping_is_up_json(_decode(response))

    def _url(self, family: str, path: str) -> str:
        prefix = "slurmdb/v" if family == "slurmdb" else "slurm/v"
        return f"{self.url}/{prefix}{self.api_version}/{path}"

    def _get_json(self, url: str, action: str) -> dict[str, Any]:
        response = self._send("GET", url, action)
        if response.status_code >= 400:
            raise SlurmRejected(self.cluster, action, f"HTTP {response.status_code} for {url}")
        return _decode(response)

    def _send(self, method: str, url: str, action: str, **kwargs: Any) -> requests.Response:
        try:
            response = self._http.request(method, url, headers=self._headers(),
                                          timeout=self.timeout_s, **kwargs)
        except (requests.ConnectionError, requests.Timeout) as exc:
            raise ControllerUnreachable(self.cluster, f"slurmrestd at {self.url}: "
                                        f"{type(exc).__name__}", self.timeout_s) from None
        if response.status_code in (401, 403):
            raise SlurmRejected(self.cluster, action,
                                f"slurmrestd refused the token in {self.token_file} "
                                f"(HTTP {response.status_code}); issue a new one with "
                                "`scontrol token` on that cluster")
        return response

    def _headers(self) -> dict[str, str]:
        return {"X-SLURM-USER-NAME": self.user,
                "X-SLURM-USER-TOKEN": read_token_file(self.cluster, self.token_file)}


def read_token_file(cluster: str, path: Path) -> str:
    """The JWT in `path`, re-read on each request (tokens rotate). Like the master key, a
    file group or others may read or write is refused: a JWT is a password for the cluster."""
    try:
        with open(path, "rb") as handle:
            mode = os.fstat(handle.fileno()).st_mode
            raw = handle.read()
    except OSError as exc:
        raise SlurmRejected(cluster, "authenticate",
                            f"cannot read token_file {path}: {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SlurmRejected(cluster, "authenticate",
                            f"token_file {path} has mode {stat.S_IMODE(mode):04o}, which "
                            f"lets others in; chmod 600 {path}")
    try:
        return raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise SlurmRejected(cluster, "authenticate",
                            f"token_file {path} does not hold a JWT (not ASCII text)") from None


def _decode(response: requests.Response) -> dict[str, Any]:
    try:
        doc = response.json()
    except ValueError:
        return {"errors": [{"error": f"HTTP {response.status_code}: {response.text[:200]}"}]}
    return doc if isinstance(doc, dict) else {}


def _server_time(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S")
