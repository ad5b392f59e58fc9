"""Which registered job directories checkpoint-sync replicates: pure decisions.

A geo job's `--geo-ckpt-dir` is a checkpoint repository of its own: the trainer opens it
as its store (`--store "$SLURM_GEO_CKPT_DIR"`), so `manifests/`, `packs/` and `keys/` of its
runs sit right in it. A configured root is such a repository too, and its scan lists only
its own `manifests/`, so a job directory *inside* a root is another repository the root
never sees. checkpoint-sync therefore replicates each job directory as a root of its own,
named `file://<its real path>`, except the very directory of a configured root, which that
root already replicates (it is not replicated twice).

A job's directives still hold: a `--geo-residency` or data class that forbids the
destination's region keeps its checkpoints home. The daemon runs as root and the path is
the user's choice, so a directory is read only when one of its jobs' users owns it:
naming someone else's directory (or a link to it) replicates nothing.

`slurm_geo.sync.sources` gathers the facts (the registry, real paths, owners); what follows
from them is decided here, and the node epilog tells the job the same (`protection`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum

from slurm_geo.policy.directives import DirectiveError, Directives, parse_options, quote
from slurm_geo.policy.geo import GeoPolicy

FILE = "file://"
# A directory is let go once a scan that began this long after its jobs' last end read it
# (the final checkpoint is committed before the end; the margin covers the controller's
# clock against this host's), or, when it could not be read since, a day after that end.
RELEASE_AFTER_S = 300.0
GIVE_UP_AFTER_S = 86400.0


class SourceStatus(Enum):
    """What the daemon last saw of a place it reads from (slurm_geo.sync.sources); the
    `sources` table of its state database keeps it."""

    WATCHED = "watched"        # scanned every poll
    UNREADABLE = "unreadable"  # should be scanned, but cannot be read: nothing replicates
    COVERED = "covered"        # a job directory that is a configured root: replicated as it
    KEPT_HOME = "kept_home"    # the job's residency or data class forbids the destination
    INVALID = "invalid"        # a job directory that cannot be replicated as registered
    CONFLICT = "conflict"      # it holds a run another source already replicates
    RELEASED = "released"      # no longer scanned: its jobs ended and nothing is owed

    @property
    def is_problem(self) -> bool:
        """A replication the registry or the config asks for that cannot happen."""
        return self in (SourceStatus.UNREADABLE, SourceStatus.INVALID, SourceStatus.CONFLICT)


@dataclass(frozen=True)
class JobDir:
    """A registered geo job's checkpoint directory, with the facts the daemon found."""

    tag: str                        # cluster:job_id
    cluster: str
    user: str
    path: str                       # as registered
    real_path: str                  # symbolic links resolved
    directives: Mapping[str, str]   # as registered: option -> value
    running: bool
    last_seen: float                # the newest start or end of one of its incarnations


@dataclass(frozen=True)
class SyncSite:
    """What the decisions need of checkpoint-sync's configuration."""

    home_cluster: str               # "" when the site names none: every job is home's
    roots: Mapping[str, str]        # configured file:// root -> its real path
    destination: str
    destination_path: str | None    # its real path, when it is a directory
    destination_region: str
    policy: GeoPolicy


@dataclass(frozen=True)
class DirPlan:
    """What to do with one directory (every job that named it together)."""

    root: str                       # the name its replicas are kept under
    path: str                       # its real path
    jobs: tuple[str, ...]           # newest first
    users: tuple[str, ...]
    status: SourceStatus            # WATCHED, COVERED, KEPT_HOME, INVALID or RELEASED
    detail: str | None = None


@dataclass(frozen=True)
class Probe:
    """What looking at a directory found: its owner, or why it could not be looked at."""

    uid: int | None = None
    missing: bool = False
    not_a_directory: bool = False
    error: str | None = None        # any other failure, one line


def job_root(real_path: str) -> str:
    return FILE + real_path


def file_roots(roots: Iterable[str], store_urls: Mapping[str, str]) -> dict[str, str]:
    """The directory of each root that is one: name or URL -> path."""
    found = {}
    for root in roots:
        url = store_urls.get(root, root)
        if url.startswith(FILE):
            found[root] = url.removeprefix(FILE)
    return found


