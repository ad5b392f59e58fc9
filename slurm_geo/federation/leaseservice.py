"""The federation daemon's answers to training jobs: leases and run keys, and the
registration of home jobs it has not seen yet (federation.registration;
slurm_geo.lease.protocol; the HTTP side is federation.service).

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
from slurm_geo.federation.leases import Verdict, decide
from slurm_geo.federation.model import Lease, LogicalJob
from slurm_geo.federation.refusals import Refusal, clip
from slurm_geo.federation.registration import Registrar
from slurm_geo.federation.wiring import Wiring
from slurm_geo.lease.protocol import Action, KeyReply, LeaseReply, LeaseRequest
from slurm_geo.lease.protocol import Verdict as Said

log = logging.getLogger("slurm_geo.federation")

WAIT_RETRY_S = 1.0


@dataclass(frozen=True)
class Reply:
    status: int  # HTTP status
    body: dict[str, Any]
    # What the audit says of a refusal that names a real job (the HTTP side audits every
    # refusal, at most once per source address per interval: federation.refusals).
    refusal: Refusal | None = None


class LeaseService:
    def __init__(self, wiring: Wiring, generation_lock: threading.Lock):
        self.wiring = wiring
        self._lock = generation_lock
        self.registrar = Registrar(wiring)

    def lease(self, request: LeaseRequest) -> Reply:
        reply, job = self._lease(request)
        if reply.verdict is not Said.FENCED:
            return Reply(reply.http_status, reply.to_json())
        return Reply(reply.http_status, reply.to_json(), Refusal(
            "fence", None if job is None else job.logical_job,
            f"refused a lease to {clip(request.cluster, 64)}:{request.job_id} generation "
            f"{request.generation}", reply.reason))

    def _lease(self, request: LeaseRequest) -> tuple[LeaseReply, LogicalJob | None]:
        """The reply, and the logical job the request named (None: no such job)."""
        w = self.wiring
        if self._unregistered_home_job(request):
            # Reads Slurm and the registry: not under the lock.
            self.registrar.register_leasing(request.job_id, request.run)
        with self._lock:
            now = w.clock()
            job = w.state.find_job(request.cluster, request.job_id)
            lease = None if job is None else w.state.lease(job.logical_job)
            answer = decide(job, lease, request, w.home, now, w.config.lease_ttl_s)
            if answer.verdict is Verdict.REGISTER:
                return LeaseReply(Said.WAIT, "registering the job", retry_s=WAIT_RETRY_S), job
            if answer.verdict is Verdict.FENCED:
                return LeaseReply(Said.FENCED, answer.reason), job
            if answer.verdict is Verdict.WAIT:
                return LeaseReply(Said.WAIT, answer.reason, retry_s=WAIT_RETRY_S), job
            assert job is not None
            if not job.run:  # discovered while pending: the job names its run now
                job = w.state.name_run(job.logical_job, request.run, now)
            return self._grant(job, lease, request, answer.action, answer.reason, now), job

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

    def key(self, token: str) -> Reply:
        """The run's data key, for the incarnation the token was minted for, while it is
        the current generation."""
        w = self.wiring
        owner = w.state.token_owner(token)
        if owner is None:
            return Reply(403, {"reason": "unknown or expired token"})
        job = w.state.job(owner[0])
        if not job.run:
            return Reply(409, {"reason": "ask for a lease first: it names the run"})
        if job.generation != owner[1] or job.status.is_final():
            return Reply(403, {"reason": f"generation {owner[1]} is no longer current"})
        store = w.stores[w.store_of(job.cluster)]
        try:
            data_key = unwrap_run_key(store, w.master_key, job.run, create=True)
        except CkptError as exc:
            return Reply(503, {"reason": str(exc)})
        w.say_once(("key", job.logical_job, str(job.generation)), "key", job.logical_job,
                   f"released run {job.run}'s data key to generation {job.generation} on "
                   f"{job.cluster}", "the job presented its one-time token")
        return Reply(200, KeyReply(job.run, data_key).to_json())

    # --- registration (federation.registration) ------------------------------------------

    def _unregistered_home_job(self, request: LeaseRequest) -> bool:
        return (request.generation == 0 and request.cluster == self.wiring.home
                and self.wiring.state.find_job(request.cluster, request.job_id) is None)

    def discover_pending(self) -> None:
        """Register geo jobs pending at home, so a hopeless queue can be left."""
        self.registrar.discover_pending()
