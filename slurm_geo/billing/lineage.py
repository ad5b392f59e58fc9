"""Whose is it: the logical job a Slurm job or a checkpoint transfer belongs to. Pure.

Three records say it, the most direct first:

- the federation daemon's: its state (each logical job's run, owner and --geo-*
  directives, and every incarnation it ran as) and its audit log (`register` entries name
  the home job, the run and the directives; `requeue` and `resubmit` entries each Slurm
  job it submitted, on any cluster). A leg the daemon submitted through slurmrestd never
  passes through the registry's PrologSlurmctld: only these records know it;
- checkpoint-sync's `sources`: which registered jobs named a job directory it replicates
  as the root `file://<real path>`;
- the controller's registry: every geo job that started there, with its directives.

A transfer is charged by its run first, whichever store the bytes came from (a sync root
such as `pfs`, a job directory, the off-site store read back): the daemon binds each run
to one logical job, while a store or a directory is shared by many jobs. Only a run no
federated job names falls back to the job directory, then to a directory named after the
run (`--geo-ckpt-dir=/pfs/ckpt/RUN`).
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple

from slurm_geo.billing.attribution import RegistryJob

if TYPE_CHECKING:
    from slurm_geo.federation.model import Incarnation, LogicalJob
    from slurm_geo.federation.state.audit import Entry

FILE = "file://"
COST_CENTER = "geo-cost-center"
# Audit entries in which the daemon names a Slurm job of its own making (never a
# requester's claim: a refused request's entry may name any job).
LEG_KINDS = ("register", "requeue", "resubmit")
TRAINED = "lease"  # the daemon granted a leg its lease: the leg was running then


class Leg(NamedTuple):
    """One Slurm job of a logical job, when it began (registered or submitted), and when
    the daemon first granted it a lease (None: never, or not known)."""

    cluster: str
    job_id: int
    since: float
    trained_since: float | None = None


@dataclass(frozen=True)
class FederatedJob:
    """What the federation daemon's records say of one logical job."""

    logical_id: str
    run: str = ""
    user: str = ""
    cost_center: str = ""       # its --geo-cost-center; "" when none was given
    since: float = 0.0          # registered
    legs: tuple[Leg, ...] = ()  # oldest first


class LegOwner(NamedTuple):
    """What an accounting record needs of its Slurm job's logical job."""

    logical_id: str
    cost_center: str  # the --geo-cost-center it was registered with; "" when none
    trained_since: float | None = None  # its first lease, by the daemon's audit log


@dataclass(frozen=True)
class Attribution:
    """Whom a transfer is charged to. `basis` says which record decided it: "federation"
    (its run), "job directory", "run directory", or "none" (nobody is known)."""

    logical_id: str = ""
    cluster: str = ""
    job_id: int | None = None
    user: str = ""
    cost_center: str = ""
    basis: str = "none"


# --- the federation's records -------------------------------------------------------------

@dataclass
class _Draft:
    run: str = ""
    user: str = ""
    cost_center: str = ""
    since: float = 0.0
    legs: dict[tuple[str, int], float] = field(default_factory=dict)
    trained: dict[tuple[str, int], float] = field(default_factory=dict)

    def leg(self, cluster: str, job_id: int, since: float) -> None:
        key = (cluster, job_id)
        self.legs[key] = min(self.legs.get(key, since), since)

    def lease(self, cluster: str, job_id: int, when: float) -> None:
        key = (cluster, job_id)
        self.trained[key] = min(self.trained.get(key, when), when)


def from_audit(entries: Iterable[Entry]) -> list[FederatedJob]:
    """Each logical job as the audit log tells it (entries oldest first)."""
    drafts: dict[str, _Draft] = {}
    for entry in entries:
        if not entry.logical_job or entry.kind not in (*LEG_KINDS, TRAINED, "transfer"):
            continue
        detail, when = entry.detail, entry.unix_time
        draft = drafts.setdefault(entry.logical_job, _Draft(since=when))
        run = detail.get("run")
        if isinstance(run, str) and run and not draft.run:
            draft.run = run
        if entry.kind == "register":
            directives = detail.get("directives")
            if isinstance(directives, Mapping):
                draft.cost_center = str(directives.get(COST_CENTER, "")) or draft.cost_center
            draft.user = str(detail.get("owner") or draft.user)
            draft.since = min(draft.since, when)
        cluster, job_id = detail.get("cluster"), detail.get("job_id")
        if isinstance(cluster, str) and isinstance(job_id, int) \
                and not isinstance(job_id, bool) and job_id > 0:
            if entry.kind in LEG_KINDS:
                draft.leg(cluster, job_id, when)
            elif entry.kind == TRAINED:
                draft.lease(cluster, job_id, when)
    return [_freeze(name, draft) for name, draft in drafts.items()]


