"""The federation daemon's answers to training jobs: leases and run keys, and the
registration of home jobs it has not seen yet (slurm_geo.lease.protocol; the HTTP side
is federation.service).

A lease decision and its write happen under the daemon's generation lock, the one a move
holds for its generation compare-and-set, so no lease is ever granted to a generation a
move has just replaced. Nothing slow runs under it: Slurm calls and store reads happen
before or after, so a move copying a 100 GB checkpoint never delays a renewal.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from slurm_geo.ckpt.errors import CkptError
from slurm_geo.ckpt.runkey import unwrap_run_key
from slurm_geo.errors import SlurmGeoError
from slurm_geo.federation.leases import Verdict, decide
from slurm_geo.federation.model import JobStatus, Lease, LogicalJob
from slurm_geo.federation.resubmit import ScriptOptions, script_options
from slurm_geo.federation.wiring import Wiring
from slurm_geo.lease.protocol import Action, KeyReply, LeaseReply, LeaseRequest
from slurm_geo.lease.protocol import Verdict as Said
from slurm_geo.policy.directives import DirectiveError
from slurm_geo.slurm import JobState, SlurmError

log = logging.getLogger("slurm_geo.federation")

WAIT_RETRY_S = 1.0


@dataclass(frozen=True)
class Reply:
    status: int  # HTTP status
    body: dict[str, Any]


class LeaseService:
    def __init__(self, wiring: Wiring, generation_lock: threading.Lock):
        self.wiring = wiring
        self._lock = generation_lock
        self._seen_pending: set[int] = set()

    def lease(self, request: LeaseRequest) -> Reply:
        reply = self._lease(request)
        return Reply(reply.http_status, reply.to_json())

    def _lease(self, request: LeaseRequest) -> LeaseReply:
        w = self.wiring
        if self._unregistered_home_job(request):
            self._register(request)  # reads the batch script from Slurm: not under the lock
        with self._lock:
            now = w.clock()
            job = w.state.find_job(request.cluster, request.job_id)
            lease = None if job is None else w.state.lease(job.logical_job)
            answer = decide(job, lease, request, w.home, now, w.config.lease_ttl_s)
            if answer.verdict is Verdict.REGISTER:
                return LeaseReply(Said.WAIT, "registering the job", retry_s=WAIT_RETRY_S)
            if answer.verdict is Verdict.FENCED:
                self._audit_fenced(job, request, answer.reason)
                return LeaseReply(Said.FENCED, answer.reason)
            if answer.verdict is Verdict.WAIT:
                return LeaseReply(Said.WAIT, answer.reason, retry_s=WAIT_RETRY_S)
            assert job is not None
            if not job.run:  # discovered while pending: the job names its run now
                job = w.state.name_run(job.logical_job, request.run, now)
            return self._grant(job, lease, request, answer.action, answer.reason, now)

    def _grant(self, job: LogicalJob, lease: Lease | None, request: LeaseRequest,
               action: Action, reason: str, now: float) -> LeaseReply:
        w = self.wiring
        first = lease is None or lease.generation != job.generation
        released = action is Action.RELEASE and request.release
        w.state.put_lease(Lease(job.logical_job, job.generation, request.cluster,
                                request.job_id, request.restart, now, request.last_step,
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

    def _audit_fenced(self, job: LogicalJob | None, request: LeaseRequest, reason: str) -> None:
        self.wiring.say_once(("fenced", request.cluster, str(request.job_id),
                              str(request.generation)), "fence",
                             None if job is None else job.logical_job,
                             f"refused a lease to {request.cluster}:{request.job_id} "
                             f"generation {request.generation}", reason)

    def key(self, token: str) -> Reply:
        """The run's data key, for the incarnation the token was minted for, while it is
        the current generation."""
        w = self.wiring
        owner = w.state.identities.token_owner(token)
        if owner is None:
            return Reply(403, {"reason": "unknown or expired token"})
        job = w.state.job(owner.logical_job)
        if not job.run:
            return Reply(409, {"reason": "ask for a lease first: it names the run"})
        if job.generation != owner.generation or job.status.is_final():
            return Reply(403, {"reason": f"generation {owner.generation} is no longer current"})
        store = w.stores[w.store_of(job.cluster)]
        try:
            data_key = unwrap_run_key(store, w.master_key, job.run, create=True)
        except CkptError as exc:
            return Reply(503, {"reason": str(exc)})
        w.say_once(("key", job.logical_job, str(job.generation)), "key", job.logical_job,
                   f"released run {job.run}'s data key to generation {job.generation} on "
                   f"{job.cluster}", "the job presented its one-time token")
        return Reply(200, KeyReply(job.run, data_key).to_json())

    # --- registration ---------------------------------------------------------------------

    def _unregistered_home_job(self, request: LeaseRequest) -> bool:
        return (request.generation == 0 and request.cluster == self.wiring.home
                and self.wiring.state.find_job(request.cluster, request.job_id) is None)

    def _register(self, request: LeaseRequest) -> None:
        w = self.wiring
        script = w.clients[w.home].batch_script(request.job_id)
        options = script_options(script)
        try:
            options.directives()
        except DirectiveError as exc:
            raise SlurmGeoError(f"job {w.home}:{request.job_id}: {exc}") from None
        self._add(request.job_id, request.run, script, options,
                  "first lease request of a home job")

    def discover_pending(self) -> None:
        """Register geo jobs pending at home, so a hopeless queue can be left: a job that
        asks --geo-failover and --geo-ckpt-dir. Each pending job's script is read once."""
        w = self.wiring
        home = w.clients[w.home]
        for info in home.jobs():
            if info.state is not JobState.PENDING or info.job_id in self._seen_pending:
                continue
            self._seen_pending.add(info.job_id)
            if w.state.find_job(w.home, info.job_id) is not None:
                continue
            try:
                script = home.batch_script(info.job_id)
                options = script_options(script)
                directives = options.directives()
            except (SlurmError, DirectiveError, ValueError):
                continue
            if directives.ckpt_dir and directives.failover in ("auto", "manual"):
                self._add(info.job_id, "", script, options,
                          "a geo job pending on the home cluster")

    def _add(self, job_id: int, run: str, script: str, options: ScriptOptions,
             why: str) -> None:
        w = self.wiring
        now = w.clock()
        logical = f"{w.home}-{job_id}"
        job = LogicalJob(logical, run, w.home, script, options.to_json(),
                         options.directives().as_options(), 0, w.home, job_id, None,
                         JobStatus.RUNNING, created_at=now, updated_at=now)
        if w.state.add_job(job):
            w.audit.append("register", logical, f"registered {w.home}:{job_id}"
                           + (f" (run {run})" if run else ""), why, cluster=w.home,
                           job_id=job_id, run=run, directives=job.directives)
