"""A training job's side of the lease protocol: its lease, its run key and its store.
No torch inside: the training side (slurm_geo.torch) and any other trainer use it.

    run = FederatedRun.from_environment("my-run")
    run.acquire()                  # blocks until the daemon grants a lease (or fences us)
    repository = run.repository()  # the run's data key from the daemon, in memory only
    ... each step:   if not run.may_train(): run.wait_for_lease()
    ... after each committed checkpoint: run.checkpointed(step); if run.release_requested: stop
    run.release(final_step)

On the home cluster the job finds the daemon, its store and munged's socket through the
site config ($SLURM_GEO_CONFIG) and proves who it is with a MUNGE credential on every
request; it never reads the master key. An incarnation the daemon submitted elsewhere
finds everything in its environment (SLURM_GEO_*, see slurm_geo.lease.protocol): the
secret it signs its requests with and a one-time token for its run's data key, both
taken out of os.environ when read (child processes do not inherit them), and the CA to
verify the daemon's https against (SLURM_GEO_FEDERATION_CA; at home: [federation]
ca_file; else the system's). Either way the run's data key is fetched from the daemon
and held in memory only (lease protocol 2: slurm_geo.lease.signing).

The lease is renewed by a thread every third of its TTL; `may_train()` compares the last
successful renewal with the job's own monotonic clock, so a process that was frozen (or
cut off) knows its lease is stale the moment it runs again. See slurm_geo.federation.decide.leases.

With replicas of the daemon, each request goes to the one that led last; a redirect to the
leader is followed (to a replica of the list only, the request signed afresh), and a
replica that does not answer is passed over for the next (slurm_geo.lease.replicas).
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import logging
import os
import ssl
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from slurm_geo.ckpt import Repository
from slurm_geo.ckpt.errors import CkptError
from slurm_geo.ckpt.format.keys import RunKeyRing
from slurm_geo.ckpt.format.rollback import high_water, resume_rollback
from slurm_geo.ckpt.repo.runkey import RunKeyRepository
from slurm_geo.ckpt.stores.open_store import open_store
from slurm_geo.errors import ConfigError, SlurmGeoError
from slurm_geo.exitcodes import ExitCode
from slurm_geo.jobenv import JobEnv
from slurm_geo.lease import handoff, places, protocol
from slurm_geo.lease.handoff import ENV_KEY_HANDOFF
from slurm_geo.lease.munge import MungeCommands, MungeUnavailable, munge_socket
from slurm_geo.lease.protocol import TRAINER_SHARE
from slurm_geo.lease.replicas import Answer, Move, next_hop, parse_urls, retry_after
from slurm_geo.lease.signing import MungeSigner, SecretSigner, secret_bytes

log = logging.getLogger(__name__)
# A home job that declared a world (its key reply grants trees) whose trainer passes no
# stager: the daemon will not move it where that world is missing (docs/training.md).
NO_STAGER = ("this job declared a world (--geo-inputs, --geo-env) and its trainer stages "
             "none: pass FederatedRun(..., stage_world="
             "slurm_geo.stage.homestart.stage_home_world)")

REQUEST_TIMEOUT_S = 5.0
# How long a key request waits for an election: a follower leads within leader_ttl_s and
# a third of the old leader's last renewal (6.7 s at the default 5 s), with room to spare.
ELECTION_WAIT_S = 20.0
QUIET_ACQUIRE_S = 30.0  # acquire says nothing of refusals before this


class Fenced(SlurmGeoError):
    exit_code = ExitCode.FENCED


class FederationUnreachable(SlurmGeoError):
    exit_code = ExitCode.LEASE_UNREACHABLE


@dataclass(frozen=True)
class Placement:
    """Where this incarnation is, what it starts from and how it proves who it is."""

    run: str
    cluster: str
    job_id: int
    restart: int
    generation: int
    resume_step: int | None
    federation_url: str
    store_url: str
    store_endpoint: str
    key_token: str = ""     # empty on the home cluster: it asks for its key by MUNGE
    logical_job: str = ""   # an incarnation the daemon submitted: whose secret it holds
    lease_secret: str = ""  # empty on the home cluster: its requests carry MUNGE
    munge_socket: Path | None = None
    federation_ca: str = ""  # PEM of the CA the daemon's https is verified against; "": system
    federation_urls: tuple[str, ...] = ()  # every replica's, when the daemon has replicas

    @property
    def urls(self) -> tuple[str, ...]:
        """Every URL the daemon may answer at: federation_url first, each once."""
        return tuple(dict.fromkeys((self.federation_url, *self.federation_urls)))

    def __repr__(self) -> str:  # never the secret nor the token in a log or traceback
        return (f"Placement(run={self.run!r}, cluster={self.cluster!r}, "
                f"job_id={self.job_id}, generation={self.generation})")


class Signer(Protocol):
    def headers(self, method: str, path: str, body: bytes) -> dict[str, str]: ...


def signer_for(placement: Placement) -> Signer:
    """The secret an incarnation the daemon submitted was given; MUNGE at home."""
    if placement.lease_secret:
        return SecretSigner(placement.logical_job, placement.generation,
                            secret_bytes(placement.lease_secret))
    return MungeSigner(MungeCommands(placement.munge_socket))


# What the home job (generation 0) does with a key reply that grants trees of its world:
# (reply, generation, store URL, store endpoint) -> a background stager, or None. The
# stager is stage.home's (slurm_geo.stage.homestart.stage_home_world); the lease sits
# below it, so the job's entry passes it in.
WorldStager = Callable[[protocol.KeyReply, int, str, str], Any]


class FederatedRun:
    def __init__(self, placement: Placement, *, clock: Any = time.monotonic,
                 signer: Signer | None = None, where: places.Where | None = None,
                 env: Mapping[str, str] = os.environ, stage_world: WorldStager | None = None):
        self.placement = placement
        self._stage_world = stage_world
        # Where its checkpoints go (said at start, recorded for the node epilog):
        self.where = where or places.unknown(placement.cluster, placement.store_url)
        self._ckpt_dir = env.get(places.CKPT_DIR_ENV) or None
        self._record: places.RunRecord | None = None
        self._signer = signer_for(placement) if signer is None else signer
        self._clock = clock
        self._lock = threading.Lock()
        self._last_ok: float | None = None
        self._ttl_s = 0.0
        self._last_step: int | None = None
        # The run's high-water mark in its store (docs/format.md §8.6): the greatest the
        # daemon's grants named, and the step this job's own record noted at an earlier
        # start (a requeue), read before this start rewrites it (`checked`).
        self.high_water: int | None = None
        self._own_record = None if self._ckpt_dir is None else places.read_record(
            Path(self._ckpt_dir), placement.cluster, placement.job_id)
        self.fenced_reason: str | None = None
        self.release_requested = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._tls = tls_context(placement.federation_ca)
        self._urls = placement.urls
        self._asking = 0  # the replica that led last
        # The run's own store key (S3 variables) the daemon sent with the run key, when this
        # incarnation asked for it: rank 0 passes it on to the other ranks (torch.ranks).
        self.store_env: dict[str, str] = {}
        # A key reply (and session) the moved job's preamble handed on: lease.handoff.
        self._handed = _handed(placement, _take(env, ENV_KEY_HANDOFF)) \
            if env.get(ENV_KEY_HANDOFF) else None
        self._reply: protocol.KeyReply | None = None
        self._session = "" if self._handed is None else self._handed[1]
        if self._session:
            self._signer = _session_signer(placement, self._session)
        # The home job's stager of its world (the trees its key reply grants), started by
        # `stage_world` once it has its key; None elsewhere, without any, or without one.
        self.stager: Any = None

    @classmethod
    def from_environment(cls, run: str, env: Mapping[str, str] = os.environ,
                         stage_world: WorldStager | None = None
                         ) -> FederatedRun:
        job = JobEnv.from_environ(env)
        cluster = job.cluster
        job_id = int(job.job_id or "0")
        restart = int(job.restart_count or job.job_restart_count or 0)
        if env.get(protocol.ENV_GENERATION):
            if isinstance(env, MutableMapping):
                store_ca_here(env)
            return cls(_submitted_placement(run, cluster, job_id, restart, env), env=env,
                       stage_world=stage_world)
        from slurm_geo.config.model import load_config

        site = load_config(None)
        config = site.federation
        if config is None:
            raise ConfigError(f"{site.source} has no [federation] table; a federated job "
                              "finds the daemon there (docs/federation.md)")
        here = site.cluster(cluster or site.home_cluster)
        store = site.stores[here.store]
        sync = None if site.sync is None else places.SyncFacts(
            site.sync.roots, site.sync.destination, site.home_cluster)
        where = places.where(cluster or site.home_cluster, here.store, store.url, sync)
        return cls(Placement(run, cluster, job_id, restart, 0, None, config.url, store.url,
                             store.endpoint_url,
                             munge_socket=munge_socket(config.munge_socket, here.slurm_conf),
                             federation_ca=_read_ca(config.ca_file),
                             federation_urls=config.job_urls), where=where, env=env,
                   stage_world=stage_world)

    # --- the lease ------------------------------------------------------------------------

    def acquire(self, give_up_after_s: float = 300.0) -> None:
        """Block until the lease is granted; raise Fenced, or FederationUnreachable."""
        started = self._clock()
        deadline = started + give_up_after_s
        while True:
            # The first seconds' refusals are expected (slurmdbd records a job seconds
            # after submission, a replica may be electing): said only once they last.
            answer = self._ask(release=False,
                               quiet=self._clock() - started < QUIET_ACQUIRE_S)
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
        self._note_step(step)
        self._ask(release=False)

    def release(self, step: int | None) -> None:
        with self._lock:
            self._last_step = step
        self._note_step(step)
        self._stop.set()
        self._ask(release=True)

    def _renew_loop(self) -> None:
        # The renewal thread may wait out an election: the trainer goes on meanwhile, and
        # the grant comes as soon as a replica leads, not a third of the TTL later.
        while not self._stop.wait(max(0.2, self._ttl_s / 3)) and self.fenced_reason is None:
            self._ask(release=False, election_wait_s=ELECTION_WAIT_S)

    def _ask(self, release: bool, election_wait_s: float = 0.0, quiet: bool = False
             ) -> protocol.LeaseReply | None:
        placement = self.placement
        with self._lock:
            last_step = self._last_step
        sent = self._clock()
        request = protocol.LeaseRequest(placement.run, placement.cluster, placement.job_id,
                                        placement.restart, placement.generation, last_step,
                                        release)
        status, body = self._call(protocol.LEASE_PATH, request.to_json(), election_wait_s)
        reply = _lease_reply(status, body)
        with self._lock:
            if reply is not None and reply.verdict is protocol.Verdict.FENCED:
                self.fenced_reason = reply.reason or "fenced"
                log.error("lease refused: %s", self.fenced_reason)
            if reply is not None and reply.session_secret and placement.logical_job:
                # The daemon's session secret, over TLS: the bootstrap one in the
                # environment (and in slurmdbd's records) is spent once this is used.
                self._signer = _session_signer(placement, reply.session_secret)
                self._session = reply.session_secret
            if reply is not None and reply.verdict is protocol.Verdict.GRANT:
                self._last_ok = sent  # measured from when we asked: the safe side
                self._ttl_s = reply.ttl_s
                self.high_water = high_water([self.high_water, reply.high_water])
                if reply.action is protocol.Action.RELEASE and not release:
                    self.release_requested = True
            elif reply is None:
                log.log(logging.DEBUG if quiet else logging.WARNING,
                        "lease renewal failed: %s", body.get("reason"))
        return reply if reply is not None and reply.verdict is not protocol.Verdict.FENCED \
            else None

    # --- requests ---------------------------------------------------------------------------

    def _call(self, path: str, body: dict[str, Any], election_wait_s: float = 0.0
              ) -> tuple[int | None, dict[str, Any]]:
        """POST `body` to the leading replica, signed afresh for each replica asked: what
        it answered, or (None, reason) when none did. While nobody leads, wait up to
        `election_wait_s` for a leader, then answer what the replica said."""
        data = json.dumps(body).encode()
        deadline = self._clock() + election_wait_s
        unanswered: list[str] = []
        redirects = 0
        while True:
            try:
                headers = self._signer.headers("POST", path, data)
            except MungeUnavailable as exc:
                return None, {"reason": str(exc)}
            asked = self._asking
            answer = post(self._urls[asked] + path, data, headers, self._tls)
            hop = next_hop(self._urls, asked, path, answer)
            if hop.move is Move.DONE:
                return answer.status, answer.body
            if hop.move is Move.REFUSE:
                log.warning("%s", hop.reason)
                return None, {"reason": hop.reason}
            if hop.move is Move.NEXT:
                unanswered.append(f"{self._urls[asked]}: {hop.reason}")
                if len(unanswered) >= len(self._urls):
                    return None, {"reason": "; ".join(unanswered)}
            elif hop.move is Move.FOLLOW:
                redirects += 1
                if redirects > len(self._urls):
                    return None, {"reason": "the replicas redirect to one another: none "
                                  "says it leads"}
            elif self._clock() + answer.retry_after_s > deadline:  # WAIT, for too long
                return answer.status, answer.body
            else:
                time.sleep(answer.retry_after_s)
                unanswered, redirects = [], 0
            self._asking = hop.index

    # --- the store ------------------------------------------------------------------------

    def repository(self) -> Repository:
        """The run's store, opened with the run's data key (`run_key`)."""
        placement = self.placement
        run, data_keys = self.run_key()  # first: it may bring the store's key (run_key)
        store = open_store(placement.store_url, endpoint_url=placement.store_endpoint or None)
        return self.checked(RunKeyRepository(store, run, data_keys), run)

    def checked(self, repository: Repository, run: str) -> Repository:
        """`repository`, unless its store rolled `run` back (RolledBack, exit code 35): the
        newest checkpoint it lists, or the step its latest pointer names, is older than
        the run's high-water mark there, the greater of the daemon's (with its grant) and
        this job's own record's (docs/format.md §8.6). A generation the daemon placed
        starts exactly at the step it verified against its own mark: not checked again."""
        p = self.placement
        if p.generation > 0 and p.restart == 0:
            return repository
        with self._lock:
            mark = high_water([self.high_water,
                               places.own_mark(self._own_record, run, p.store_url)])
        if mark is None:
            return repository
        try:
            pointer = repository.pointer(run)
        except CkptError:  # a pointer that does not open: the listing still counts
            pointer = None
        found = resume_rollback(run, self.where.store or p.store_url, repository.steps(run),
                                pointer, mark)
        if found is not None:
            raise found
        return repository

    def _announce(self, run: str) -> None:
        """Say on stderr where the run's checkpoints go (and warn when checkpoint-sync
        does not replicate them), and leave the job directory's record of it for the
        node epilog (slurm_geo.lease.places)."""
        if self._record is not None:
            return
        for line in places.start_lines(run, self.where, self._ckpt_dir):
            print(line, file=sys.stderr, flush=True)
        p, where = self.placement, self.where
        self._record = places.RunRecord(run, p.cluster, p.job_id, p.restart, where.store,
                                        where.store_url, None, where.replicated, where.why)
        self._write_record()

    def _note_step(self, step: int | None) -> None:
        if self._record is not None and step is not None and step != self._record.step:
            self._record = dataclasses.replace(self._record, step=step)
            self._write_record()

    def _write_record(self) -> None:
        if self._ckpt_dir is None or self._record is None:
            return
        try:
            places.write_record(Path(self._ckpt_dir), self._record)
        except OSError as exc:  # a job directory the prolog did not prepare (elsewhere)
            log.debug("no run record in %s: %s", self._ckpt_dir, exc)

    def run_key(self) -> tuple[str, RunKeyRing]:
        """(run, its key ring: docs/format.md §4.2): the daemon releases it to the
        incarnation holding the lease (acquire first), by MUNGE at home, elsewhere by the
        incarnation's signature and its one-time token, so it is asked once per
        incarnation."""
        reply = self.key_reply()
        return reply.run, reply.data_keys

    def key_reply(self) -> protocol.KeyReply:
        """The daemon's whole key reply (`run_key`, and the rings of the job's world's trees:
        `trees`), or the one the moved job's preamble handed this process."""
        self._reply = reply = (self._handed[0] if self._handed
                               else _ask_key(self.placement, self._call))
        os.environ.update(reply.store_env)
        store_ca_here(os.environ)
        self.store_env = dict(reply.store_env)
        self._announce(reply.run)
        if reply.trees and self.stager is None and self.placement.generation == 0:
            if self._stage_world is None:  # not silent: nothing stages the declared world
                log.warning(NO_STAGER)
            else:
                self.stager = self._stage_world(reply, self.placement.generation,
                                                self.placement.store_url,
                                                self.placement.store_endpoint)
        return reply

    def hand_over(self) -> str:
        """Stop renewing the lease here (not releasing it): the key reply (`key_reply`
        first), sealed for the process this one starts, which holds the lease from then on
        (its ENV_KEY_HANDOFF: lease.handoff)."""
        assert self._reply is not None and self.placement.lease_secret
        self._stop.set()
        return handoff.seal_reply(self._reply, self._session, self.placement.lease_secret,
                                  _bound(self.placement))

