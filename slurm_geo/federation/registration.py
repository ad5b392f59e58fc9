"""Home jobs the daemon has not seen yet become logical jobs, owned by the user Slurm's
record names, and runs belong to the job that named them first.

A job registers at its first lease request (MUNGE-authenticated: the caller's uid must be
the owner Slurm records for that job) or while pending at home (discovery: a geo job
that asks --geo-failover and --geo-ckpt-dir). Either way the owner comes from Slurm, never
from the request. A run named by one logical job is refused to every other, but for a
new job of the same owner once the earlier one is final (a run continued later).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from slurm_geo.errors import SlurmGeoError
from slurm_geo.federation.authn import Caller
from slurm_geo.federation.model import JobStatus, LogicalJob
from slurm_geo.federation.resubmit import ScriptOptions, script_options
from slurm_geo.federation.wiring import Wiring
from slurm_geo.lease.protocol import LeaseRequest
from slurm_geo.lease.signing import Forbidden
from slurm_geo.policy.directives import DirectiveError
from slurm_geo.slurm import JobState, SlurmError
from slurm_geo.slurm.errors import JobNotFound


def run_taken_by(others: list[LogicalJob], run: str, logical_job: str | None,
                 uid: int | None) -> str | None:
    """Why `run` may not be named by `logical_job` of `uid`, given every job that names
    it (`others`); None when it may. Pure."""
    for other in others:
        if other.logical_job == logical_job:
            continue
        if other.status.is_final() and uid is not None and other.owner_uid == uid:
            continue  # its owner continues the run in a new job
        return f"run {run} belongs to logical job {other.logical_job}"
    return None


class Registrar:
    def __init__(self, wiring: Wiring, generation_lock: threading.Lock,
                 uid_of: Callable[[str], int | None]):
        self.wiring = wiring
        self._lock = generation_lock
        self.uid_of = uid_of
        self._seen_pending: set[int] = set()

    def check_run(self, run: str, logical_job: str | None, uid: int | None) -> None:
        if not run:
            return
        taken = run_taken_by(self.wiring.state.find_by_run(run), run, logical_job, uid)
        if taken is not None:
            raise Forbidden(taken)

    def admit_home(self, request: LeaseRequest, caller: Caller) -> None:
        """A MUNGE-authenticated request: for generation 0 of a home job the caller owns.
        Registers the job at its first request; a job registered before owners were
        recorded gets its owner from Slurm's record now. Slurm calls: not under the lock."""
        w = self.wiring
        if request.cluster != w.home or request.generation != 0:
            raise Forbidden("a MUNGE credential speaks only for generation 0 of a job on the "
                            f"home cluster {w.home}; an incarnation the daemon submitted "
                            "signs with its secret")
        job = w.state.find_job(w.home, request.job_id)
        if job is None:
            self._register(request, caller)
        elif job.owner_uid is None and self._first_job_id(job) == request.job_id:
            user = self._owner_is(request.job_id, caller)
            assert caller.uid is not None
            w.state.identities.claim_owner(job.logical_job, caller.uid, user)

    def _first_job_id(self, job: LogicalJob) -> int | None:
        first = self.wiring.state.incarnations(job.logical_job)[0]
        return first.job_id if first.cluster == self.wiring.home else None

    def _owner_is(self, job_id: int, caller: Caller) -> str:
        """The user Slurm says owns home job `job_id`, if that is the caller's uid."""
        w = self.wiring
        try:
            user = w.clients[w.home].job(job_id).user
        except JobNotFound:
            raise Forbidden(f"{w.home} has no job {job_id}") from None
        if self.uid_of(user) != caller.uid:
            raise Forbidden(f"{w.home}:{job_id} belongs to {user}, not to uid {caller.uid}")
        return user

    def _register(self, request: LeaseRequest, caller: Caller) -> None:
        w = self.wiring
        user = self._owner_is(request.job_id, caller)
        script = w.clients[w.home].batch_script(request.job_id)
        options = script_options(script)
        try:
            options.directives()
        except DirectiveError as exc:
            raise SlurmGeoError(f"job {w.home}:{request.job_id}: {exc}") from None
        with self._lock:
            self.check_run(request.run, None, caller.uid)
            self._add(request.job_id, request.run, script, options, (caller.uid, user),
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
                with self._lock:
                    self._add(info.job_id, "", script, options,
                              (self.uid_of(info.user), info.user),
                              "a geo job pending on the home cluster")

    def _add(self, job_id: int, run: str, script: str, options: ScriptOptions,
             owner: tuple[int | None, str], why: str) -> None:
        w = self.wiring
        now = w.clock()
        logical = f"{w.home}-{job_id}"
        job = LogicalJob(logical, run, w.home, script, options.to_json(),
                         options.directives().as_options(), 0, w.home, job_id, None,
                         JobStatus.RUNNING, created_at=now, updated_at=now,
                         owner_uid=owner[0], owner_user=owner[1])
        if w.state.add_job(job):
            w.audit.append("register", logical, f"registered {w.home}:{job_id}"
                           + (f" (run {run})" if run else "") + f" for {owner[1]}", why,
                           cluster=w.home, job_id=job_id, run=run, directives=job.directives,
                           owner=owner[1], owner_uid=owner[0])
