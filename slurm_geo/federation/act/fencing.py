"""The federation daemon's word on fences (docs/format.md §8.3, §8.4).

The daemon sets every fence, so its state knows each run's: at generation G >= 1 the run
belongs to the generation's cluster from its resume step on, in every store. Reading a
store's fence, it therefore takes the newer of that and its own (a fence deleted from a
store still counts), and what does not open under the fence key there (a version 1 fence
sealed under the run key, one a job forged) is not trusted, and is rewritten.

`Refencer` does that rewriting, a few stores a round and each store again every hour: each
store holding a run's key gets the fence the daemon's state implies when the store's is
missing, older, or untrusted, so checkpoint-sync (which knows only the store) sees it too.
In the first rounds after an upgrade it replaces every version 1 fence the daemon knows.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import UTC, datetime

from slurm_geo.ckpt import Repository
from slurm_geo.ckpt.errors import CkptError, CorruptObject, LegacyObject, WrongKey
from slurm_geo.ckpt.format.names import fence_name, key_name
from slurm_geo.ckpt.repo.fence import Fence, FenceLookup, newer, read_fence, write_fence
from slurm_geo.daemon.events import event
from slurm_geo.federation.model import LogicalJob
from slurm_geo.federation.wiring import Wiring

log = logging.getLogger("slurm_geo.federation")

REFENCE_PER_ROUND = 20  # stores checked per round: the loop is never held up for long
RECHECK_S = 3600.0      # how often each store's fence is read again


def known_fence(job: LogicalJob) -> Fence | None:
    """The fence the daemon's state implies for the job's run; None before its first move."""
    if not job.run or job.generation < 1:
        return None
    return Fence(job.run, job.generation, job.cluster, job.resume_step,
                 datetime.fromtimestamp(job.updated_at, UTC).isoformat())


def trusted_fence(repository: Repository, run: str) -> Fence | None:
    """The store's fence if it opens under the fence key; None (logged) when it does not."""
    try:
        return read_fence(repository, run)
    except (LegacyObject, WrongKey, CorruptObject) as exc:
        event(log, "fence_untrusted", logging.WARNING, run=run, error=exc)
        return None


def daemon_lookup(known: Fence | None) -> FenceLookup:
    """How the daemon reads a run's fence: the newer of the store's and `known`."""

    def lookup(repository: Repository, run: str) -> Fence | None:
        return newer(trusted_fence(repository, run), known)

    return lookup


def set_fence(repository: Repository, fence: Fence) -> None:
    """Write `fence`, replacing whatever untrusted object is there; FenceRegression only
    against a trusted fence of a higher generation."""
    write_fence(repository, fence, daemon_lookup(None))


class Refencer:
    """Keeps each store's fence at what the daemon's state says, a few stores a round; a
    store is checked again `recheck_s` after its last check (a fence deleted meanwhile)."""

    def __init__(self, wiring: Wiring, per_round: int = REFENCE_PER_ROUND,
                 recheck_s: float = RECHECK_S):
        self.wiring = wiring
        self._per_round = per_round
        self._recheck_s = recheck_s
        self._checked: dict[tuple[str, int, str], float] = {}  # (run, generation, store)

    def round(self, jobs: Iterable[LogicalJob]) -> None:
        budget, now = self._per_round, self.wiring.clock()
        for job in jobs:
            fence = known_fence(job)
            if fence is None:
                continue
            for store_name in sorted(self.wiring.stores):
                done = (job.run, job.generation, store_name)
                if now - self._checked.get(done, -self._recheck_s) < self._recheck_s:
                    continue
                if budget == 0:
                    return
                budget -= 1
                try:
                    self._refence(job, fence, store_name)
                except CkptError as exc:  # the store is down: tried again next round
                    event(log, "refence_failed", logging.WARNING, job=job.logical_job,
                          store=store_name, error=exc)
                    continue
                self._checked[done] = now

    def _refence(self, job: LogicalJob, fence: Fence, store_name: str) -> None:
        store = self.wiring.stores[store_name]
        if not store.exists(key_name(job.run)):
            return  # nothing of the run is there to fence
        repository = self.wiring.repository(store_name)
        stored = trusted_fence(repository, job.run)
        if stored is not None and stored.generation >= fence.generation:
            return
        self.wiring.state.confirm_leading()
        set_fence(repository, fence)
        self.wiring.audit.append(
            "fence", job.logical_job,
            f"rewrote {fence_name(job.run)} in {store_name} at generation {fence.generation}",
            "the store's fence was missing, older than the daemon's, or did not open under "
            "the fence key", store=store_name, generation=fence.generation)
