"""The keys of staged trees (docs/format.md §11.2): one key ring per *domain*, sealed
under the site master key in `tree-keys/<domain>` as a run's is in `keys/<run>`.

A domain is the set of trees that share a key and may share chunks; by default each tree
is its own domain (the domain id is the tree id), so a holder of one tree's key reads that
tree and nothing else. The master key's holders (checkpoint-sync, the federation daemon)
open every domain's ring (`MasterTreeKeys`); a job is given the rings of the trees it
declared, and holds only those (`GivenTreeKeys`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Protocol

from slurm_geo.ckpt.errors import CkptError
from slurm_geo.ckpt.format.keys import MasterKeys, RandomBytes, RunKeyRing
from slurm_geo.ckpt.repo.keyholder import SealedKeyRings
from slurm_geo.ckpt.stores.store import Store
from slurm_geo.exitcodes import ExitCode
from slurm_geo.stage.names import tree_key_name


class NoTreeKey(CkptError):
    """A tree whose domain key this holder was not given."""

    exit_code = ExitCode.WRONG_KEY

    def __init__(self, domain: str, held: list[str]):
        names = ", ".join(held) or "none"
        super().__init__(tree_key_name(domain), f"the key of staged tree domain '{domain}' "
                         f"was not given to this holder (it holds: {names}); a job is given "
                         "the keys of the trees it declared only")


class TreeKeyHolder(Protocol):
    def ring(self, domain: str, create: bool = False) -> RunKeyRing:
        """The domain's key ring; with `create`, a domain without one gets a new key."""
        ...


class MasterTreeKeys(SealedKeyRings):
    """Domain key rings opened from `tree-keys/<domain>` under the master key, each once."""

    def __init__(self, store: Store, master_keys: MasterKeys,
                 random_bytes: RandomBytes = os.urandom):
        super().__init__(store, master_keys, tree_key_name, random_bytes)


class GivenTreeKeys:
    """The rings of some domains, as handed to a job: nothing else opens with them."""

    def __init__(self, rings: Mapping[str, RunKeyRing]):
        self._rings = dict(rings)

    def ring(self, domain: str, create: bool = False) -> RunKeyRing:
        try:
            return self._rings[domain]
        except KeyError:
            raise NoTreeKey(domain, sorted(self._rings)) from None
