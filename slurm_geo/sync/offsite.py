"""Whether each checkpoint of a store is safe off-site, as checkpoint-sync's state says
(the OFF-SITE column of `slurm-geo ckpt ls`).

Read-only: the state database is opened without writing anything, and nothing asks the
daemon. A replica row belongs to the listed store when its root is the store (by the
name or URL given, or by the real path of a local directory), or when what the daemon
saw at that root (`sources`) is.
"""

from __future__ import annotations

import os
import sqlite3
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from slurm_geo.sync.jobdirs import FILE
from slurm_geo.sync.state import Replica, Source, StateDB, Status, SyncError

# With several destinations (an old one still in the history), the row furthest along
# speaks for the checkpoint; settled failures only when nothing is under way.
_PRECEDENCE = (Status.VERIFIED, Status.REPLICATED, Status.UPLOADING, Status.PENDING,
               Status.CORRUPTED, Status.FAILED, Status.SKIPPED)
UNSEEN = Status.PENDING  # a checkpoint of a watched root the daemon has not listed yet


def offsite_status(statuses: Iterable[Status]) -> Status:
    """What one checkpoint's replica rows say, together; UNSEEN when there are none."""
    present = set(statuses)
    return next((s for s in _PRECEDENCE if s in present), UNSEEN)


def place(name: str, resolve: Callable[[str], str] = os.path.realpath) -> str:
    """A root, URL or path as one spelling: a local directory by its real path."""
    if name.startswith(FILE):
        return FILE + resolve(name.removeprefix(FILE))
    return FILE + resolve(name) if name.startswith("/") else name


def offsite_statuses(replicas: Sequence[Replica], sources: Iterable[Source],
                     store_names: Iterable[str],
                     resolve: Callable[[str], str] = os.path.realpath,
                     ) -> dict[tuple[str, int], Status] | None:
    """(run, step) -> status, for the rows of the store known as any of `store_names` (the
    name given, its URL); None when the state knows no root that is that store, so that
    nothing there is replicated by checkpoint-sync. Checkpoints missing from the result
    are UNSEEN."""
    names = {place(n, resolve) for n in store_names}
    paths = {s.root: s.path for s in sources}
    roots = {root for root in {*paths, *(r.root for r in replicas)}
             if place(root, resolve) in names or place(paths.get(root, root), resolve) in names}
    if not roots:
        return None
    found: dict[tuple[str, int], list[Status]] = defaultdict(list)
    for replica in replicas:
        if replica.root in roots:
            found[(replica.run, replica.step)].append(replica.status)
    return {key: offsite_status(statuses) for key, statuses in found.items()}


def read_offsite(state_path: Path, store_names: Iterable[str]
                 ) -> dict[tuple[str, int], Status] | None:
    """`offsite_statuses` over the state database at `state_path`, opened read-only;
    SyncError naming it when it is missing or cannot be read."""
    try:
        state = StateDB(state_path, readonly=True)
        try:
            replicas, sources = state.replicas(), state.sources()
        finally:
            state.close()
    except sqlite3.Error as exc:
        raise SyncError(f"sync state {state_path} cannot be read: {exc}") from None
    return offsite_statuses(replicas, sources, store_names)
