"""Where checkpoint-sync reads from, scanned once per poll: the configured roots and every
registered geo job's checkpoint directory (slurm_geo.sync.jobdirs decides which).

The registry is the controller's (PrologSlurmctld writes it), read here read-only, only the
jobs that run or ran lately and those of directories still being watched. Nothing is ever
written into a job's directory: it is scanned and copied from like any root, as root (the
unit's CAP_DAC_READ_SEARCH), and everything known about it lives in the state database's
`sources` table, which `slurm-geo sync status` shows. A directory that cannot be read, or
a registry that cannot, is logged when that starts and when it ends, and stays in
`sources` meanwhile: a replication that can never happen is never silent.
"""

from __future__ import annotations

import logging
import os
import pwd
import stat
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from slurm_geo.daemon.events import event
from slurm_geo.errors import SlurmGeoError
from slurm_geo.registry import ActiveJob, RegistryReader, RegistryUnreadable
from slurm_geo.sync.jobdirs import (
    RELEASE_AFTER_S,
    DirPlan,
    JobDir,
    Probe,
    SourceStatus,
    SyncSite,
    conflict_detail,
    directory_problem,
    plan_job_dirs,
    run_conflicts,
    sync_site,
)
from slurm_geo.sync.runtime import JobRoot, Runtime
from slurm_geo.sync.scanner import RootScan, scan_root
from slurm_geo.sync.state import Source, StateDB

log = logging.getLogger("slurm_geo.sync")

REGISTRY = "registry"  # the root name of the registry's row in `sources`
READ_MARK = "registry_read_at"  # in `meta`: jobs that ended while the daemon was down count
MARK_EVERY_S = 60.0


