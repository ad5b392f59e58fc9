"""Garbage collection (docs/format.md §8.1): drop packs no manifest references.

Safe against a concurrent push because of the order: list packs, then check push locks,
then read every manifest. A push that began before the pack listing holds a lock (gc
refuses); one that began after it writes only packs the listing does not contain.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from slurm_geo.ckpt.errors import StoreBusy
from slurm_geo.ckpt.format.manifest import with_bases
from slurm_geo.ckpt.format.names import run_of_manifest_name, step_of_manifest_name
from slurm_geo.ckpt.ops.usage import pack_sizes
from slurm_geo.ckpt.repo.locks import LOCK_TTL, is_fresh, locks, why_stale
from slurm_geo.ckpt.repo.repository import Repository
from slurm_geo.ckpt.stores.store import Store


@dataclass
class GcReport:
    deleted_packs: list[str] = field(default_factory=list)
    kept_packs: int = 0
    stale_locks_removed: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # one line per lock removed, and why


def collect_garbage(store: Store, repository: Repository, now: datetime,
                    dry_run: bool = False) -> GcReport:
    """Delete unreferenced packs of every run in `store`.

    Raises StoreBusy while a push may be in flight, and any CkptError from a manifest
    that does not open: a manifest we cannot read could reference any pack.
    """
    candidates = sorted(pack_sizes(store))
    report = GcReport()
    for lock in locks(store):
        if is_fresh(lock, now) and lock.created_at is not None:
            raise StoreBusy(lock.name, lock.created_at.isoformat(),
                            (lock.created_at + LOCK_TTL).isoformat())
        report.stale_locks_removed.append(lock.name)
        report.notes.append(why_stale(lock, now))
    referenced = _referenced_packs(store, repository)
    for name in candidates:
        if name in referenced:
            report.kept_packs += 1
        else:
            report.deleted_packs.append(name)
    if not dry_run:
        for name in report.stale_locks_removed + report.deleted_packs:
            store.delete(name)
    return report


def _referenced_packs(store: Store, repository: Repository) -> set[str]:
    referenced: set[str] = set()
    for name in store.list("manifests/"):
        run = run_of_manifest_name(name)
        step = step_of_manifest_name(run, name) if run else None
        if run is None or step is None:
            continue
        manifest = repository.manifest(run, step)
        referenced.update(manifest.pack_object(ref.pack) for ref in with_bases(manifest.refs()))
    return referenced
