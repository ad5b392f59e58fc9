"""A training job's side of the lease protocol: its lease, its run key and its store.
No torch inside: the training side (slurm_geo.torch) and any other trainer use it.

    run = FederatedRun.from_environment("my-run")
    run.acquire()                  # blocks until the daemon grants a lease (or fences us)
    repository = run.repository()  # home: master key; elsewhere: the run key, in memory
    ... each step:   if not run.may_train(): run.wait_for_lease()
    ... after each committed checkpoint: run.checkpointed(step); if run.release_requested: stop
    run.release(final_step)

On the home cluster the job finds the daemon and its store through the site config
($SLURM_GEO_CONFIG). An incarnation the daemon submitted elsewhere finds everything in
its environment (SLURM_GEO_*, see slurm_geo.lease.protocol), including a one-time
token for the run's data key: the key is fetched from the daemon (https, verified
against the CA in SLURM_GEO_FEDERATION_CA) and held in memory only.

The lease is renewed by a thread every third of its TTL; `may_train()` compares the last
successful renewal with the job's own monotonic clock, so a process that was frozen (or
cut off) knows its lease is stale the moment it runs again. See slurm_geo.federation.leases.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_geo.ckpt import Repository, load_master_key
from slurm_geo.ckpt.open_store import open_store
from slurm_geo.ckpt.runkey import RunKeyRepository
from slurm_geo.errors import ConfigError, SlurmGeoError
from slurm_geo.lease import protocol
from slurm_geo.lease.protocol import TRAINER_SHARE

log = logging.getLogger(__name__)

EXIT_FENCED = 33  # this incarnation is stale: another one owns the run; nothing was saved
REQUEST_TIMEOUT_S = 5.0


class Fenced(SlurmGeoError):
    exit_code = EXIT_FENCED


class FederationUnreachable(SlurmGeoError):
    exit_code = 34


@dataclass(frozen=True)
class Placement:
    """Where this incarnation is and what it starts from."""

    run: str
    cluster: str
    job_id: int
    restart: int
    generation: int
    resume_step: int | None
    federation_url: str
    store_url: str
    store_endpoint: str
    key_token: str  # empty on the home cluster: the master key is read from key_file
    key_file: Path | None
    federation_ca: str = ""  # PEM of the CA the daemon's https is verified against; "": system


class FederatedRun:
    def __init__(self, placement: Placement, *, clock: Any = time.monotonic):
        self.placement = placement
        self._clock = clock
        self._lock = threading.Lock()
        self._last_ok: float | None = None
        self._ttl_s = 0.0
        self._last_step: int | None = None
        self.fenced_reason: str | None = None
        self.release_requested = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._tls = tls_context(placement.federation_ca)

    @classmethod
    def from_environment(cls, run: str, env: Mapping[str, str] = os.environ
                         ) -> FederatedRun:
        cluster = env.get("SLURM_CLUSTER_NAME", "")
        job_id = int(env.get("SLURM_JOB_ID", "0"))
        restart = int(env.get("SLURM_RESTART_COUNT") or env.get("SLURM_JOB_RESTART_COUNT")
                      or 0)
        if env.get(protocol.ENV_GENERATION):
            resume = env.get(protocol.ENV_RESUME_STEP, "")
            return cls(Placement(
                run=env.get(protocol.ENV_RUN) or run, cluster=cluster, job_id=job_id,
                restart=restart, generation=int(env[protocol.ENV_GENERATION]),
                resume_step=int(resume) if resume else None,
                federation_url=env[protocol.ENV_FEDERATION_URL],
                store_url=env[protocol.ENV_STORE],
                store_endpoint=env.get(protocol.ENV_STORE_ENDPOINT, ""),
                key_token=env[protocol.ENV_KEY_TOKEN], key_file=None,
                federation_ca=env.get(protocol.ENV_FEDERATION_CA, "")))
        from slurm_geo.config.model import load_config
        from slurm_geo.config.paths import master_key_path

        site = load_config(None)
        config = site.federation
        if config is None:
            raise ConfigError(f"{site.source} has no [federation] table; a federated job "
                              "finds the daemon there (docs/federation.md)")
        store = site.stores[site.cluster(cluster or site.home_cluster).store]
        key_file = master_key_path(config.key_file, env)
        return cls(Placement(run, cluster, job_id, restart, 0, None, config.url, store.url,
                             store.endpoint_url, "", key_file, _read_ca(config.ca_file)))

    # --- the lease ------------------------------------------------------------------------

    def acquire(self, give_up_after_s: float = 300.0) -> None:
        """Block until the lease is granted; raise Fenced, or FederationUnreachable."""
        deadline = self._clock() + give_up_after_s
        while True:
            answer = self._ask(release=False)
            if answer is not None and answer.verdict is protocol.Verdict.GRANT:
                break
            if self.fenced_reason is not None:
                raise Fenced(f"this incarnation is fenced: {self.fenced_reason}")
            if self._clock() > deadline:
                raise FederationUnreachable(
                    f"no lease from {self.placement.federation_url} within "
                    f"{give_up_after_s:g} s; the job does not train without one")
            time.sleep(1.0 if answer is None else answer.retry_s or 1.0)
        self._thread = threading.Thread(target=self._renew_loop, name="slurm-geo-lease",
                                        daemon=True)
        self._thread.start()

    def may_train(self) -> bool:
        with self._lock:
            if self.fenced_reason is not None or self._last_ok is None:
                return False
            return self._clock() - self._last_ok < TRAINER_SHARE * self._ttl_s

    def wait_for_lease(self) -> None:
        """Pause (not train) until the lease is current again; raise Fenced if it is lost."""
        while not self.may_train():
            if self.fenced_reason is not None:
                raise Fenced(f"this incarnation is fenced: {self.fenced_reason}")
            time.sleep(0.05)

    def checkpointed(self, step: int) -> None:
        """Report a committed checkpoint at once: a planned move waits for it."""
        with self._lock:
            self._last_step = step
        self._ask(release=False)

    def release(self, step: int | None) -> None:
        with self._lock:
            self._last_step = step
        self._stop.set()
        self._ask(release=True)

    def _renew_loop(self) -> None:
        while not self._stop.wait(max(0.2, self._ttl_s / 3)) and self.fenced_reason is None:
            self._ask(release=False)

    def _ask(self, release: bool) -> protocol.LeaseReply | None:
        placement = self.placement
        with self._lock:
            last_step = self._last_step
        sent = self._clock()
        request = protocol.LeaseRequest(placement.run, placement.cluster, placement.job_id,
                                        placement.restart, placement.generation, last_step,
                                        release)
        status, body = _post(placement.federation_url + protocol.LEASE_PATH,
                             request.to_json(), self._tls)
        reply = _lease_reply(status, body)
        with self._lock:
            if reply is not None and reply.verdict is protocol.Verdict.FENCED:
                self.fenced_reason = reply.reason or "fenced"
                log.error("lease refused: %s", self.fenced_reason)
            elif reply is not None and reply.verdict is protocol.Verdict.GRANT:
                self._last_ok = sent  # measured from when we asked: the safe side
                self._ttl_s = reply.ttl_s
                if reply.action is protocol.Action.RELEASE and not release:
                    self.release_requested = True
            elif reply is None:
                log.warning("lease renewal failed: %s", body.get("reason"))
        return reply if reply is not None and reply.verdict is not protocol.Verdict.FENCED \
            else None

    # --- the store ------------------------------------------------------------------------

    def repository(self) -> Repository:
        placement = self.placement
        store = open_store(placement.store_url, endpoint_url=placement.store_endpoint or None)
        if not placement.key_token:
            assert placement.key_file is not None
            return Repository(store, load_master_key(placement.key_file))
        status, body = _post(placement.federation_url + protocol.KEY_PATH,
                             protocol.KeyRequest(placement.key_token).to_json(), self._tls)
        try:
            if status != 200:
                raise ValueError(body.get("reason"))
            key = protocol.KeyReply.from_json(body)
        except (KeyError, TypeError, ValueError) as exc:
            raise Fenced(f"the federation daemon did not release the run key: {exc}") from None
        return RunKeyRepository(store, key.run, key.data_key)


def _lease_reply(status: int | None, body: dict[str, Any]) -> protocol.LeaseReply | None:
    """The daemon's answer; None when there was none this protocol can read."""
    if status not in (200, 409):
        return None
    try:
        return protocol.LeaseReply.from_json(body)
    except (KeyError, TypeError, ValueError):
        return None


def tls_context(ca_pem: str) -> ssl.SSLContext:
    """What https requests to the daemon verify its certificate (and host name) against:
    the CA in `ca_pem`, else the system's CAs."""
    try:
        return ssl.create_default_context(cadata=ca_pem or None)
    except (ssl.SSLError, ValueError) as exc:
        raise ConfigError(f"the federation daemon's CA ({protocol.ENV_FEDERATION_CA} or "
                          f"[federation] ca_file) is not a PEM certificate: {exc}") from None


def _read_ca(path: Path | None) -> str:
    if path is None:
        return ""
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"[federation] ca_file {path}: cannot read it ({exc})") from None


def _post(url: str, body: dict[str, Any], tls: ssl.SSLContext | None = None
          ) -> tuple[int | None, dict[str, Any]]:
    """POST `body` to the daemon; (None, {"reason"}) when no reply came (no connection, a
    certificate that does not verify, a reply that is not HTTP or not JSON)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S,
                                    context=tls) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read())
        except ValueError:
            return exc.code, {"reason": str(exc)}
    except (OSError, ValueError, http.client.HTTPException) as exc:
        return None, {"reason": str(exc) or type(exc).__name__}
