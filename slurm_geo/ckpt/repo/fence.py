"""Fences (docs/format.md §8.3): which cluster may commit a run's checkpoints past a step.

When the federation daemon moves a run to another cluster it fences the run in the store
the new incarnation writes to: generation G, held by that cluster, resuming from step S.
From then on a checkpoint of the run is admitted there only if it was written by the
holder, or is history (step <= S). A stale incarnation that kept training through a
partition can then never overwrite, or be replicated over, the new incarnation's work.

A fence is sealed under the site's fence key (derived from the master key, docs/format.md
§4), which the daemons hold and no job does: a job cannot write one that is accepted, so
it cannot fence a run away from the daemon (a generation-999 fence would block every later
move). What reads a fence chooses how (a `FenceLookup`): checkpoint-sync takes the store's
(`read_fence`: what does not open there stops the copy); the federation daemon takes the
newer of the store's and its own state's (slurm_geo.federation.act.fencing).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass

from slurm_geo.ckpt.errors import CkptError, CorruptObject
from slurm_geo.ckpt.format.manifest import Manifest
from slurm_geo.ckpt.format.names import fence_name, manifest_name
from slurm_geo.ckpt.repo.repository import Repository
from slurm_geo.exitcodes import ExitCode


@dataclass(frozen=True)
class Fence:
    run: str
    generation: int
    holder: str  # the cluster whose incarnation owns the run from `resume_step` on
    resume_step: int | None  # None: the holder starts the run from scratch
    set_at: str  # ISO-8601, UTC

    def admits(self, manifest: Manifest) -> bool:
        if manifest.metadata.cluster == self.holder:
            return True
        return self.resume_step is not None and manifest.step <= self.resume_step


class FencedCheckpoint(CkptError):
    """A checkpoint written by an incarnation the run has been moved away from."""

    exit_code = ExitCode.FENCED

    def __init__(self, manifest: Manifest, fence: Fence):
        super().__init__(
            manifest_name(manifest.run, manifest.step),
            f"checkpoint {manifest.run}@{manifest.step} from cluster "
            f"'{manifest.metadata.cluster}' is fenced: generation {fence.generation} of the "
            f"run belongs to '{fence.holder}' from step {fence.resume_step}; it is not copied",
        )


class FenceRegression(CkptError):
    exit_code = ExitCode.FENCED

    def __init__(self, run: str, current: int, wanted: int):
        super().__init__(fence_name(run), f"run {run} is fenced at generation {current}; "
                         f"refusing to set the older generation {wanted}")


FenceLookup = Callable[[Repository, str], Fence | None]


def newer(stored: Fence | None, known: Fence | None) -> Fence | None:
    """The fence of the higher generation; `known` (the federation daemon's state) on a tie
    or when the store has none: a fence the daemon set counts even where it was deleted."""
    if stored is None or (known is not None and known.generation >= stored.generation):
        return known
    return stored


def read_fence(repository: Repository, run: str) -> Fence | None:
    """The store's fence, None when there is none. A `fences/<run>` that does not open
    under the fence key raises (LegacyObject for a version 1 fence, WrongKey, CorruptObject):
    a reader that knows nothing else must then copy nothing."""
    payload = repository.fence_payload(run)
    if payload is None:
        return None
    try:
        fields = json.loads(payload)
        fence = Fence(run=str(fields["run"]), generation=int(fields["generation"]),
                      holder=str(fields["holder"]), set_at=str(fields["set_at"]),
                      resume_step=None if fields["resume_step"] is None
                      else int(fields["resume_step"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptObject(fence_name(run), f"fence payload does not parse: {exc}") from None
    if fence.run != run:
        raise CorruptObject(fence_name(run), f"fence names run '{fence.run}', not '{run}'")
    return fence


def write_fence(repository: Repository, fence: Fence,
                lookup: FenceLookup = read_fence) -> None:
    """Set the fence; generations only move forward (the same one may be written again).
    `lookup` reads the current one: the federation daemon's treats a fence that does not
    open as absent, and replaces it."""
    current = lookup(repository, fence.run)
    if current is not None and current.generation > fence.generation:
        raise FenceRegression(fence.run, current.generation, fence.generation)
    repository.put_fence(fence.run, json.dumps(asdict(fence), sort_keys=True).encode())


def check_admitted(repository: Repository, manifest: Manifest,
                   lookup: FenceLookup = read_fence) -> None:
    """Raise FencedCheckpoint if the run's fence in `repository` does not admit `manifest`."""
    fence = lookup(repository, manifest.run)
    if fence is not None and not fence.admits(manifest):
        raise FencedCheckpoint(manifest, fence)


def unadmitted_steps(repository: Repository, run: str,
                     lookup: FenceLookup = read_fence) -> list[int]:
    """Steps of `run` in the repository that its fence does not admit: checkpoints a stale
    incarnation got in (e.g. replicated in the instant before the fence was set)."""
    fence = lookup(repository, run)
    if fence is None:
        return []
    later = [s for s in repository.steps(run)
             if fence.resume_step is None or s > fence.resume_step]
    return [s for s in later if not fence.admits(repository.manifest(run, s))]
