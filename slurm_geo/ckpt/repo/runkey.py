"""A repository opened with one run's data keys instead of the site master key, and the
daemons' handling of a run's key ring (docs/format.md §4.2): rotation, and carrying the
ring to another store.

A job on a rented cluster gets its run's key ring from the federation daemon for its
lifetime (slurm_geo.lease.client); the master key never leaves the home site. With
only the ring the job can read and write that run's checkpoints and nothing else.

Fences and promotion markers are sealed under keys derived from the master key
(docs/format.md §4): such a job can neither write one the daemons accept nor open one. It
only refrains from overwriting a step that has a marker (it cannot tell a real one).
"""

from __future__ import annotations

import os

from slurm_geo.ckpt.errors import CkptError
from slurm_geo.ckpt.format.keys import KEY_SIZE, MasterKeys, RandomBytes, RunKeyRing
from slurm_geo.ckpt.format.names import fence_name, key_name, promoted_name
from slurm_geo.ckpt.repo.repository import Repository
from slurm_geo.ckpt.stores.store import Store
from slurm_geo.exitcodes import ExitCode


class NoRunKey(CkptError):
    exit_code = ExitCode.WRONG_KEY

    def __init__(self, run: str, held: str):
        super().__init__(key_name(run), f"this job holds the data key of run '{held}' only, "
                         f"not of '{run}'; ask the federation daemon for that run's key")


class NoControlKey(CkptError):
    """Fences and promotion markers are the daemons': their keys come from the master key."""

    exit_code = ExitCode.WRONG_KEY

    def __init__(self, name: str):
        super().__init__(name, f"'{name}' is sealed under the site master key or one "
                         "derived from it, which a job does not hold; run keys, fences and "
                         "promotion markers are written by the daemons and `slurm-geo ckpt "
                         "promote` on-prem")


class RunKeyHolder:
    """One run's key ring, as the federation daemon released it to a job: nothing sealed
    under the master key (other runs' keys, fences, promotion markers) opens with it."""

    def __init__(self, run: str, ring: RunKeyRing):
        self._run, self._ring = run, ring

    def ring(self, run: str, create: bool = False) -> RunKeyRing:
        if run != self._run:
            raise NoRunKey(run, self._run)
        return self._ring

    def put_ring(self, run: str, ring: RunKeyRing) -> None:
        raise NoControlKey(key_name(run))

    def fence_keys(self) -> tuple[bytes, ...]:
        raise NoControlKey(fence_name(self._run))

    def promotion_keys(self) -> tuple[bytes, ...]:
        raise NoControlKey(f"promoted/{self._run}/")


class RunKeyRepository(Repository):
    """`data_keys`: the run's key ring, or its one key (docs/format.md §4.2); new objects
    are sealed under the first."""

    def __init__(self, store: Store, run: str, data_keys: bytes | RunKeyRing):
        ring = data_keys if isinstance(data_keys, RunKeyRing) else RunKeyRing.of(data_keys)
        # The master key slot is never read: the holder is the only way to keys.
        super().__init__(store, bytes(KEY_SIZE), holder=RunKeyHolder(run, ring))

    def is_promoted(self, run: str, step: int) -> bool:
        """A marker this job cannot open counts as there: it only keeps the job from
        overwriting that step (§8.1); what a marker protects is the daemons' to check."""
        return self._store.exists(promoted_name(run, step))


def unwrap_run_keys(store: Store, master_key: bytes | MasterKeys, run: str,
                    create: bool = False) -> RunKeyRing:
    """The run's key ring, opened from `keys/<run>` with the master key (§4); with
    `create`, a run that has no key in `store` yet gets one (its first checkpoint will be
    written there by a job that holds only this key)."""
    return Repository(store, master_key)._keys(run, create=create)


def unwrap_run_key(store: Store, master_key: bytes | MasterKeys, run: str,
                   create: bool = False) -> bytes:
    """The run's current data key (the one new objects are sealed under)."""
    return unwrap_run_keys(store, master_key, run, create).current.data_key


def rotate_run_keys(repository: Repository, run: str,
                    random_bytes: RandomBytes = os.urandom) -> RunKeyRing:
    """A new data key in front of the run's ring in `repository`'s store (docs/format.md
    §4.2): what the run seals from now on, a site that held only the older keys cannot
    open. Its older checkpoints stay readable under the keys behind it."""
    ring = repository.run_keys(run).rotated(random_bytes(KEY_SIZE))
    repository.put_run_keys(run, ring)
    return ring


def carry_run_keys(source: Repository, destination: Store, run: str) -> None:
    """Make `destination`'s `keys/<run>` hold every key of the source's ring: copied when
    it has none, merged when it missed a rotation (then the source's newest key seals);
    a destination that holds them all already is left as it is, whichever key it seals
    under. A job's repository holds no master key: it only copies a missing one."""
    name = key_name(run)
    if not destination.exists(name):
        destination.put(name, source.store.get(name))
        return
    if isinstance(source, RunKeyRepository):
        return
    mine = source.run_keys(run)
    there = source.on(destination)
    theirs = there.run_keys(run)
    if not theirs.holds(mine):
        there.put_run_keys(run, mine.merged(theirs))
