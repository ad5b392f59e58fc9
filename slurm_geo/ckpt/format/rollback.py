"""Rollback detection (docs/format.md §8.6): a store never makes a resume silently older.

Whoever controls a store (an S3 provider, a stolen job key) can delete a run's newest
manifests and its latest pointer, or serve an older pointer again: every object left
still opens, so the store alone cannot tell a rolled-back run from one that never got
further. Only a party outside the store can: the federation daemon knows each run's
*high-water mark* in a store, the newest step it knows was saved there (the step it last
resumed the run from in that store, and the newest checkpoint-sync verified there). A
store whose newest manifest is older than that mark has lost checkpoints it held; the run
is not resumed from it. Pure: the caller gathers the marks and the store's steps.

A job that resumes by itself (a home job, a requeued incarnation) checks the same against
the mark the daemon hands it with its lease and the step its own run record last noted
(`resume_rollback`): there the latest pointer counts too, since a trainer may resume from
it.
"""

from __future__ import annotations

from collections.abc import Iterable

from slurm_geo.ckpt.errors import CkptError
from slurm_geo.exitcodes import ExitCode


class RolledBack(CkptError):
    """A store holds nothing as new as a checkpoint known to have been saved there."""

    exit_code = ExitCode.ROLLED_BACK

    def __init__(self, run: str, store: str, newest: int | None, high_water: int,
                 pointer: bool = False):
        self.run, self.store, self.newest, self.high_water = run, store, newest, high_water
        held = "no checkpoint" if newest is None else f"checkpoints up to step {newest}"
        if pointer:
            held = f"a latest pointer naming step {newest}"
        super().__init__(
            f"manifests/{run}/",
            f"store {store} holds {held} of run {run}, but step {high_water} was saved and "
            "verified there: its newer checkpoints were deleted or replaced (rolled back); "
            f"not resuming from older data: restore {run}@{high_water} from another replica "
            "(slurm-geo ckpt replicate), or clear the mark by starting the run anew")


def high_water(marks: Iterable[int | None]) -> int | None:
    """The newest of the steps known outside the store to have been saved in it."""
    return max((m for m in marks if m is not None), default=None)


def rollback(run: str, store: str, steps: Iterable[int],
             mark: int | None) -> RolledBack | None:
    """The rollback `steps` (every manifest the store lists for `run`, admitted by its
    fence or not) show against the high-water `mark`, or None."""
    newest = max(steps, default=None)
    if mark is None or (newest is not None and newest >= mark):
        return None
    return RolledBack(run, store, newest, mark)


def resume_rollback(run: str, store: str, steps: Iterable[int], pointer: int | None,
                    mark: int | None) -> RolledBack | None:
    """What a job resuming by itself meets (docs/format.md §8.6): the store's newest
    listed step and, where the store has one, the step its latest pointer names (a trainer
    may resume from either), each against the high-water `mark`; None when neither is
    older than it."""
    found = rollback(run, store, steps, mark)
    if found is not None or pointer is None or mark is None or pointer >= mark:
        return found
    return RolledBack(run, store, pointer, mark, pointer=True)