def from_state(jobs: Iterable[LogicalJob],
               incarnations: Mapping[str, Sequence[Incarnation]]) -> list[FederatedJob]:
    """Each logical job as the daemon's state holds it now."""
    found = []
    for job in jobs:
        draft = _Draft(job.run, job.owner.user if job.owner else "",
                       str(job.directives.get(COST_CENTER, "")), job.created_at)
        for incarnation in incarnations.get(job.logical_job, ()):
            if incarnation.job_id is not None:  # None: being submitted
                draft.leg(incarnation.cluster, incarnation.job_id, incarnation.submitted_at)
        found.append(_freeze(job.logical_job, draft))
    return found


def merge(*sources: Iterable[FederatedJob]) -> list[FederatedJob]:
    """One record per logical job: the first source that knows a field gives it (pass the
    state before the audit log: it is the daemon's own view), legs are the union."""
    merged: dict[str, FederatedJob] = {}
    for source in sources:
        for job in source:
            known = merged.get(job.logical_id)
            if known is None:
                merged[job.logical_id] = job
                continue
            legs = {(leg.cluster, leg.job_id): leg for leg in job.legs}
            for leg in known.legs:
                other = legs.get((leg.cluster, leg.job_id))
                legs[(leg.cluster, leg.job_id)] = _one_leg(leg, other) if other else leg
            merged[job.logical_id] = replace(
                known, run=known.run or job.run, user=known.user or job.user,
                cost_center=known.cost_center or job.cost_center,
                since=min(known.since, job.since), legs=tuple(sorted(legs.values(), key=_since)))
    return sorted(merged.values(), key=lambda j: (j.since, j.logical_id))


def _one_leg(leg: Leg, other: Leg) -> Leg:
    """Two sources' records of one leg: the earlier start, and the first lease whichever
    knows it (the state records no lease: dropping the audit log's would bill a leg whose
    start Slurm lost from the wrong moment)."""
    first = min(leg, other, key=_since)
    trained = [t for t in (leg.trained_since, other.trained_since) if t is not None]
    return first._replace(trained_since=min(trained, default=None))


def _freeze(logical_id: str, draft: _Draft) -> FederatedJob:
    legs = sorted((Leg(c, j, t, draft.trained.get((c, j))) for (c, j), t in draft.legs.items()),
                  key=_since)
    return FederatedJob(logical_id, draft.run, draft.user, draft.cost_center, draft.since,
                        tuple(legs))


def _since(leg: Leg) -> tuple[float, str, int]:
    return (leg.since, leg.cluster, leg.job_id)


# --- the index -------------------------------------------------------------------------------

class Owners:
    """Every record of who owns what, indexed once per ingest (a month holds hundreds of
    thousands of records; each is looked up in constant time)."""

    def __init__(self, federated: Iterable[FederatedJob] = (),
                 registry: Iterable[RegistryJob] = (),
                 registry_lineage: Mapping[tuple[str, int], str] | None = None):
        self.federated = list(federated)
        self.registry = list(registry)
        self.registry_lineage = dict(registry_lineage or {})
        self.by_logical = {job.logical_id: job for job in self.federated}
        self.by_run: dict[str, list[FederatedJob]] = {}
        self.by_leg: dict[tuple[str, int], FederatedJob] = {}
        for job in self.federated:  # oldest first: a leg stays with its first logical job
            if job.run:
                self.by_run.setdefault(job.run, []).append(job)
            for leg in job.legs:
                self.by_leg.setdefault((leg.cluster, leg.job_id), job)
        self.by_tag = {(j.cluster, j.job_id): j for j in self.registry}
        self.by_dir: dict[str, list[RegistryJob]] = {}
        self.by_dir_name: dict[str, list[RegistryJob]] = {}
        for registered in self.registry:
            if registered.ckpt_dir:
                path = _normal(registered.ckpt_dir)
                self.by_dir.setdefault(path, []).append(registered)
                self.by_dir_name.setdefault(posixpath.basename(path), []).append(registered)

    def cost_center(self, job: FederatedJob) -> str:
        """The logical job's --geo-cost-center: as the daemon recorded it, else as the
        registry recorded it for one of its legs."""
        if job.cost_center:
            return job.cost_center
        for leg in job.legs:
            known = self.by_tag.get((leg.cluster, leg.job_id))
            if known is not None and known.cost_center:
                return known.cost_center
        return ""

    def lineage(self) -> dict[tuple[str, int], LegOwner]:
        """(cluster, job id) -> its logical job, for every Slurm job any record knows: the
        daemon's id (`onprem-50`, for every leg it knows, moved ones included) over the
        registry's lineage (`onprem:50`)."""
        found = {key: LegOwner(logical, self.by_tag[key].cost_center
                               if key in self.by_tag else "")
                 for key, logical in self.registry_lineage.items()}
        for key, job in self.by_tag.items():
            found.setdefault(key, LegOwner(job.logical_id, job.cost_center))
        for federated in self.federated:
            for leg in federated.legs:
                key = (leg.cluster, leg.job_id)
                if self.by_leg.get(key) is federated:
                    found[key] = LegOwner(federated.logical_id, self.cost_center(federated),
                                          leg.trained_since)
        return found


