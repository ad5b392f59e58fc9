"""A cluster reached only through slurmrestd over HTTP with a JWT, as across the internet.

The daemon's own calls (ping, nodes, jobs, accounting, cancel) go as `user` with the token
in `token_file`; a job is submitted as the account its owner is mapped to (`accounts`:
home user -> RestLogin), with that account's token, so it runs as that account. A token
file with any group or other permission bit is refused before it is sent.

A refused token is a TokenRejected, never ControllerUnreachable: slurmrestd 22.05 passes
the JWT on to slurmctld, and an expired one comes back as HTTP 200 or 500 with error 1007
("Protocol authentication error"); 24.11 also has 6001 ("Authentication credential
expired"), and 401/403 where slurmrestd checks the token itself.

Accounting (/slurmdb/) is read strictly: 22.05's dbv0.0.38 puts a failed slurmdbd query
into `errors` and still answers HTTP 200 with `"jobs": []` (src/plugins/openapi/
dbv0.0.38/jobs.c, _dump_jobs). Read as records, that is an empty window, and billing would
move its watermark past jobs it never saw; so any error but "nothing found" raises.
"Failed connecting to slurmdbd" (7000) is what it says both when slurmdbd is down and when
slurmdbd refused the JWT; a ping with the same token tells the two apart.

slurmrestd speaks no TLS; a site puts it behind a reverse proxy that does, and rest_url
is https:// unless it is loopback. Its certificate is checked against `ca_file` (the
site's CA) or the system's CAs. A certificate refused, or a handshake that fails, is a
CertificateRejected naming the cluster, the URL and the fix: like a refused token, a
configuration to mend, never read as the cluster being down (requests raises SSLError as
a ConnectionError, so it is caught before the outages).
"""

from __future__ import annotations

import os
import re
import stat
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import requests

from slurm_geo.slurm import parse
from slurm_geo.slurm.client import WINDOW_SLACK, SlurmClient, job_from_records, overlaps
from slurm_geo.slurm.errors import (
    CertificateRejected,
    ControllerUnreachable,
    JobNotFound,
    SlurmdbdUnreachable,
    SlurmError,
    SlurmRejected,
    TokenRejected,
)
from slurm_geo.slurm.models import (
    DEFAULT_JOB_PATH,
    AccountingRecord,
    JobInfo,
    JobSpec,
    JobState,
    NodeInfo,
    Owner,
)
from slurm_geo.slurm.rest_tls import certificate_fix, certificate_problem, check_ca_file
from slurm_geo.slurm.windows import ENDED_STATE_NAMES, STATE_FILTER, one_per_incarnation

# OpenAPI versions whose shapes `parse` reads, newest first. 0.0.38: Slurm 22.05;
# 0.0.39: 23.02; 0.0.40+: 23.11 and later; 26.05 serves 0.0.42-0.0.45 (their replies,
# recorded from it, are tests/data/slurmrestd-26.05).
SUPPORTED_API_VERSIONS = ("0.0.45", "0.0.44", "0.0.43", "0.0.42", "0.0.41", "0.0.40",
                          "0.0.39", "0.0.38")
# GET /slurm/vX/job/{id}/requeue: new in 0.0.45 (Slurm 26.05).
REQUEUE_SINCE = "0.0.45"
# sbatch --signal=[{R|B}:]<sig>[@<seconds>]; Slurm's default warning time is 60 s.
SIGNAL_SPEC = re.compile(r"^(?:(?P<where>[RB]+):)?(?P<sig>[A-Za-z0-9]+)(?:@(?P<delay>\d+))?$")
SIGNAL_FLAGS = {"B": "BATCH_JOB", "R": "RESERVATION_JOB"}
DEFAULT_SIGNAL_DELAY_S = 60
JOB_NOT_FOUND = 2017  # ESLURM_INVALID_JOB_ID
UNREACHABLE_MARKERS = ("Unable to contact slurm controller", "Socket timed out",
                       "Communication connection failure", "Connection refused")
