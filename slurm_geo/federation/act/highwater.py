"""A run's high-water mark in a store, as the federation daemon knows it (docs/format.md
§8.6): the newest step of the run known, outside that store, to have been saved in it.

The mover checks a store against it before it resumes a moved or restarted job from
there (federation.mover); the lease service hands it, with the grant, to an incarnation
that has not saved yet, so a job resuming by itself (a home job, a requeued incarnation)
checks its own store against it too (slurm_geo.lease.client.FederatedRun.checked).

The marks: for each job of the federation that names the run, the step its current
generation resumed from and the last step its lease reported committed, where that
generation's cluster writes to the store (`lease_marks`, pure); and the newest step
checkpoint-sync verified there, when the store is its destination (`sync_marks`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from slurm_geo.federation.model import Lease, LogicalJob
from slurm_geo.federation.wiring import Wiring
from slurm_geo.sync.reader import SyncStateReader, SyncStateUnreadable
from slurm_geo.sync.state import Status

log = logging.getLogger("slurm_geo.federation")


def lease_marks(jobs: Iterable[tuple[LogicalJob, Lease | None]], store: str,
                store_of: Callable[[str], str]) -> list[int | None]:
    """The steps the daemon's own records say were saved in `store`, of every job naming
    the run (with its lease, None if it has none): its current generation's resume step
    and the last step that generation's lease reported, each where the cluster it ran on
    writes to `store`. A lease of an older generation says nothing (the job has moved
    since). Pure."""
    marks: list[int | None] = []
    for job, lease in jobs:
        if store_of(job.cluster) == store:
            marks.append(job.resume_step)
        if lease is not None and lease.generation == job.generation \
                and store_of(lease.cluster) == store:
            marks.append(lease.last_step)
    return marks


def sync_marks(wiring: Wiring, run: str, store: str) -> list[int]:
    """The steps of `run` checkpoint-sync verified in `store`, when it is its destination
    ([] otherwise, or when its state cannot be read: said in the log)."""
    sync = wiring.site.sync
    if sync is None or sync.destination != store:
        return []
    try:
        replicas = SyncStateReader(sync.state, missing_ok=True).replicas(run)
    except SyncStateUnreadable as exc:
        log.warning("no rollback mark from checkpoint-sync: %s", exc)
        return []
    return [r.step for r in replicas if r.destination == store and r.status is Status.VERIFIED]