def _ask_key(placement: Placement, call: Any) -> protocol.KeyReply:
    """The daemon's key reply for this incarnation (`call`: FederatedRun._call)."""
    # Submitted before its job named a run, an incarnation got no store key: it asks
    # for its run's with the data key, and the reply's goes into its environment.
    needs_store_key = bool(placement.key_token) and not os.environ.get("AWS_ACCESS_KEY_ID") \
        and placement.store_url.startswith("s3://")
    request = protocol.KeyRequest(placement.cluster, placement.job_id, placement.restart,
                                  placement.generation, placement.key_token,
                                  store_credentials=needs_store_key)
    status, body = call(protocol.KEY_PATH, request.to_json(), election_wait_s=ELECTION_WAIT_S)
    if status is None or (status == 503 and "leader" in body):
        raise FederationUnreachable(f"no replica of the federation daemon released the "
                                    f"run key: {body.get('reason')}")
    try:
        if status != 200:
            raise ValueError(body.get("reason"))
        return protocol.KeyReply.from_json(body)
    except (KeyError, TypeError, ValueError) as exc:
        raise Fenced(f"the federation daemon did not release the run key: {exc}") from None


def _bound(p: Placement) -> bytes:
    return handoff.bound_to(p.logical_job, p.generation, p.cluster, p.job_id, p.restart)