class Sources:
    """Scans the daemon's sources and keeps `sources` up to date (one per daemon: it
    remembers what it logged and the last good reading of the registry)."""

    def __init__(self) -> None:
        self._recorded: dict[str, Source] | None = None  # as in the database
        self._logged: dict[str, Source] = {}             # as last logged, this process
        self._plans: list[DirPlan] = []                  # from the last good registry read
        self._scanned: dict[str, float] = {}             # job root -> its last good scan
        self._read_at: float | None = None               # the registry's, as in `meta`

    def scan(self, runtime: Runtime, state: StateDB, now: float) -> list[RootScan]:
        """One scan of every source (each failure is reported in its scan, never raised)."""
        if self._recorded is None:
            self._recorded = {s.root: s for s in state.sources()}
            self._scanned = {s.root: s.scanned_at for s in self._recorded.values()
                             if s.scanned_at is not None}
            self._plans = [_as_plan(s) for s in self._recorded.values()
                           if s.kind == "job" and s.status is not SourceStatus.RELEASED]
        scans, seen = [], []
        for root in runtime.sync.roots:
            scan = _scan(root, runtime)
            scans.append(scan)
            seen.append(Source(root, "root", runtime.store_urls.get(root, root),
                               SourceStatus.WATCHED if scan.ok else SourceStatus.UNREADABLE,
                               detail=scan.error))
        registry, plans = self._read_plans(runtime, state, now)
        if registry is not None:
            seen.append(registry)
        runtime.watch_job_roots({p.root: _job_root(p) for p in plans
                                 if p.status is SourceStatus.WATCHED})
        jobs = {p.root: self._scan_job_dir(p, runtime, now) for p in plans
                if p.status is SourceStatus.WATCHED}
        refused = self._conflicts(scans, jobs, state, runtime.destination)
        for plan in plans:
            status, detail = plan.status, plan.detail
            seen_there = jobs.get(plan.root)
            if seen_there is not None and not seen_there.ok:
                status, detail = SourceStatus.UNREADABLE, seen_there.error
            elif seen_there is not None and plan.root in refused:
                status, detail = SourceStatus.CONFLICT, conflict_detail(refused[plan.root])
                seen_there = RootScan(plan.root, tuple(
                    f for f in seen_there.found if f.run not in refused[plan.root]))
            if seen_there is not None:
                scans.append(seen_there)
            seen.append(Source(plan.root, "job", plan.path, status, plan.jobs, plan.users,
                               detail, scanned_at=self._scanned.get(plan.root)))
        self._record(seen, state, now)
        return scans

    def _scan_job_dir(self, plan: DirPlan, runtime: Runtime, now: float) -> RootScan:
        problem = directory_problem(plan, probe_directory(plan.path),
                                    {user: uid_of_user(user) for user in plan.users})
        scan = RootScan(plan.root, error=problem) if problem else _scan(plan.root, runtime)
        if scan.ok:
            self._scanned[plan.root] = now
        return scan

    @staticmethod
    def _conflicts(roots: list[RootScan], jobs: dict[str, RootScan], state: StateDB,
                   destination: str) -> dict[str, dict[str, str]]:
        found = {scan.root: {f.run for f in scan.found} for scan in [*roots, *jobs.values()]}
        runs = {run for root in jobs for run in found[root]}
        return run_conflicts(found, jobs.keys(), state.first_roots(runs, destination))

    # --- the registry -------------------------------------------------------------------

    def _read_plans(self, runtime: Runtime, state: StateDB, now: float
                    ) -> tuple[Source | None, list[DirPlan]]:
        """The plans for every job directory, and the registry's own row. A registry that
        cannot be read keeps the last plans: a locked file must not stop replication."""
        path = runtime.registry_path
        if path is None:
            return None, []
        assert self._recorded is not None
        watching = [s for s in self._recorded.values()
                    if s.kind == "job" and s.status is not SourceStatus.RELEASED]
        also = [_tag(job) for s in watching for job in s.jobs]
        try:
            if not path.exists():
                return Source(REGISTRY, REGISTRY, str(path), SourceStatus.UNREADABLE,
                              detail=f"there is no job registry at {path} yet; it appears "
                                     "with the first geo job's PrologSlurmctld, and job "
                                     "directories are replicated from then on (see "
                                     "[registry] path)"), self._plans
            active = RegistryReader(path).active_jobs(self._since(state, now), also)
        except RegistryUnreadable as exc:
            return Source(REGISTRY, REGISTRY, str(path), SourceStatus.UNREADABLE,
                          detail=str(exc)), self._plans
        site = self._site(runtime)
        owed = state.owed_roots(runtime.destination)
        self._plans = plan_job_dirs(self._candidates(active), site, now, owed, self._scanned)
        self._mark_read(state, now)
        return Source(REGISTRY, REGISTRY, str(path), SourceStatus.WATCHED), self._plans

    def _since(self, state: StateDB, now: float) -> float:
        """Jobs seen since the daemon last read the registry (the mark survives restarts,
        so jobs that ran while it was down are replicated too); on the very first read,
        since a little while ago: history before checkpoint-sync came is not backfilled."""
        if self._read_at is None:
            mark = state.mark(READ_MARK)
            self._read_at = float(mark) if mark else now - MARK_EVERY_S  # written at once
        return min(self._read_at, now) - RELEASE_AFTER_S

    def _mark_read(self, state: StateDB, now: float) -> None:
        assert self._read_at is not None
        if now - self._read_at >= MARK_EVERY_S:
            state.set_mark(READ_MARK, repr(now))
            self._read_at = now

    def _candidates(self, active: Iterable[ActiveJob]) -> list[JobDir]:
        found = []
        for entry in active:
            job = entry.job
            path = job.directives.get("geo-ckpt-dir")
            if not path:
                continue
            real = os.path.realpath(path) if path.startswith("/") else path
            found.append(JobDir(f"{job.cluster}:{job.job_id}", job.cluster, job.user, path,
                                real, job.directives, entry.running, entry.last_seen))
        return found

    def _site(self, runtime: Runtime) -> SyncSite:
        urls = {**runtime.store_urls, runtime.destination: runtime.destination_url}
        return sync_site(runtime.sync.roots, urls, runtime.destination,
                         runtime.destination_region, runtime.home_cluster, runtime.geo_policy,
                         os.path.realpath)

    # --- recording and telling ------------------------------------------------------------

    def _record(self, seen: list[Source], state: StateDB, now: float) -> None:
        assert self._recorded is not None
        current = {s.root: s for s in seen}
        for root, old in self._recorded.items():
            if root not in current and old.status is not SourceStatus.RELEASED:
                current[root] = replace(old, status=SourceStatus.RELEASED,
                                        detail="no longer one of the sources")
        changed = []
        for root, source in current.items():
            before = self._recorded.get(root)
            if not source.same_as(before) or _scan_moved_on(source, before):
                kept = before is not None and before.status is source.status
                changed.append(replace(source, since=before.since if before and kept
                                       else now))
        if changed:
            state.record_sources(changed)
            self._recorded.update((s.root, s) for s in changed)
        for source in current.values():
            told = self._logged.get(source.root)
            if not source.same_as(told):
                _tell(source, told)
                self._logged[source.root] = source


