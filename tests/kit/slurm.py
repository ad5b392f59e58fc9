"""Slurm stood in for a test: stand-in commands first on PATH (the fixture `slurm_bin`,
imported as `slurm_bin_fixture`) and slurmrestd's answers to a RestSlurmClient."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from slurm_geo.slurm.rest_backend import RestLogin, RestSlurmClient

MARKER = "SLURM_GEO_TEST_DAEMON_ONLY"
RECORDER = """#!{python} -I
import json, sys
environ = open("/proc/self/environ", "rb").read().split(b"\\0")
env = dict(e.decode().split("=", 1) for e in environ if e)
record = {{"argv": sys.argv[1:], "env": env, "stdin": sys.stdin.read()}}
open({out!r}, "w").write(json.dumps(record))
print({answer!r})
"""


@pytest.fixture(name="slurm_bin")
def slurm_bin_fixture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory of stand-in Slurm commands, first on this process's PATH, which also
    holds a variable of the caller's own that no job may see."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv(MARKER, "the daemon's own")
    return bin_dir


def stand_in(bin_dir: Path, name: str, answer: str) -> Path:
    out = bin_dir.parent / f"{name}.json"
    path = bin_dir / name
    path.write_text(RECORDER.format(python=sys.executable, out=str(out), answer=answer))
    path.chmod(0o755)
    return out


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
class StubSession:
    """slurmrestd: `answers` by (method, path after the version); every request kept."""

    answers: dict[tuple[str, str], Answer]
    requests: list[dict[str, Any]] = field(default_factory=list)

    def request(self, method: str, url: str, headers: dict[str, str], timeout: float,
                **kwargs: Any) -> Answer:
        self.requests.append({"method": method, "url": url, "headers": headers, **kwargs})
        if url.endswith("/openapi/v3"):
            return Answer(200, {"paths": {"/slurm/v0.0.38/ping": {}}})
        path = url.split("/v0.0.38/", 1)[1]
        return self.answers.get((method, path), Answer(404, {"errors": [{"error": "no"}]}))

    def get(self, url: str, headers: dict[str, str], timeout: float, **kwargs: Any) -> Answer:
        return self.request("GET", url, headers, timeout, **kwargs)


def token(tmp_path: Path, name: str, mode: int = 0o600) -> Path:
    path = tmp_path / f"{name}.jwt"
    path.write_text(f"jwt-of-{name}\n")
    path.chmod(mode)
    return path


def rest_client(tmp_path: Path, answers: dict[tuple[str, str], Answer],
                daemon_mode: int = 0o600) -> tuple[RestSlurmClient, StubSession]:
    client = RestSlurmClient("rented", "https://r.example", "geo", token(tmp_path, "geo",
                                                                         daemon_mode), 5.0,
                             {"alice": RestLogin("geo-alice", token(tmp_path, "alice"))})
    session = StubSession(answers)
    client._http = session  # type: ignore[assignment]
    return client, session


OK_PING = Answer(200, {"pings": [{"hostname": "h", "ping": "UP", "status": 0}],
                       "errors": []})
# slurmrestd 22.05 (v0.0.38) with an expired JWT: slurmctld refuses it, and the handler
# returns resp_error(errors, 1007, ...) (src/plugins/openapi/v0.0.38/api.c).
EXPIRED_PING = Answer(500, {"pings": [], "errors": [
    {"description": "slurmctld config is unable to load", "error_number": 1007,
     "error": "Protocol authentication error", "source": "slurm_load_ctl_conf"}]})


NO_SLURMDBD = {"errors": [{"description": "Failed connecting to slurmdbd", "error_number": 7000,
                           "error": "Unable to connect to database",
                           "source": "slurmdb_jobs_get"}], "jobs": []}