def _session_signer(placement: Placement, session: str) -> SecretSigner:
    return SecretSigner(placement.logical_job, placement.generation, secret_bytes(session))


def _handed(placement: Placement, sealed: str) -> tuple[protocol.KeyReply, str]:
    """The key reply and session secret the preamble handed this process; Fenced where
    they do not open."""
    if not placement.lease_secret:
        raise Fenced(f"{ENV_KEY_HANDOFF} is set but this incarnation has no lease secret "
                     "to open it with")
    try:
        return handoff.open_reply(sealed, placement.lease_secret, _bound(placement))
    except handoff.HandoffError as exc:
        raise Fenced(str(exc)) from None


def store_ca_here(env: MutableMapping[str, str]) -> None:
    """The store's CA bundle the daemon named (AWS_CA_BUNDLE, a path at home) is not on a
    cluster that has none of home's files: there, a private copy of the PEM it sent with
    it (SLURM_GEO_STORE_CA) takes its place. Nothing changes where the path is there."""
    named, pem = env.get(protocol.ENV_CA_BUNDLE), env.get(protocol.ENV_STORE_CA)
    if not named or not pem or os.path.exists(named):
        return
    handle, copy = tempfile.mkstemp(prefix="slurm-geo-store-ca-", suffix=".pem")
    with os.fdopen(handle, "w") as out:
        out.write(pem)
    env[protocol.ENV_CA_BUNDLE] = copy