def attribute(transfer: Mapping[str, Any], owners: Owners,
              job_dirs: Mapping[str, Sequence[str]] | None = None) -> Attribution:
    """Whom one transfer is charged to. `transfer`: checkpoint-sync's row (run, source,
    destination, finished_at), or the daemon's copy (with its `logical_job`); `job_dirs`:
    checkpoint-sync's job roots -> the "cluster:job_id" of the jobs that named them."""
    moment = float(transfer["finished_at"])
    named = owners.by_logical.get(transfer.get("logical_job") or "")
    federated = [named] if named else owners.by_run.get(transfer["run"], [])
    if not federated:
        return _registered(transfer, owners, job_dirs or {}, moment)
    found = _federated(_current(federated, moment), owners, moment)
    if found.cost_center:
        return found
    by_directory = _registered(transfer, owners, job_dirs or {}, moment)
    if not by_directory.cost_center:
        return found
    # Records that name the run but not the directives it was registered with (an audit
    # log of an older daemon): the registry knows the job by its directory.
    return replace(found, cost_center=by_directory.cost_center,
                   user=found.user or by_directory.user)


def _registered(transfer: Mapping[str, Any], owners: Owners,
                job_dirs: Mapping[str, Sequence[str]], moment: float) -> Attribution:
    """The registry's job for the transfer: by its job directory, else by a directory named
    after its run."""
    job = _latest(_by_directory(transfer, owners, job_dirs), moment)
    basis = "job directory"
    if job is None:
        job = _latest(owners.by_dir_name.get(transfer["run"], []), moment)
        basis = "run directory"
    if job is None:
        return Attribution()
    if (job.cluster, job.job_id) in owners.by_leg:  # a federated job's home leg
        return _federated(owners.by_leg[(job.cluster, job.job_id)], owners, moment, basis)
    return Attribution(owners.registry_lineage.get((job.cluster, job.job_id), job.logical_id),
                       job.cluster, job.job_id, job.user, job.cost_center, basis)


def _federated(job: FederatedJob, owners: Owners, moment: float,
               basis: str = "federation") -> Attribution:
    """Charged to the leg that was current when the transfer finished (the first one for
    a transfer from before the job's records begin: clocks of two hosts differ)."""
    legs = [leg for leg in job.legs if leg.since <= moment] or list(job.legs[:1])
    cluster, job_id = (legs[-1].cluster, legs[-1].job_id) if legs else ("", None)
    user = job.user
    if not user and job_id is not None and (cluster, job_id) in owners.by_tag:
        user = owners.by_tag[(cluster, job_id)].user
    return Attribution(job.logical_id, cluster, job_id, user, owners.cost_center(job), basis)


def _current(jobs: Sequence[FederatedJob], moment: float) -> FederatedJob:
    """Of the logical jobs that named one run (a run continued by a new job once the
    earlier one ended), the latest registered by `moment`; else the first."""
    before = [j for j in jobs if j.since <= moment]
    return before[-1] if before else jobs[0]


def _by_directory(transfer: Mapping[str, Any], owners: Owners,
                  job_dirs: Mapping[str, Sequence[str]]) -> list[RegistryJob]:
    """Registry jobs whose checkpoint directory is the transfer's root: the uploads' source,
    the verification reads' destination, when it is a job directory (`file://PATH`)."""
    found: list[RegistryJob] = []
    for root in (transfer.get("source") or "", transfer.get("destination") or ""):
        if not root.startswith(FILE):
            continue
        for tag in job_dirs.get(root, ()):
            cluster, _, job_id = tag.rpartition(":")
            job = owners.by_tag.get((cluster, int(job_id))) if job_id.isdigit() else None
            if job is not None:
                found.append(job)
        found += owners.by_dir.get(_normal(root.removeprefix(FILE)), [])
    return found


def _latest(jobs: Iterable[RegistryJob], moment: float) -> RegistryJob | None:
    """The job that started last by `moment` (a directory reused by later jobs); else the
    first to start."""
    ordered = sorted(set(jobs), key=lambda j: (j.first_seen, j.cluster, j.job_id))
    before = [j for j in ordered if j.first_seen <= moment]
    return before[-1] if before else (ordered[0] if ordered else None)


def _normal(path: str) -> str:
    return posixpath.normpath(path) if path else path
