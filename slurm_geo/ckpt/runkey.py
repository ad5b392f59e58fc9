"""A repository opened with one run's data key instead of the site master key.

A job on a rented cluster gets its run's data key from the federation daemon for its
lifetime (slurm_geo.lease.client); the master key never leaves the home site. With
only the data key the job can read and write that run's checkpoints and nothing else.

Fences and promotion markers are sealed under keys derived from the master key
(docs/format.md §4): such a job can neither write one the daemons accept nor open one. It
only refrains from overwriting a step that has a marker (it cannot tell a real one).
"""

from __future__ import annotations

from slurm_geo.ckpt.errors import CkptError
from slurm_geo.ckpt.keys import KEY_SIZE, MasterKeys, RunKeys
from slurm_geo.ckpt.names import fence_name, key_name, promoted_name
from slurm_geo.ckpt.repository import Repository
from slurm_geo.ckpt.store import Store
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
        super().__init__(name, f"'{name}' is sealed under a key derived from the site master "
                         "key, which a job does not hold; fences and promotion markers are "
                         "written by the daemons and `slurm-geo ckpt promote` on-prem")


class RunKeyRepository(Repository):
    def __init__(self, store: Store, run: str, data_key: bytes):
        # The master key slot is never read: _load_keys below is the only path to it.
        super().__init__(store, bytes(KEY_SIZE))
        self._run = run
        self._run_keys[run] = RunKeys(data_key)

    def _load_keys(self, run: str, create: bool) -> RunKeys:
        raise NoRunKey(run, self._run)

    def _fence_keys(self) -> tuple[bytes, ...]:
        raise NoControlKey(fence_name(self._run))

    def _promotion_keys(self) -> tuple[bytes, ...]:
        raise NoControlKey(f"promoted/{self._run}/")

    def is_promoted(self, run: str, step: int) -> bool:
        """A marker this job cannot open counts as there: it only keeps the job from
        overwriting that step (§8.1); what a marker protects is the daemons' to check."""
        return self._store.exists(promoted_name(run, step))


def unwrap_run_key(store: Store, master_key: bytes | MasterKeys, run: str,
                   create: bool = False) -> bytes:
    """The run's data key, opened from `keys/<run>` with the master key (§4); with
    `create`, a run that has no key in `store` yet gets one (its first checkpoint will be
    written there by a job that holds only this key)."""
    return Repository(store, master_key)._keys(run, create=create).data_key