def _job_root(plan: DirPlan) -> JobRoot:
    uids = (uid_of_user(user) for user in plan.users)
    return JobRoot(plan.path, frozenset(uid for uid in uids if uid is not None))


def _as_plan(source: Source) -> DirPlan:
    """What a previous run decided, until the registry can be read again."""
    status = SourceStatus.WATCHED if source.status is SourceStatus.UNREADABLE \
        else source.status
    return DirPlan(source.root, source.path, source.jobs, source.users, status,
                   None if status is SourceStatus.WATCHED else source.detail)


def _scan_moved_on(source: Source, before: Source | None) -> bool:
    """Whether `scanned_at` is worth a write: a few minutes on, so that a daemon run with
    --once from cron lets a finished job's directory go too, without a write every scan."""
    if source.scanned_at is None:
        return False
    last = before.scanned_at if before is not None else None
    return last is None or source.scanned_at - last >= RELEASE_AFTER_S


def _tell(source: Source, before: Source | None) -> None:
    """One event when what the daemon sees of a source changes."""
    status, was = source.status, before.status if before else None
    fields: dict[str, Any] = {"path": source.path, "jobs": ",".join(source.jobs) or None,
                              "detail": source.detail}
    if status is SourceStatus.UNREADABLE:
        level = logging.ERROR if source.kind == "job" else logging.WARNING
        name = {"root": "root_unreadable", "job": "job_dir_unreadable"}.get(
            source.kind, "registry_unreadable")
        event(log, name, level, root=source.root, **fields)
    elif status is SourceStatus.WATCHED:
        if source.kind == "job":
            event(log, "job_dir_back" if was is SourceStatus.UNREADABLE else "job_dir_watched",
                  root=source.root, **fields)
        elif was is SourceStatus.UNREADABLE:
            event(log, f"{'root' if source.kind == 'root' else 'registry'}_back",
                  root=source.root, path=source.path)
    elif source.kind == "job":
        level = logging.ERROR if status.is_problem else logging.INFO
        event(log, f"job_dir_{status.value}", level, root=source.root, **fields)


def _scan(root: str, runtime: Runtime) -> RootScan:
    try:
        return scan_root(root, runtime.root_store(root))
    except SlurmGeoError as exc:  # the root could not even be opened
        return RootScan(root, error=str(exc))


def _tag(tag: str) -> tuple[str, int]:
    cluster, _, job_id = tag.rpartition(":")
    return cluster, int(job_id) if job_id.isdigit() else -1


def probe_directory(path: str) -> Probe:
    """Look at a directory by its real path (the caller resolved every link)."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return Probe(missing=True)
    except NotADirectoryError:
        return Probe(not_a_directory=True)
    except OSError as exc:
        return Probe(error=exc.strerror or str(exc))
    if not stat.S_ISDIR(info.st_mode):
        return Probe(not_a_directory=True)
    return Probe(uid=info.st_uid)


def uid_of_user(user: str) -> int | None:
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        return None
