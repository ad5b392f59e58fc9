"""A user's side of POST /v1/owner (federation.ownerverbs): what `slurm-geo status`,
`logs`, `cancel`, `resubmit` and `ckpt ls/verify/pull` ask the daemon when the caller
cannot read its files or keys. The request carries a MUNGE credential of the caller's
uid, as a home job's does; it goes to the replica that leads, as a job's do
(slurm_geo.lease.replicas). A refusal is raised as one line with the daemon's exit code.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from slurm_geo.config.model import SiteConfig
from slurm_geo.errors import SlurmGeoError
from slurm_geo.exitcodes import ExitCode
from slurm_geo.federation.state.open import federation_config
from slurm_geo.lease.client import _read_ca, post, tls_context
from slurm_geo.lease.munge import MungeCommands, MungeUnavailable, munge_socket
from slurm_geo.lease.protocol import OWNER_PATH, OwnerRequest
from slurm_geo.lease.replicas import Move, next_hop
from slurm_geo.lease.signing import MungeSigner

# A cancel or a resubmission asks Slurm on every cluster the job has been on.
OWNER_TIMEOUT_S = 60.0
ELECTION_WAIT_S = 20.0


class DaemonRefused(SlurmGeoError):
    """The daemon's one-line answer to a request it did not serve."""

    def __init__(self, reason: str, exit_code: int):
        super().__init__(reason)
        self.exit_code = exit_code


def reads_daemon_files(site: SiteConfig) -> bool:
    """Whether this process may read the daemon's own state (root, its account): else it
    asks the daemon. The key file decides for replicated state (etcd, sealed under it)."""
    from slurm_geo.config.paths import master_key_path

    config = federation_config(site)
    if config.replicated:
        return os.access(master_key_path(config.key_file, os.environ), os.R_OK)
    try:
        return not config.state.exists() or os.access(config.state, os.R_OK)
    except PermissionError:  # its directory is the daemon's alone
        return False


def can_read_key(key_file: Path) -> bool:
    return os.access(key_file, os.R_OK)


class OwnerClient:
    def __init__(self, site: SiteConfig):
        config = federation_config(site)
        here = site.cluster(site.home_cluster)
        self._urls = config.job_urls
        self._tls = tls_context(_read_ca(config.ca_file))
        self._signer = MungeSigner(MungeCommands(munge_socket(config.munge_socket,
                                                              here.slurm_conf)))

    def ask(self, verb: str, job: str = "", run: str = "", cluster: str = ""
            ) -> dict[str, Any]:
        """The daemon's answer; DaemonRefused (one line, its exit code) otherwise."""
        data = json.dumps(OwnerRequest(verb, job, run, cluster).to_json()).encode()
        deadline = time.monotonic() + ELECTION_WAIT_S
        asking, unanswered = 0, []
        for _hop in range(4 * len(self._urls) + 8):
            try:
                headers = self._signer.headers("POST", OWNER_PATH, data)
            except MungeUnavailable as exc:
                raise DaemonRefused(f"cannot prove who you are to the federation daemon: "
                                    f"{exc}", ExitCode.LEASE_UNREACHABLE) from None
            answer = post(self._urls[asking] + OWNER_PATH, data, headers, self._tls,
                          timeout_s=OWNER_TIMEOUT_S)
            hop = next_hop(self._urls, asking, OWNER_PATH, answer)
            if hop.move is Move.DONE:
                body = answer.body
                if answer.status == 200:
                    return body
                raise DaemonRefused(str(body.get("reason", f"HTTP {answer.status}")),
                                    _exit_code(body.get("exit_code")))
            if hop.move is Move.REFUSE:
                raise DaemonRefused(hop.reason, ExitCode.LEASE_UNREACHABLE)
            if hop.move is Move.NEXT:
                unanswered.append(f"{self._urls[asking]}: {hop.reason}")
                if len(unanswered) >= len(self._urls):
                    raise DaemonRefused("the federation daemon did not answer: "
                                        + "; ".join(unanswered), ExitCode.LEASE_UNREACHABLE)
            elif hop.move is Move.WAIT:
                if time.monotonic() + answer.retry_after_s > deadline:
                    break
                time.sleep(answer.retry_after_s)
            asking = hop.index
        raise DaemonRefused("no replica of the federation daemon leads now; try again in a "
                            "minute", ExitCode.LEASE_UNREACHABLE)


def _exit_code(value: Any) -> int:
    codes = {int(c) for c in ExitCode}
    return value if type(value) is int and value in codes else ExitCode.FAILURE


class AskedState:
    """The part of the federation state `JobOutput` (federation.output) reads, asked of
    the daemon for one job: `slurm-geo logs` of a user who cannot read the state."""

    def __init__(self, client: OwnerClient, ref: str):
        self._client, self._ref = client, ref
        self._asked: dict[str, Any] | None = None
        self.logical_job = self._ask()["job"]["logical_job"]

    def _ask(self) -> dict[str, Any]:
        self._asked = self._client.ask("logs", self._ref)
        return self._asked

    def job(self, logical_job: str):  # type: ignore[no-untyped-def]
        from slurm_geo.federation.state.etcd.records import job_from

        return job_from(self._ask()["job"])  # asked afresh: `logs -f` polls it

    def incarnations(self, logical_job: str):  # type: ignore[no-untyped-def]
        from slurm_geo.federation.state.etcd.records import incarnation_from

        asked = self._asked if self._asked is not None else self._ask()
        self._asked = None  # the next poll asks again
        return [incarnation_from(r) for r in asked["incarnations"]]
