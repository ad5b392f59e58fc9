"""Registering a home job the daemon has not seen: at its first lease request, or while it
is pending at home (so a hopeless queue can be left); and which job a run belongs to.

Everything comes from what the user cannot forge (federation.owners): the owner from
Slurm's job record, the directives from PrologSlurmctld's registry record (else from
what the SPANK plugin handed Slurm, in the job's stored environment), the environment
from Slurm's copy of it, allow-listed. A job with no directives recorded anywhere is not
a geo job for the daemon (said in one warning line, once); a job Slurm names no uid or
gid for is not registered: it could not run as its owner.

A lease request registers a job only when it is MUNGE-authenticated and the caller's uid
is the one Slurm's record names for that job (federation.authn). A run named by one
logical job is refused to every other, but for a new job of the same owner once the
earlier one is final (a run continued later).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import NoReturn

from slurm_geo.ckpt.errors import CkptError
from slurm_geo.ckpt.format.names import key_name, latest_name, manifest_prefix
from slurm_geo.daemon.events import event
from slurm_geo.errors import SlurmGeoError
from slurm_geo.federation.access.authn import Caller
from slurm_geo.federation.access.lookups import SlurmLookups
from slurm_geo.federation.act.resubmit import script_options
from slurm_geo.federation.decide.owners import accepted_directives, owner_environment
from slurm_geo.federation.model import JobStatus, LogicalJob, RunOwner
from slurm_geo.federation.wiring import Wiring
from slurm_geo.lease.protocol import LeaseRequest, check_run
from slurm_geo.lease.signing import CannotCheck, Forbidden
from slurm_geo.policy.directives import DirectiveError, Directives, parse_options
from slurm_geo.registry import RegistryUnreadable
from slurm_geo.slurm import JobInfo, JobState, Owner, SlurmError
from slurm_geo.slurm.errors import JobNotFound

log = logging.getLogger("slurm_geo.federation")

# Rounds a pending job's environment may be missing (slurmdbd records a job a few
# seconds after its submission) before the daemon stops looking at it.
PENDING_TRIES = 30

Recorded = Mapping[tuple[str, int], Mapping[str, str]]  # (cluster, job id) -> directives


class NotRegistered(SlurmGeoError):
    """A home job asked for a lease, and the daemon will not take it on (nothing of it
    changes; the reason says why)."""


@dataclass(frozen=True)
class Found:
    """What registration learnt of a geo job from Slurm and the registry."""

    info: JobInfo
    owner: Owner
    directives: Directives        # as Slurm validated them
    environment: dict[str, str]   # the owner's, allow-listed


def run_taken_by(others: list[LogicalJob], run: str, logical_job: str | None,
                 uid: int | None, stored_in: str | None = None,
                 assigned: RunOwner | None = None) -> str | None:
    """Why `run` may not be named by `logical_job` of `uid`, given every job that names
    it (`others`), the store that already holds something of it (`stored_in`: its key,
    latest pointer or manifests; None: nothing anywhere) and an admin's assignment of it
    (`assigned`, federation.runowners); None when it may. Pure.

    A run's recorded owner is the owner an admin gave it to, else the owner of the jobs
    of the federation that name it: a run already in a store that no job names has none
    (written by an operator, an older slurm-geo, a job that never leased), and nobody may
    take it over, its key included, until an admin gives it to someone."""
    for other in others:
        if other.logical_job == logical_job:
            continue
        if other.status.is_final() and assigned is not None:
            continue  # the admin's assignment decides whose the run is now
        if other.status.is_final() and uid is not None and other.owner is not None \
                and other.owner.uid == uid:
            continue  # its owner continues the run in a new job
        return f"run {run} belongs to logical job {other.logical_job}"
    if assigned is not None:
        if uid is not None and uid == assigned.owner.uid:
            return None
        return (f"run {run} belongs to {assigned.owner.user} (given by an admin), not to "
                f"uid {uid}")
    if not others and stored_in is not None:
        return (f"run {run} is already in store {stored_in} and no job of the federation "
                "names it, so it has no recorded owner to continue it; name a new run")
    return None


def store_holding(wiring: Wiring, run: str) -> str | None:
    """The first store (by name) that holds something of `run`: its key, latest pointer
    or a manifest; None when none does. CannotCheck (503) if a store fails."""
    for name, store in sorted(wiring.stores.items()):
        try:
            if store.exists(key_name(run)) or store.exists(latest_name(run)) \
                    or store.list(manifest_prefix(run)):
                return name
        except CkptError as exc:
            raise CannotCheck(f"cannot tell whether store {name} holds run {run}: "
                              f"{exc}") from None
    return None


def not_the_callers(tag: str, info: JobInfo, caller: Caller) -> str | None:
    """Why home job `info` is not `caller`'s (by the uid Slurm's record names); None when
    it is. Pure."""
    owner = info.owner
    if owner is None:
        return (f"job {tag}: Slurm's record of it names no user, uid and gid, so it could "
                "not run as its owner; not registered")
    if owner.uid != caller.uid:
        return f"{tag} belongs to {owner.user}, not to uid {caller.uid}"
    return None


class Registrar:
    """`generation_lock`: the lease service's; a run is checked and its job added under
    it, so two jobs cannot both take one run. Slurm is never called under it."""

    def __init__(self, wiring: Wiring, generation_lock: threading.Lock):
        self.wiring = wiring
        self._lock = generation_lock
        self._seen_pending: set[int] = set()
        self._pending_tries: dict[int, int] = {}
        self._env_tries: dict[str, int] = {}
        self._refused: dict[int, str] = {}  # job id -> why, said once
        self.lookups = SlurmLookups(wiring.clock)  # what callers make it ask Slurm

    def check_run(self, run: str, logical_job: str | None, uid: int | None,
                  stored_in: str | None = None) -> None:
        """Forbidden unless `run` may be named by `logical_job` of `uid` (`stored_in`: what
        `stored_in` said, read before the lock); ProtocolError for a run id that is none."""
        if not run:
            return
        check_run(run)
        taken = run_taken_by(self.wiring.state.find_by_run(run), run, logical_job, uid,
                             stored_in, self.wiring.state.identities.run_owner(run))
        if taken is not None:
            raise Forbidden(taken)

    def stored_in(self, run: str) -> str | None:
        """The store that holds something of `run` (its key, latest pointer or a manifest)
        when no job of the federation names it yet; None when one does or nothing is
        stored. Store reads: never under the lock. CannotCheck (503) if a store fails."""
        if not run or self.wiring.state.find_by_run(check_run(run)):
            return None
        return store_holding(self.wiring, run)

    def admit_home(self, request: LeaseRequest, caller: Caller) -> None:
        """A MUNGE-authenticated request: for generation 0 of a home job the caller owns.
        Registers the job at its first request (or NotRegistered saying why); a job
        registered before owners were recorded gets its owner from Slurm's record now.
        Slurm calls: not under the lock."""
        w = self.wiring
        if request.cluster != w.home or request.generation != 0:
            raise Forbidden("a MUNGE credential speaks only for generation 0 of a job on the "
                            f"home cluster {w.home}; an incarnation the daemon submitted "
                            "signs with its secret")
        job = w.state.find_job(w.home, request.job_id)
        if job is None:
            self._register_leasing(request.job_id, request.run, caller)
        elif job.owner is None and first_home_job_id(w, job) == request.job_id:
            self.lookups.may_ask(str(caller), w.home, request.job_id)
            info = self._owned_by(request.job_id, caller)
            assert info.owner is not None
            w.state.identities.claim_owner(
                job.logical_job, info.owner,
                owner_environment(self._environment(request.job_id, quiet=False)))

    def _owned_by(self, job_id: int, caller: Caller) -> JobInfo:
        """Slurm's record of home job `job_id`, if it names the caller's uid as its owner."""
        w = self.wiring
        try:
            info = w.clients[w.home].job(job_id)
        except JobNotFound:
            raise self.lookups.not_found(w.home, job_id) from None
        why = not_the_callers(f"{w.home}:{job_id}", info, caller)
        if why is not None:
            raise Forbidden(why)
        return info

    def _register_leasing(self, job_id: int, run: str, caller: Caller) -> None:
        """A home job's first lease request: register it, or NotRegistered saying why. Each
        costs the caller one of its Slurm lookups (federation.lookups: 404, 429)."""
        self.lookups.may_ask(str(caller), self.wiring.home, job_id)
        info = self._owned_by(job_id, caller)  # another's job: refused, never remembered
        if job_id in self._refused:
            raise NotRegistered(self._refused[job_id])
        # Another's run, or one already stored that no job names, is refused at once (403),
        # not after slurmdbd's wait below; checked again under the lock, where it counts.
        stored_in = self.stored_in(run)
        self.check_run(run, None, caller.uid, stored_in)
        # Its later incarnations run with the environment it was submitted with, which
        # slurmdbd records seconds after submission: the job waits for its lease until
        # then (the trainer asks again each second), for at most PENDING_TRIES requests.
        environment = self._pending_environment(job_id)
        if environment is None:
            raise NotRegistered(f"job {self.wiring.home}:{job_id}: slurmdbd has not recorded "
                                "it yet (it does seconds after submission); ask again")
        found = self._find(info, self._recorded(), environment=environment)
        if isinstance(found, str):
            self._refuse(job_id, found)
        job = self._job(found, run)
        with self._lock:
            self.check_run(run, None, caller.uid, stored_in)
            self._add(job, "first lease request of a home job")

    def discover_pending(self) -> None:
        """Register geo jobs pending at home that ask --geo-failover and --geo-ckpt-dir.
        Each pending job is looked at once, once Slurm has recorded its environment."""
        w = self.wiring
        fresh = [info for info in w.clients[w.home].jobs()
                 if info.state is JobState.PENDING and info.job_id not in self._seen_pending]
        if not fresh:
            return
        try:
            recorded = self._recorded()
        except RegistryUnreadable as exc:  # read again next round
            event(log, "registry_unreadable", logging.WARNING, error=exc)
            return
        for info in fresh:
            if w.state.find_job(w.home, info.job_id) is not None:
                self._seen_pending.add(info.job_id)
                continue
            environment = self._pending_environment(info.job_id)
            if environment is None:
                continue  # slurmdbd has no record of it yet: look again next round
            self._seen_pending.add(info.job_id)
            try:
                found = self._find(info, recorded, quiet=True, environment=environment)
                if not isinstance(found, Found) or not found.directives.ckpt_dir \
                        or found.directives.failover not in ("auto", "manual"):
                    continue
                job = self._job(found, "")
            except SlurmError:
                continue
            with self._lock:
                self._add(job, "a geo job pending on the home cluster")

    def learn_environments(self, jobs: list[LogicalJob]) -> None:
        """Jobs registered before slurmdbd recorded their environment get it now, while
        their first home job is still in accounting, so later incarnations run with what
        the owner submitted with (PATH, virtualenv) and not Slurm's bare default."""
        for job in jobs:
            if job.owner_env or job.owner is None or job.status.is_final():
                continue
            if self._env_tries.get(job.logical_job, 0) >= PENDING_TRIES:
                continue
            if not learn_environment(self.wiring, job):
                self._env_tries[job.logical_job] = self._env_tries.get(job.logical_job, 0) + 1

    # --- inside ----------------------------------------------------------------------------

    def _recorded(self) -> dict[tuple[str, int], Mapping[str, str]]:
        registry = self.wiring.registry
        if registry is None:
            return {}
        return {(job.cluster, job.job_id): job.directives for job in registry.jobs()}

    def _pending_environment(self, job_id: int) -> dict[str, str] | None:
        """Slurm's copy of a pending job's environment (where its directives are); None
        while slurmdbd has not recorded the job yet, which takes a few seconds after
        submission, for at most PENDING_TRIES rounds; then {} (looked at no more)."""
        try:
            return self.wiring.clients[self.wiring.home].batch_environment(job_id)
        except SlurmError:
            tries = self._pending_tries.get(job_id, 0) + 1
            self._pending_tries[job_id] = tries
            return None if tries < PENDING_TRIES else {}

    def _find(self, info: JobInfo, recorded: Recorded, quiet: bool = False,
              environment: dict[str, str] | None = None) -> Found | str:
        """The job's registration, or why there is none."""
        w = self.wiring
        tag = f"{w.home}:{info.job_id}"
        owner = info.owner
        if owner is None:
            return (f"job {tag}: Slurm's record of it names no user, uid and gid, so it "
                    "could not run as its owner; not registered")
        if environment is None:
            environment = self._environment(info.job_id, quiet)
        directives = recorded.get((w.home, info.job_id)) or accepted_directives(environment)
        if not directives:
            return (f"job {tag}: no --geo-* directives recorded for it (no PrologSlurmctld "
                    "registry record, none in Slurm's copy of its environment), so it is not "
                    "a geo job for the daemon; an indented #SBATCH line is one sbatch "
                    "ignored")
        try:
            parsed = parse_options(directives)
        except DirectiveError as exc:
            return f"job {tag}: {exc}"
        return Found(info, owner, parsed, owner_environment(environment))

    def _environment(self, job_id: int, quiet: bool) -> dict[str, str]:
        """Slurm's copy of the job's environment; {} where it keeps none (said once)."""
        try:
            return self.wiring.clients[self.wiring.home].batch_environment(job_id)
        except SlurmError as exc:
            if not quiet:
                event(log, "batch_environment_unknown", logging.WARNING,
                      job=f"{self.wiring.home}:{job_id}", error=exc)
            return {}

    def _refuse(self, job_id: int, why: str) -> NoReturn:
        self._refused[job_id] = why
        event(log, "not_registered", logging.WARNING, job=f"{self.wiring.home}:{job_id}",
              why=why)
        raise NotRegistered(why)

    def _job(self, found: Found, run: str) -> LogicalJob:
        """The logical job `found` becomes (reads its batch script from Slurm)."""
        w = self.wiring
        now = w.clock()
        job_id = found.info.job_id
        script = w.clients[w.home].batch_script(job_id)
        options = replace(script_options(script), submit_dir=found.info.work_dir) \
            .with_directives(found.directives.as_options())
        return LogicalJob(logical_job=f"{w.home}-{job_id}", run=run, home=w.home, script=script,
                          spec=options.to_json(), directives=found.directives.as_options(),
                          generation=0, cluster=w.home, job_id=job_id, resume_step=None,
                          status=JobStatus.RUNNING, created_at=now, updated_at=now,
                          owner=found.owner, owner_env=found.environment)

    def _add(self, job: LogicalJob, why: str) -> None:
        """Under the generation lock."""
        w = self.wiring
        owner = job.owner
        assert owner is not None and job.job_id is not None
        if w.state.add_job(job):
            w.audit.append("register", job.logical_job, f"registered {w.home}:{job.job_id}"
                           + (f" (run {job.run})" if job.run else "") + f" of {owner.user}",
                           why, cluster=w.home, job_id=job.job_id, run=job.run,
                           directives=job.directives, owner=owner.user, uid=owner.uid,
                           gid=owner.gid)


def learn_environment(wiring: Wiring, job: LogicalJob) -> bool:
    """Read the environment the owner submitted the job's first home incarnation with from
    slurmdbd, and record it; False while slurmdbd has none (or cannot be asked)."""
    first = first_home_job_id(wiring, job)
    if first is None:
        return False
    try:
        environment = owner_environment(wiring.clients[wiring.home].batch_environment(first))
    except SlurmError:
        return False
    if environment:
        wiring.state.identities.learn_environment(job.logical_job, environment)
    return bool(environment)


def first_home_job_id(wiring: Wiring, job: LogicalJob) -> int | None:
    """The Slurm job of the logical job's generation 0, if it was a home job."""
    first = wiring.state.incarnations(job.logical_job)[0]
    return first.job_id if first.cluster == wiring.home else None