# slurm_errno.h: 1007 SLURM_PROTOCOL_AUTHENTICATION_ERROR (both); 6000
# ESLURM_AUTH_CRED_INVALID (both); 6001 ESLURM_AUTH_EXPIRED (24.11); 6006
# ESLURM_AUTH_INVALID (22.05); 6007 ESLURM_AUTH_UNPACK (both).
TOKEN_ERRORS = frozenset({1007, 6000, 6001, 6006, 6007})
# 26.05's slurmrestd answers a request slurmctld refused the JWT of with 511 (Network
# Authentication Required), with or without error 1007 (tests/data/slurmrestd-26.05).
TOKEN_HTTP_STATUSES = (401, 403, 511)
TOKEN_MARKERS = ("protocol authentication error", "authentication credential")  # lower case
# 7000 ESLURM_DB_CONNECTION, 7001 ESLURM_DB_CONNECTION_INVALID: slurmrestd could not open
# slurmdbd for this request.
DB_CONNECTION_ERRORS = frozenset({7000, 7001})
# 9003 ESLURM_REST_EMPTY_RESULT: 22.05 and 23.02 answer a query that matched no job with
# "Nothing found" (source slurmdb_jobs_get): an empty window, not a failure. The same code
# from the QOS, TRES or association queries that follow would drop every record: an error.
EMPTY_RESULT = 9003


@dataclass(frozen=True)
class RestLogin:
    """An account on the cluster and the file holding its JWT."""

    user: str
    token_file: Path


def token_problem(status: int, doc: dict[str, Any]) -> str:
    """Why slurmrestd's answer is a refused token ('' if it is not one). Pure."""
    if status in TOKEN_HTTP_STATUSES:
        return f"HTTP {status} from slurmrestd"
    codes = sorted(code for e in parse.errors(doc)
                   if (code := parse.number(e.get("error_number") or e.get("error_code")))
                   in TOKEN_ERRORS)
    message = parse.error_text(doc)
    if codes or any(marker in message.lower() for marker in TOKEN_MARKERS):
        return message or f"error {codes[0]}"
    return ""


def accounting_problem(doc: dict[str, Any]) -> str:
    """Why slurmrestd's answer to /slurmdb/vX/job(s) is not a complete set of records ('' if
    it is one). Pure."""
    problems = [e for e in parse.errors(doc) if not _empty_result(e)]
    if problems:
        codes = [code for e in problems
                 if (code := parse.number(e.get("error_number") or e.get("error_code")))]
        return parse.error_text({"errors": problems}) or f"error {codes[0] if codes else '?'}"
    if not isinstance(doc.get("jobs"), list):
        return "the answer holds no job list"
    return ""


def _empty_result(error: dict[str, Any]) -> bool:
    source = str(error.get("source") or "")
    code = parse.number(error.get("error_number") or error.get("error_code"))
    return code == EMPTY_RESULT and (not source or "jobs" in source)


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
    env = {"PATH": DEFAULT_JOB_PATH, **spec.environment}
    most = spec.max_nodes or spec.nodes
    modern_nodes = str(spec.nodes) if most == spec.nodes else f"{spec.nodes}-{most}"
    props: dict[str, Any] = {
        "name": spec.name,
        "current_working_directory": str(spec.working_dir),
        "environment": [f"{k}={v}" for k, v in env.items()] if modern else dict(env),
        "nodes": modern_nodes if modern else [spec.nodes, most],
        "cpus_per_task": spec.cpus_per_task,
    }
    if spec.tasks_per_node is not None:
        # slurmrestd's default of one task would shrink the job to one node.
        props["tasks_per_node"] = spec.tasks_per_node
        props["tasks"] = spec.nodes * spec.tasks_per_node
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
        # 0.0.40 and later have no `signal`: they ignore it with a warning and the job
        # would run without its warning signal.
        props.update(kill_warning(spec.signal) if modern else {"signal": spec.signal})
    if spec.output:
        props["standard_output"] = spec.output
    if spec.hold:
        props["hold"] = True
    if spec.comment:
        props["comment"] = spec.comment
    return props


def kill_warning(signal: str) -> dict[str, Any]:
    """sbatch's --signal as the job description's kill_warning_* fields (v0.0.40+). Pure."""
    found = SIGNAL_SPEC.match(signal)
    if not found:
        raise ValueError(f"signal {signal!r} is not [{{R|B}}:]<sig>[@<seconds>]")
    delay = int(found["delay"]) if found["delay"] else DEFAULT_SIGNAL_DELAY_S
    fields: dict[str, Any] = {
        "kill_warning_signal": found["sig"],
        "kill_warning_delay": {"set": True, "infinite": False, "number": delay},
    }
    flags = [SIGNAL_FLAGS[letter] for letter in found["where"] or ""]
    if flags:
        fields["kill_warning_flags"] = flags
    return fields


