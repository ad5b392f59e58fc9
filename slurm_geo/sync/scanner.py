"""Finding committed checkpoints under a root store.

A checkpoint exists once its manifest exists (docs/format.md §8): writers put every pack
first and the manifest last, atomically (a local store renames a temporary file whose name
starts with '.', which listings skip; S3 makes a single PUT visible all at once). So a
manifest that is listed is committed, and a half-written checkpoint is never seen.

One scan is three listings per root, `manifests/`, `promoted/` and `worlds/`, whatever the
number of runs: this runs every poll interval, and must stay cheap on a parallel
filesystem. `worlds/` names the runs whose world record is at home (docs/format.md
§11.8), so that a run's world is copied off-site as soon as its job stages it, not at the
next recheck of a run that had none (slurm_geo.sync.worldstate.WorldQueue).
"""

from __future__ import annotations

from dataclasses import dataclass

from slurm_geo.ckpt.errors import CkptError, UnsafeObjectName
from slurm_geo.ckpt.format.names import run_of_manifest_name, step_of_manifest_name
from slurm_geo.ckpt.stores.store import Store
from slurm_geo.stage.record import WORLDS

WORLDS_PREFIX = f"{WORLDS}/"


@dataclass(frozen=True)
class Found:
    """A committed checkpoint under a root."""

    root: str
    run: str
    step: int
    promoted: bool = False


@dataclass(frozen=True)
class RootScan:
    """What one scan saw under `root`; `error` is set (and `found` empty) if it failed."""

    root: str
    found: tuple[Found, ...] = ()
    error: str | None = None
    worlds: frozenset[str] = frozenset()  # runs with a world record under the root

    @property
    def ok(self) -> bool:
        return self.error is None


def scan_root(root: str, store: Store) -> RootScan:
    """Every committed checkpoint under `store`; a store failure is reported, not raised."""
    try:
        manifests = store.list("manifests/")
        promoted = set(_checkpoints(store.list("promoted/"), "promoted/"))
    except CkptError as exc:
        return RootScan(root, error=str(exc))
    found = [Found(root, run, step, (run, step) in promoted)
             for run, step in _checkpoints(manifests, "manifests/")]
    return RootScan(root, tuple(sorted(found, key=lambda f: (f.run, f.step))),
                    worlds=_world_records(store))


def _world_records(store: Store) -> frozenset[str]:
    """The runs whose world record lies under `store`; none when it cannot be listed (a
    world pass then finds a record at its next recheck, as it did before)."""
    try:
        return frozenset(name.removeprefix(WORLDS_PREFIX) for name in store.list(WORLDS_PREFIX)
                         if "/" not in name.removeprefix(WORLDS_PREFIX))
    except CkptError:
        return frozenset()


def _checkpoints(names: list[str], prefix: str) -> list[tuple[str, int]]:
    """(run, step) of each well-formed `<prefix><run>/<step>` name; others are ignored."""
    pairs = []
    for name in names:
        as_manifest = "manifests/" + name.removeprefix(prefix)
        run = run_of_manifest_name(as_manifest)
        if run is None:
            continue
        try:
            step = step_of_manifest_name(run, as_manifest)
        except UnsafeObjectName:  # a run id outside the grammar: not a checkpoint
            continue
        if step is not None:
            pairs.append((run, step))
    return pairs