def _submitted_placement(run: str, cluster: str, job_id: int, restart: int,
                         env: Mapping[str, str]) -> Placement:
    """An incarnation the daemon submitted: everything is in its environment; its secret
    and token leave os.environ once read."""
    if not env.get(protocol.ENV_LEASE_SECRET):
        raise ConfigError(f"{protocol.ENV_LEASE_SECRET} is not set: this incarnation was "
                          "submitted by a federation daemon older than lease protocol 2 "
                          "and cannot prove who it is")
    resume = env.get(protocol.ENV_RESUME_STEP, "")
    return Placement(
        run=env.get(protocol.ENV_RUN) or run, cluster=cluster, job_id=job_id,
        restart=restart, generation=int(env[protocol.ENV_GENERATION]),
        resume_step=int(resume) if resume else None,
        federation_url=env[protocol.ENV_FEDERATION_URL],
        federation_urls=_replica_urls(env), store_url=env[protocol.ENV_STORE],
        store_endpoint=env.get(protocol.ENV_STORE_ENDPOINT, ""),
        key_token=_take(env, protocol.ENV_KEY_TOKEN),
        logical_job=env[protocol.ENV_LOGICAL_JOB],
        lease_secret=_take(env, protocol.ENV_LEASE_SECRET),
        federation_ca=env.get(protocol.ENV_FEDERATION_CA, ""))