def ended_states_query(api_version: str) -> list[tuple[str, str]]:
    """The `state` part of a /slurmdb/jobs query for the states an incarnation ends in:
    sacct's codes in one list up to v0.0.39 (22.05, 23.02); from v0.0.40 each full name
    in a `state=` of its own, which is all the data parser takes. Pure."""
    if api_at_least(api_version, "0.0.40"):
        return [("state", name) for name in ENDED_STATE_NAMES]
    return [("state", STATE_FILTER)]


def api_at_least(version: str, since: str) -> bool:
    """Whether API `version` is `since` or newer ('0.0.45' > '0.0.9'). Pure."""
    def key(text: str) -> tuple[int, ...]:
        return tuple(int(part) for part in text.split("."))
    return key(version) >= key(since)


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
    def __init__(self, cluster: str, url: str, user: str, token_file: Path, timeout_s: float,
                 accounts: Mapping[str, RestLogin] | None = None, *,
                 ca_file: Path | None = None):
        if ca_file is not None:
            check_ca_file(cluster, ca_file)
        self.cluster = cluster
        self.url = url.rstrip("/")
        self.user = user
        self.token_file = token_file
        self.timeout_s = timeout_s
        self.accounts = dict(accounts or {})
        self.ca_file = ca_file
        # Given with each request: a Session's own `verify` loses to REQUESTS_CA_BUNDLE.
        self._verify: str | bool = str(ca_file) if ca_file is not None else True
        self._http = requests.Session()
        self._version: str | None = None

    @property
    def login(self) -> RestLogin:
        """The daemon's own account here."""
        return RestLogin(self.user, self.token_file)

    def login_for(self, owner: Owner | None) -> RestLogin:
        """The account a job of `owner` runs as here; the daemon's own for None."""
        if owner is None:
            return self.login
        try:
            return self.accounts[owner.user]
        except KeyError:
            raise SlurmRejected(self.cluster, "submit", f"no account for home user "
                                f"'{owner.user}' here: add [clusters.{self.cluster}.users."
                                f"{owner.user}] (account, token_file) to the config") from None

    # --- jobs ----------------------------------------------------------------------------

    def submit(self, spec: JobSpec) -> int:
        login = self.login_for(spec.owner)
        body = {"script": spec.script, "job": job_properties(spec, self.api_version)}
        doc = self._call("POST", "slurm", "job/submit", "submit", json=body, login=login)
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
        if api_at_least(self.api_version, REQUEUE_SINCE):
            self._call("GET", "slurm", f"job/{job_id}/requeue", "requeue", job_id=job_id)
            return
        raise SlurmRejected(
            self.cluster, "requeue",
            f"slurmrestd (API v{self.api_version}) has no requeue operation (v{REQUEUE_SINCE}, "
            "Slurm 26.05, has); submit jobs with requeue=True so Slurm requeues them itself, "
            "or resubmit",
        )

    def batch_script(self, job_id: int) -> str:
        raise SlurmRejected(
            self.cluster, "read the batch script",
            f"slurmrestd (API v{self.api_version}) does not return batch scripts; keep the "
            "script from the submission",
        )

    def batch_environment(self, job_id: int) -> dict[str, str]:
        raise SlurmRejected(
            self.cluster, "read the batch environment",
            f"slurmrestd (API v{self.api_version}) does not serve a job's environment (its "
            "job records skip it, 22.05 and 24.11 alike); read it where the job was submitted",
        )

    def hold(self, job_id: int, comment: str | None = None) -> None:
        update: dict[str, Any] = {"hold": True}
        if comment is not None:
            update["comment"] = comment
        self._call("POST", "slurm", f"job/{job_id}", "hold", job_id=job_id, json=update)

    def release(self, job_id: int) -> None:
        self._call("POST", "slurm", f"job/{job_id}", "release", job_id=job_id,
                   json={"hold": False})

    # --- cluster -------------------------------------------------------------------------

    def ping(self) -> float:
        began = time.monotonic()
        doc = self._call("GET", "slurm", "ping", "ping")
        if not parse.ping_is_up_json(doc):
            self._why_ping_down(doc)
            raise ControllerUnreachable(self.cluster, "slurmrestd reports slurmctld DOWN",
                                        self.timeout_s)
        return time.monotonic() - began

    def _why_ping_down(self, doc: dict[str, Any]) -> None:
        """Raise TokenRejected when slurmctld answered the ping "down" because it refused
        the token: 26.05's slurmrestd answers HTTP 200 with `responding: false` either way
        (v0.0.45 names it in the ping's `status`; v0.0.42-44 say only DOWN). Another call
        with the same token, which names error 1007 then, tells the two apart."""
        status = " ".join(str(p.get("status") or "") for p in doc.get("pings") or []
                          if isinstance(p, dict))
        if any(marker in status.lower() for marker in TOKEN_MARKERS):
            raise TokenRejected(self.cluster, "ping", self.user, self.token_file, status)
        if api_at_least(self.api_version, "0.0.40"):
            try:
                self._call("GET", "slurm", "partitions", "ping")
            except TokenRejected:
                raise
            except SlurmError:
                pass  # the outage the ping said

    def nodes(self) -> list[NodeInfo]:
        return parse.nodes(self._call("GET", "slurm", "nodes", "list nodes"))

    def expected_start(self, spec: JobSpec) -> datetime | None:
        return estimate_start(datetime.now(UTC), spec, self.nodes(), self.jobs())

    def accounting_of(self, job_ids: list[int]) -> list[AccountingRecord]:
        records = []
        for job_id in job_ids:
            doc = self._call("GET", "slurmdb", f"job/{job_id}", "accounting", job_id=job_id,
                             missing_ok=True)
            records += parse.accounting(doc, self.cluster)
        return records

    def accounting_between(self, start: datetime, end: datetime) -> list[AccountingRecord]:
        # slurmrestd 22.05 cannot parse a raw ':' in a query; urlencode escapes it.
        window = {"start_time": _server_time(start - WINDOW_SLACK),
                  "end_time": _server_time(end + WINDOW_SLACK)}
        found: list[AccountingRecord] = []
        # The plain window, and what ended in it (slurm_geo.slurm.windows).
        plain = list(window.items())
        for query in (plain, plain + ended_states_query(self.api_version)):
            doc = self._call("GET", "slurmdb", "jobs", "accounting", params=urlencode(query))
            found += parse.accounting(doc, self.cluster)
        return [r for r in one_per_incarnation(found) if overlaps(r, start, end)]

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
              missing_ok: bool = False, login: RestLogin | None = None,
              **kwargs: Any) -> dict[str, Any]:
        began = time.monotonic()
        login = login or self.login
        response = self._send(method, self._url(family, path), login, **kwargs)
        doc = _decode(response)
        problem = token_problem(response.status_code, doc)
        if problem:
            raise TokenRejected(self.cluster, action, login.user, login.token_file, problem)
        message = parse.error_text(doc)
        if any(marker in message for marker in UNREACHABLE_MARKERS):
            raise ControllerUnreachable(self.cluster, message, self.timeout_s)
        codes = {parse.number(e.get("error_number") or e.get("error_code"))
                 for e in parse.errors(doc)}
        if job_id is not None and (JOB_NOT_FOUND in codes or "Invalid job id" in message):
            if missing_ok:
                return {}
            raise JobNotFound(self.cluster, job_id)
        if family == "slurmdb":
            self._check_accounting(response.status_code, doc, codes, action, login)
        if response.status_code >= 500 and not self._controller_answers(began):
            raise ControllerUnreachable(self.cluster, f"{action} failed: {message}",
                                        self.timeout_s)
        if response.status_code >= 400:
            raise SlurmRejected(self.cluster, action,
                                message or f"HTTP {response.status_code} from slurmrestd")
        return doc

    def _check_accounting(self, status: int, doc: dict[str, Any], codes: set[int | None],
                          action: str, login: RestLogin) -> None:
        """Raise unless `doc` holds every record asked for (see the module docstring). An
        HTTP error without a slurmdbd connection error is left to `_call`'s own checks."""
        problem = accounting_problem(doc)
        if not problem:
            return
        if codes & DB_CONNECTION_ERRORS:
            raise self._slurmdbd_failure(problem, action, login)
        if status < 400:
            raise SlurmRejected(self.cluster, action,
                                f"slurmrestd answered without the records: {problem}")

    def _slurmdbd_failure(self, problem: str, action: str, login: RestLogin) -> SlurmError:
        """slurmrestd could not open slurmdbd: down, or it refused the token. slurmctld,
        asked with the same token, tells which."""
        try:
            self.ping()
        except TokenRejected:
            return TokenRejected(self.cluster, action, login.user, login.token_file,
                                 f"slurmdbd refused the connection ({problem}) and slurmctld "
                                 "refused the token")
        except SlurmError as exc:
            return SlurmdbdUnreachable(self.cluster, f"{problem}; slurmctld neither: {exc}",
                                       self.timeout_s)
        return SlurmdbdUnreachable(self.cluster, problem, self.timeout_s)

    def _controller_answers(self, began: float) -> bool:
        """After a vague server error: is it Slurm saying no, or slurmctld being gone?"""
        remaining = self.timeout_s - (time.monotonic() - began)
        if remaining <= 0.1:
            return False
        try:
            response = self._http.get(self._url("slurm", "ping"),
                                      headers=self._headers(self.login), timeout=remaining,
                                      verify=self._verify)
        except (requests.ConnectionError, requests.Timeout):
            return False
        return parse.ping_is_up_json(_decode(response))

    def _url(self, family: str, path: str) -> str:
        prefix = "slurmdb/v" if family == "slurmdb" else "slurm/v"
        return f"{self.url}/{prefix}{self.api_version}/{path}"

    def _get_json(self, url: str, action: str) -> dict[str, Any]:
        response = self._send("GET", url, self.login)
        if response.status_code in TOKEN_HTTP_STATUSES:
            raise TokenRejected(self.cluster, action, self.user, self.token_file,
                                f"HTTP {response.status_code} from slurmrestd")
        if response.status_code >= 400:
            raise SlurmRejected(self.cluster, action, f"HTTP {response.status_code} for {url}")
        return _decode(response)

    def _send(self, method: str, url: str, login: RestLogin,
              **kwargs: Any) -> requests.Response:
        headers = self._headers(login)
        try:
            return self._http.request(method, url, headers=headers, timeout=self.timeout_s,
                                      verify=self._verify, **kwargs)
        except requests.exceptions.SSLError as exc:  # before ConnectionError, its base
            problem = certificate_problem(exc)
            raise CertificateRejected(self.cluster, self.url, problem,
                                      certificate_fix(self.cluster, problem, self.ca_file)
                                      ) from None
        except (requests.ConnectionError, requests.Timeout,
                requests.exceptions.ChunkedEncodingError) as exc:  # the last: cut off
            raise ControllerUnreachable(self.cluster, f"slurmrestd at {self.url}: "
                                        f"{type(exc).__name__}", self.timeout_s) from None
        except requests.RequestException as exc:  # a URL or an answer requests cannot use
            raise SlurmRejected(self.cluster, f"{method} {url}",
                                f"{type(exc).__name__}: {exc}") from None

    def _headers(self, login: RestLogin) -> dict[str, str]:
        return {"X-SLURM-USER-NAME": login.user,
                "X-SLURM-USER-TOKEN": read_token(self.cluster, login)}


def read_token(cluster: str, login: RestLogin) -> str:
    """The JWT in the login's token file, re-read on each request (tokens rotate). Like
    the master key, a file group or others may read or write is refused: a JWT is a
    password for the cluster."""
    try:
        with open(login.token_file, "rb") as handle:
            mode = os.fstat(handle.fileno()).st_mode
            raw = handle.read()
    except OSError as exc:
        raise TokenRejected(cluster, "authenticate", login.user, login.token_file,
                            f"cannot read it ({exc.strerror})",
                            "make it readable by the daemon's account") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise TokenRejected(cluster, "authenticate", login.user, login.token_file,
                            f"mode {stat.S_IMODE(mode):04o} lets others in",
                            f"chmod 600 {login.token_file}")
    try:
        return raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise TokenRejected(cluster, "authenticate", login.user, login.token_file,
                            "it does not hold a JWT (not ASCII text)",
                            "write the token scontrol printed into it") from None


def _decode(response: requests.Response) -> dict[str, Any]:
    try:
        doc = response.json()
    except ValueError:
        return {"errors": [{"error": f"HTTP {response.status_code}: {response.text[:200]}"}]}
    return doc if isinstance(doc, dict) else {}


def _server_time(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S")