def sync_site(roots: Iterable[str], store_urls: Mapping[str, str], destination: str,
              destination_region: str, home_cluster: str, policy: GeoPolicy,
              resolve: Callable[[str], str] = str) -> SyncSite:
    """The site as the decisions see it, paths resolved by `resolve` (os.path.realpath)."""
    paths = {name: resolve(path) for name, path in file_roots(roots, store_urls).items()}
    url = store_urls.get(destination, destination)
    destination_path = file_roots([url], {}).get(url)
    return SyncSite(home_cluster, paths, destination,
                    resolve(destination_path) if destination_path else None,
                    destination_region, policy)


def residency_keeps_home(directives: Directives, policy: GeoPolicy, region: str) -> str | None:
    """Why the job's checkpoints may not be replicated to `region`; None when they may.
    The rules of slurm_geo.policy.geo, where an unlisted data class may reside anywhere."""
    if directives.residency and region not in directives.residency:
        return (f"its --geo-residency={','.join(directives.residency)} excludes the "
                f"destination's region {quote(region)}")
    data_class = directives.data_class or policy.default_data_class
    allowed = policy.data_classes.get(data_class)
    if allowed is not None and region not in allowed:
        return (f"its data class {quote(data_class)} may not reside in the destination's "
                f"region {quote(region)} (allowed: {', '.join(allowed)})")
    return None


def covering_root(real_path: str, site: SyncSite) -> str | None:
    """The configured root whose directory this is."""
    return next((name for name, path in sorted(site.roots.items()) if path == real_path), None)


def plan_job_dirs(candidates: Iterable[JobDir], site: SyncSite, now: float,
                  owed: Collection[str], scanned: Mapping[str, float]) -> list[DirPlan]:
    """One plan per real directory named by a job of the home cluster, by path. `owed`:
    roots with replicas still to copy or verify; `scanned`: when each root's last good
    scan began. Jobs of other clusters that share the registry keep their checkpoints on
    their own cluster's filesystem, which is not this host's to read."""
    by_path: dict[str, list[JobDir]] = defaultdict(list)
    for job in candidates:
        if not site.home_cluster or job.cluster == site.home_cluster:
            by_path[job.real_path].append(job)
    return [_plan(path, sorted(jobs, key=lambda j: (-j.last_seen, j.tag)), site, now, owed,
                  scanned) for path, jobs in sorted(by_path.items())]


def released(jobs: Collection[JobDir], root: str, now: float, owed: Collection[str],
             scanned: Mapping[str, float]) -> str | None:
    """Why a directory is no longer watched; None while it is."""
    if any(j.running for j in jobs) or root in owed:
        return None
    ended = max(j.last_seen for j in jobs)
    if scanned.get(root, float("-inf")) >= ended + RELEASE_AFTER_S:
        return "its jobs ended and every checkpoint seen in it is settled"
    if now >= ended + GIVE_UP_AFTER_S:
        return ("its jobs ended a day ago and it could not be read since; what it held "
                "then was not replicated")
    return None


def _plan(path: str, jobs: list[JobDir], site: SyncSite, now: float, owed: Collection[str],
          scanned: Mapping[str, float]) -> DirPlan:
    root = job_root(path)
    tags = tuple(j.tag for j in jobs)
    users = tuple(dict.fromkeys(j.user for j in jobs))

    def plan(status: SourceStatus, detail: str | None = None) -> DirPlan:
        return DirPlan(root, path, tags, users, status, detail)

    why = released(jobs, root, now, owed, scanned)
    if why is not None:
        return plan(SourceStatus.RELEASED, why)
    if not path.startswith("/"):
        return plan(SourceStatus.INVALID, f"{quote(jobs[0].path)} is not an absolute path")
    covering = covering_root(path, site)
    if covering is not None:
        return plan(SourceStatus.COVERED, f"it is the directory of [sync] root "
                                          f"{quote(covering)}, which replicates it")
    if path == site.destination_path:
        return plan(SourceStatus.INVALID, f"it is the directory of checkpoint-sync's "
                                          f"destination {quote(site.destination)}; a store is "
                                          "never replicated into itself")
    for job in jobs:
        try:
            directives = parse_options(job.directives)
        except DirectiveError as exc:
            return plan(SourceStatus.INVALID, f"job {job.tag}: {exc}")
        reason = residency_keeps_home(directives, site.policy, site.destination_region)
        if reason is not None:
            return plan(SourceStatus.KEPT_HOME, f"job {job.tag}: {reason}; its checkpoints "
                                                "stay on the home cluster")
    return plan(SourceStatus.WATCHED)