def _replica_urls(env: Mapping[str, str]) -> tuple[str, ...]:
    try:
        return parse_urls(env.get(protocol.ENV_FEDERATION_URLS, ""))
    except ValueError as exc:
        raise ConfigError(f"{protocol.ENV_FEDERATION_URLS}: {exc}") from None


def _take(env: Mapping[str, str], name: str) -> str:
    """A credential from the environment, removed from it (os.environ included)."""
    value = env[name]
    if isinstance(env, MutableMapping):
        del env[name]
    return value


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


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is the caller's to judge (slurm_geo.lease.replicas), never followed here."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def post(url: str, data: bytes, headers: Mapping[str, str],
         tls: ssl.SSLContext | None = None, timeout_s: float = REQUEST_TIMEOUT_S) -> Answer:
    """POST exactly `data` (the bytes the credential in `headers` covers) to one replica;
    status None (and the reason) when no reply came: no connection, a certificate that
    does not verify, a reply that is not HTTP or not JSON."""
    request = urllib.request.Request(url, data=data, method="POST",
                                     headers={"Content-Type": "application/json", **headers})
    opener = urllib.request.build_opener(urllib.request.HTTPSHandler(context=tls),
                                         _NoRedirects)
    try:
        with opener.open(request, timeout=timeout_s) as response:
            return Answer(response.status, json.loads(response.read()))
    except urllib.error.HTTPError as exc:
        try:
            body = json.loads(exc.read())
        except ValueError:
            body = {"reason": str(exc)}
        return Answer(exc.code, body if isinstance(body, dict) else {"reason": str(exc)},
                      exc.headers.get("Location", ""),
                      retry_after(exc.headers.get("Retry-After")))
    except (OSError, ValueError, http.client.HTTPException) as exc:
        return Answer(None, {"reason": str(exc) or type(exc).__name__})
