"""The federation daemon's answers to training jobs: leases and run keys, each to the
caller its credential proves (slurm_geo.lease.protocol; the HTTP side is
federation.service; who is calling: federation.authn; home jobs registered and runs
owned: federation.registration).

A lease decision and its write happen under the daemon's generation lock, the one a move
holds for its generation compare-and-set, so no lease is ever granted to a generation a
move has just replaced. Nothing slow runs under it: Slurm calls, MUNGE and store reads
happen before or after, so a move copying a 100 GB checkpoint never delays a renewal.

A request that is not authenticated is answered 401, one that is authentic but not its
caller's to make (another user's job, another incarnation, a replay, a token used) 403;
either changes nothing.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field, replace
from typing import Any

from slurm_geo.ckpt.errors import CkptError
from slurm_geo.ckpt.format.rollback import high_water
from slurm_geo.ckpt.repo.runkey import unwrap_run_keys
from slurm_geo.federation.access.authn import Authenticator, Caller
from slurm_geo.federation.access.refusals import REFUSED, Refusal, clip
from slurm_geo.federation.access.sessions import Sessions
from slurm_geo.federation.act.credentials import PER_RUN, job_environment
from slurm_geo.federation.act.highwater import lease_marks, sync_marks
from slurm_geo.federation.act.registration import Registrar
from slurm_geo.federation.act.worldgrants import tree_grants
from slurm_geo.federation.decide.leases import Verdict, decide
from slurm_geo.federation.model import JobStatus, Lease, LogicalJob
from slurm_geo.federation.wiring import Wiring
from slurm_geo.lease.protocol import (
    Action,
    KeyReply,
    KeyRequest,
    LeaseReply,
    LeaseRequest,
    TreeGrant,
)
from slurm_geo.lease.protocol import Verdict as Said
from slurm_geo.lease.signing import Credentials, Forbidden, Refused
from slurm_geo.policy.geo import rules_for

WAIT_RETRY_S = 1.0
log = logging.getLogger("slurm_geo.federation")


@dataclass(frozen=True)
class Reply:
    status: int  # HTTP status
    body: dict[str, Any]
    # What the audit says of a refusal that names a real job (the HTTP side audits every
    # refusal, at most once per source address per interval: federation.refusals).
    refusal: Refusal | None = None
    headers: dict[str, str] = field(default_factory=dict)  # Location, Retry-After


class LeaseService:
    def __init__(self, wiring: Wiring, generation_lock: threading.Lock,
                 authenticator: Authenticator):
        self.wiring = wiring
        self._lock = generation_lock
        self.auth = authenticator
        self.registrar = Registrar(wiring, generation_lock)
        self.sessions = Sessions(wiring, self.registrar.lookups)
        # logical job -> (target, why its planned move there waits: its world is not there
        # yet; '' when it need not), set by the daemon's rounds as it looks
        # (federation.core._hold_for_world), read at each renewal.
        self.move_waits: dict[str, tuple[str, str]] = {}

    def _move_waits(self, job: LogicalJob | None) -> str | None:
        """Why the job's planned move waits ('' it need not; None: not looked at yet)."""
        if job is None or job.move_to is None:
            return ""
        target, why = self.move_waits.get(job.logical_job, ("", ""))
        return why if target == job.move_to else None

    def lease(self, request: LeaseRequest, credentials: Credentials) -> Reply:
        try:
            caller = self.auth.authenticate(credentials)
            session = self._session(caller, request.cluster, request.job_id,
                                    request.generation, request.restart, issue=True)
            reply, job, acquired = self._lease(request, caller)
        except Refused as exc:
            return _refused(exc, "a lease", request.cluster, request.job_id)
        if reply.verdict is not Said.FENCED:
            mark = self._high_water(job, request) if acquired else None
            return Reply(reply.http_status, replace(reply, session_secret=session,
                                                    high_water=mark).to_json())
        return Reply(reply.http_status, reply.to_json(), Refusal(
            "fence", None if job is None else job.logical_job,
            f"refused a lease to {clip(request.cluster, 64)}:{request.job_id} generation "
            f"{request.generation}", reply.reason))

    def _lease(self, request: LeaseRequest, caller: Caller
               ) -> tuple[LeaseReply, LogicalJob | None, bool]:
        """The reply, the logical job the request named (None: no such job), and whether
        the reply grants this incarnation its first lease (a renewal does not)."""
        w = self.wiring
        if caller.at_home:
            self.registrar.admit_home(request, caller)  # reads Slurm: not under the lock
        stored_in = self._stored_in(request, caller)  # reads stores: not under it either
        with self._lock:
            now = w.clock()
            job = self._job_of(request.cluster, request.job_id, request.generation, caller)
            lease = None if job is None else w.state.lease(job.logical_job)
            answer = decide(job, lease, request, w.home, now, w.config.lease_ttl_s,
                            self._move_waits(job))
            if answer.verdict is Verdict.REGISTER:
                return LeaseReply(Said.WAIT, "registering the job",
                                  retry_s=WAIT_RETRY_S), job, False
            if answer.verdict is Verdict.FENCED:
                return LeaseReply(Said.FENCED, answer.reason), job, False
            if answer.verdict is Verdict.WAIT:
                return LeaseReply(Said.WAIT, answer.reason, retry_s=WAIT_RETRY_S), job, False
            assert job is not None
            if not job.run:  # discovered while pending: the job names its run now
                self.registrar.check_run(request.run, job.logical_job,
                                         None if job.owner is None else job.owner.uid,
                                         stored_in)
                job = w.state.name_run(job.logical_job, request.run, now)
            reply = self._grant(job, lease, request, answer.action, answer.reason, now)
            first = lease is None or (lease.generation, lease.restart) != (
                request.generation, request.restart)
            return reply, job, first and reply.verdict is Said.GRANT

    def _high_water(self, job: LogicalJob | None, request: LeaseRequest) -> int | None:
        """For the first grant to an incarnation that has not saved yet (its request
        names no last_step: it is about to resume; a renewal costs no more reads), the
        run's high-water mark in the store of its
        cluster (federation.highwater); None otherwise. Reads the state and
        checkpoint-sync's: not under the lock."""
        if job is None or not job.run or request.last_step is not None:
            return None
        w = self.wiring
        store = w.store_of(request.cluster)
        jobs = [(j, w.state.lease(j.logical_job)) for j in w.state.find_by_run(job.run)]
        return high_water([*lease_marks(jobs, store, w.store_of),
                           *sync_marks(w, job.run, store)])

    def _stored_in(self, request: LeaseRequest, caller: Caller) -> str | None:
        """The store already holding the run the request names, when the job names no run
        yet (it is about to name this one); None otherwise, without reading a store."""
        w = self.wiring
        if caller.at_home:
            job = w.state.find_job(request.cluster, request.job_id)
        else:  # its own job: _session checked that already
            assert caller.logical_job is not None
            job = w.state.job(caller.logical_job)
        if job is not None and job.run:
            return None
        return self.registrar.stored_in(request.run)

    def _session(self, caller: Caller, cluster: str, job_id: int, generation: int,
                 restart: int, issue: bool) -> str:
        """An incarnation's request, checked against its secrets (federation.sessions):
        the session secret its lease reply hands out ("" none). Not under the lock: it may
        ask Slurm whether the job was requeued."""
        if caller.at_home:
            return ""
        self._job_of(cluster, job_id, generation, caller)  # Forbidden: not its job
        return self.sessions.admit(caller, cluster, job_id, restart, issue)

    def _job_of(self, cluster: str, job_id: int, generation: int, caller: Caller
                ) -> LogicalJob | None:
        """The logical job the request is about, if it is the caller's to ask for."""
        w = self.wiring
        if caller.at_home:
            job = w.state.find_job(cluster, job_id)
            if job is not None and (job.owner is None or job.owner.uid != caller.uid):
                whose = 'another user' if job.owner is None else job.owner.user
                raise Forbidden(f"{cluster}:{job_id} is {job.logical_job}, which belongs to "
                                f"{whose}, not to uid {caller.uid}")
            return job
        assert caller.logical_job is not None
        for incarnation in w.state.incarnations(caller.logical_job):
            if incarnation.generation == caller.generation == generation \
                    and incarnation.cluster == cluster \
                    and incarnation.job_id in (None, job_id):
                return w.state.job(caller.logical_job)
        raise Forbidden(f"the credential of {caller} does not speak for {cluster}:{job_id} "
                        f"generation {generation}")

    def _grant(self, job: LogicalJob, lease: Lease | None, request: LeaseRequest,
               action: Action, reason: str, now: float) -> LeaseReply:
        w = self.wiring
        first = lease is None or lease.generation != job.generation
        released = action is Action.RELEASE and request.release
        # A requeued incarnation renews with no step until it first saves: the run's last
        # checkpoint is still the one its generation saved before (status shows it).
        last_step = request.last_step
        if last_step is None and lease is not None and not first:
            last_step = lease.last_step
        w.state.put_lease(Lease(job.logical_job, job.generation, request.cluster,
                                request.job_id, request.restart, now, last_step,
                                released), first)
        if first:
            w.audit.append("lease", job.logical_job,
                           f"generation {job.generation} started training on "
                           f"{request.cluster}:{request.job_id}",
                           "first lease of this generation", cluster=request.cluster,
                           job_id=request.job_id, generation=job.generation,
                           resume_step=job.resume_step)
        return LeaseReply(Said.GRANT, reason, action, job.logical_job, job.generation,
                          w.config.lease_ttl_s)

    def key(self, request: KeyRequest, credentials: Credentials) -> Reply:
        """The run's data key, for the current generation of the job that owns the run,
        while it holds the lease: at home by MUNGE, elsewhere by the incarnation's
        signature and its one-time token."""
        try:
            caller = self.auth.authenticate(credentials)
            self._session(caller, request.cluster, request.job_id, request.generation,
                          request.restart, issue=False)
            return self._key(request, caller)
        except Refused as exc:
            return _refused(exc, "a key", request.cluster, request.job_id)

    def _key(self, request: KeyRequest, caller: Caller) -> Reply:
        w = self.wiring
        job = self._key_holder(request, caller)
        lease = w.state.lease(job.logical_job)
        if not job.run or lease is None or lease.generation != job.generation \
                or lease.restart != request.restart or lease.expired(w.clock(),
                                                                     w.config.lease_ttl_s):
            return Reply(409, {"reason": "hold the lease first: ask for one (it names the "
                               "run), then for the key"})
        store = w.stores[w.store_of(job.cluster)]
        try:
            data_keys = unwrap_run_keys(store, w.master_keys, job.run, create=True)
        except CkptError as exc:
            return Reply(503, {"reason": str(exc)})
        if request.token and not w.state.identities.use_token(request.token, request.restart):
            raise Forbidden("this token has released the key already")
        w.state.confirm_leading()  # a key goes out only while etcd says this replica leads
        w.say_once(("key", job.logical_job, str(job.generation), str(request.restart)), "key",
                   job.logical_job, f"released run {job.run}'s data key to generation "
                   f"{job.generation} on {job.cluster}:{job.job_id}",
                   f"{caller} holds the lease" + (" and presented its one-time token"
                                                  if request.token else ""))
        store_env = self._store_env(job) if request.store_credentials and request.token \
            else {}
        return Reply(200, KeyReply(job.run, data_keys, store_env,
                                   self._tree_grants(job)).to_json())

    def _tree_grants(self, job: LogicalJob) -> tuple[TreeGrant, ...]:
        """The key rings of the staged trees of the job's own world (federation.
        worldgrants): at home from the home store, made there the first time (the home
        job stages into it); elsewhere from its cluster's store, those copied there. A
        store fault grants none: the run key still goes out, the job trains unstaged."""
        w = self.wiring
        at_home = job.cluster == w.home
        try:
            return tree_grants(job, w.stores[w.store_of(job.cluster)], w.master_keys,
                               create=at_home, rules=rules_for(w.site))
        except CkptError as exc:
            log.warning("%s: no staged tree granted: %s", job.logical_job, exc)
            return ()

    def _store_env(self, job: LogicalJob) -> dict[str, str]:
        """The run's own key to its cluster's store, for an incarnation submitted before
        the job named its run (federation.credentials): minted now, for the run its lease
        named; nothing for a store that does not mint a key per run."""
        config = self.wiring.site.stores[self.wiring.store_of(job.cluster)]
        if config.job_keys != PER_RUN or job.run is None:
            return {}
        return {name: value for name, value in
                job_environment(config, os.environ, job.run).items()
                if name.startswith("AWS_")}

    def _key_holder(self, request: KeyRequest, caller: Caller) -> LogicalJob:
        """The caller's job, if the request names its current generation."""
        w = self.wiring
        if caller.at_home and request.token:
            raise Forbidden("a key token is for the incarnation it was given to; a home job "
                            "asks without one")
        if caller.at_home and (request.cluster != w.home or request.generation != 0):
            raise Forbidden("a MUNGE credential speaks only for generation 0 on the home "
                            f"cluster {w.home}")
        job = self._job_of(request.cluster, request.job_id, request.generation, caller)
        if job is None:
            raise Forbidden(f"{request.cluster}:{request.job_id} is no registered job")
        if job.status is not JobStatus.RUNNING or (job.generation, job.cluster, job.job_id) \
                != (request.generation, request.cluster, request.job_id):
            raise Forbidden(f"generation {request.generation} on {request.cluster}:"
                            f"{request.job_id} is not the job's current incarnation")
        if not caller.at_home:
            owner = w.state.identities.token_owner(request.token) if request.token else None
            if owner is None or (owner.logical_job, owner.generation) != (
                    caller.logical_job, caller.generation):
                raise Forbidden("no key token of this incarnation was presented")
        return job

    def discover_pending(self) -> None:
        self.registrar.discover_pending()

    def learn_environments(self, jobs: list[LogicalJob]) -> None:
        self.registrar.learn_environments(jobs)


def _refused(refusal: Refused, what: str, cluster: str, job_id: int) -> Reply:
    """401, 403 or 503 with the reason; a 4xx is audited by the HTTP side, at most once
    per source address per interval (federation.refusals), never logged per request."""
    return Reply(refusal.status, {"reason": str(refusal)}, Refusal(
        REFUSED, None, f"refused {what} to {clip(cluster, 64)}:{job_id} ({refusal.status})",
        str(refusal)))
