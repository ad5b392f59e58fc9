"""Registering a home job the daemon has not seen: at its first lease request, or while it
is pending at home (so a hopeless queue can be left).

Everything comes from what the user cannot forge (federation.owners): the owner from
Slurm's job record, the directives from PrologSlurmctld's registry record (else from
what the SPANK plugin handed Slurm, in the job's stored environment), the environment
from Slurm's copy of it, allow-listed. A job with no directives recorded anywhere is not
a geo job for the daemon (said in one warning line, once); a job Slurm names no uid or
gid for is not registered: it could not run as its owner.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NoReturn

from slurm_geo.daemon.events import event
from slurm_geo.errors import SlurmGeoError
from slurm_geo.federation.model import JobStatus, LogicalJob
from slurm_geo.federation.owners import accepted_directives, owner_environment
from slurm_geo.federation.resubmit import script_options
from slurm_geo.federation.wiring import Wiring
from slurm_geo.policy.directives import DirectiveError, Directives, parse_options
from slurm_geo.registry import RegistryUnreadable
from slurm_geo.slurm import JobInfo, JobState, Owner, SlurmError

log = logging.getLogger("slurm_geo.federation")

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


class Registrar:
    def __init__(self, wiring: Wiring):
        self.wiring = wiring
        self._seen_pending: set[int] = set()
        self._refused: dict[int, str] = {}  # job id -> why, said once

    def register_leasing(self, job_id: int, run: str) -> None:
        """A home job's first lease request: register it, or NotRegistered saying why."""
        if job_id in self._refused:
            raise NotRegistered(self._refused[job_id])
        info = self.wiring.clients[self.wiring.home].job(job_id)
        found = self._find(info, self._recorded())
        if isinstance(found, str):
            self._refuse(job_id, found)
        self._add(found, run, "first lease request of a home job")

    def discover_pending(self) -> None:
        """Register geo jobs pending at home that ask --geo-failover and --geo-ckpt-dir.
        Each pending job is looked at once."""
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
            self._seen_pending.add(info.job_id)
            if w.state.find_job(w.home, info.job_id) is not None:
                continue
            try:
                found = self._find(info, recorded, quiet=True)
            except SlurmError:
                continue
            if isinstance(found, Found) and found.directives.ckpt_dir \
                    and found.directives.failover in ("auto", "manual"):
                self._add(found, "", "a geo job pending on the home cluster")

    # --- inside ----------------------------------------------------------------------------

    def _recorded(self) -> dict[tuple[str, int], Mapping[str, str]]:
        registry = self.wiring.registry
        if registry is None:
            return {}
        return {(job.cluster, job.job_id): job.directives for job in registry.jobs()}

    def _find(self, info: JobInfo, recorded: Recorded, quiet: bool = False) -> Found | str:
        """The job's registration, or why there is none."""
        w = self.wiring
        tag = f"{w.home}:{info.job_id}"
        owner = info.owner
        if owner is None:
            return (f"job {tag}: Slurm's record of it names no user, uid and gid, so it "
                    "could not run as its owner; not registered")
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

    def _add(self, found: Found, run: str, why: str) -> None:
        w = self.wiring
        now = w.clock()
        job_id, owner = found.info.job_id, found.owner
        script = w.clients[w.home].batch_script(job_id)
        options = script_options(script).with_directives(found.directives.as_options())
        logical = f"{w.home}-{job_id}"
        job = LogicalJob(logical, run, w.home, script, options.to_json(),
                         found.directives.as_options(), 0, w.home, job_id, None,
                         JobStatus.RUNNING, created_at=now, updated_at=now, owner=owner,
                         owner_env=found.environment)
        if w.state.add_job(job):
            w.audit.append("register", logical, f"registered {w.home}:{job_id}"
                           + (f" (run {run})" if run else "") + f" of {owner.user}", why,
                           cluster=w.home, job_id=job_id, run=run, directives=job.directives,
                           owner=owner.user, uid=owner.uid, gid=owner.gid)