def directory_problem(plan: DirPlan, probe: Probe, uids: Mapping[str, int | None],
                      ) -> str | None:
    """Why a directory to watch cannot be read as its jobs' (None: it can). `uids` maps
    each of its users to their uid on this host (None: unknown here)."""
    path = plan.path
    if probe.missing:
        return f"{path} does not exist, so none of its checkpoints can be replicated"
    if probe.not_a_directory:
        return f"{path} is not a directory"
    if probe.error is not None:
        return f"{path} cannot be read: {probe.error}"
    owners = {uids.get(user) for user in plan.users} - {None}
    users = ", ".join(plan.users)
    if not owners:
        return (f"{path}: its job's user {users} is not known on this host, so whether they "
                "own it cannot be checked; add the user here, or make it one of [sync] roots")
    if probe.uid not in owners:
        return (f"{path} belongs to uid {probe.uid}, not to {users}, whose job named it; a "
                "job's directory is replicated only when its user owns it (chown it, or "
                "make it one of [sync] roots)")
    return None


def run_conflicts(found: Mapping[str, Collection[str]], job_roots: Collection[str],
                  owners: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """The runs each job directory may not replicate: {root: {run: the root that does}}.

    The destination keeps one run of each name, whatever root it came from, and each
    repository seals its runs under its own random key: a second directory's run of the
    same name would replace the first's checkpoints there, fail verification, and take the
    first's verified replicas down with it. So a run belongs to the root that replicated it
    first (`owners`, from the state); a run new in this scan to a [sync] root (an admin's
    choice, never refused), else to the first job directory by name. `found`: the runs
    each root's scan found."""
    claims: dict[str, list[str]] = defaultdict(list)
    for root in sorted(found, key=lambda r: (r in job_roots, r)):
        for run in found[root]:
            claims[run].append(root)
    refused: dict[str, dict[str, str]] = defaultdict(dict)
    for run, roots in claims.items():
        owner = owners.get(run, roots[0])
        for root in roots:
            if root != owner and root in job_roots:
                refused[root][run] = owner
    return dict(refused)


def conflict_detail(refused: Mapping[str, str]) -> str:
    """One line for a directory's refused runs."""
    run, owner = sorted(refused.items())[0]
    more = len(refused) - 1
    return (f"run {quote(run)} is already replicated from {owner.removeprefix(FILE)}"
            + (f" (and {more} more run(s) of its names elsewhere)" if more else "")
            + "; the destination keeps one run of each name, so it is not replicated from "
              "here: train it under another --run name")


@dataclass(frozen=True)
class Protection:
    """What checkpoint-sync does with one job's directory, for the job's own records."""

    root: str | None                # the root its replicas are kept under
    replicated: bool
    how: str                        # "root", "job directory", or why it is not
    note: str = ""                  # "replicated" unconfirmed: why (slurm_geo.sync.truth)


def protection(real_path: str, directives: Directives, cluster: str,
               site: SyncSite | None) -> Protection:
    """The node epilog's answer to "is this directory replicated off-site?" (its owner
    and readability are the daemon's to find; `sync status` shows them)."""
    if site is None:
        return Protection(None, False, "this site runs no checkpoint-sync ([sync] table)")
    if site.home_cluster and cluster != site.home_cluster:
        return Protection(None, False, f"checkpoint-sync replicates the home cluster "
                                       f"{quote(site.home_cluster)}'s directories only")
    covering = covering_root(real_path, site)
    if covering is not None:
        return Protection(site.roots[covering], True, "root")
    if real_path == site.destination_path:
        return Protection(None, False, "it is checkpoint-sync's destination")
    reason = residency_keeps_home(directives, site.policy, site.destination_region)
    if reason is not None:
        return Protection(None, False, reason)
    return Protection(job_root(real_path), True, "job directory")
