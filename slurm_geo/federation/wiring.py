"""What every part of the federation daemon is built with: the site, its clients and
stores, the state, the audit log and the clock. Assembled once (federation.engine.runtime,
or a test), passed in; no part reaches for a module singleton or the wall clock.

The state and the audit log are the one interface of federation.state.interface: SQLite
files for a daemon alone, or etcd for one replica among several (federation.state.etcd),
whose `leadership` says whether it may act."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slurm_geo.ckpt.format.keys import MasterKeys
from slurm_geo.ckpt.repo.repository import Repository
from slurm_geo.ckpt.stores.store import Store
from slurm_geo.config.model import FederationConfig, SiteConfig
from slurm_geo.federation.state.etcd.leadership import Leadership
from slurm_geo.federation.state.interface import Audit, State
from slurm_geo.registry import RegistryReader
from slurm_geo.slurm import SlurmClient


@dataclass
class Wiring:
    site: SiteConfig
    config: FederationConfig
    master_keys: MasterKeys  # the key file, followed as a rotation rewrites it
    clients: dict[str, SlurmClient]
    stores: dict[str, Store]          # for small objects: keys, fences, manifests
    paced_stores: dict[str, Store]    # for bulk copies and probes: the bandwidth cap applies
    state: State
    audit: Audit
    clock: Callable[[], float] = time.time
    registry: RegistryReader | None = None  # the home controller's: validated directives
    leadership: Leadership | None = None  # None: a daemon alone on SQLite, which leads
    _announced: set[tuple[str, ...]] = field(default_factory=set)

    @property
    def home(self) -> str:
        return self.site.home_cluster

    def store_of(self, cluster: str) -> str:
        return self.site.cluster(cluster).store

    def repository(self, store_name: str, *, paced: bool = False) -> Repository:
        """The checkpoints in store `store_name`, under the site's master keys: over its
        store for small objects, or with `paced` over the bandwidth-capped one (bulk copies
        and probes)."""
        return Repository((self.paced_stores if paced else self.stores)[store_name],
                          self.master_keys)

    def forget_announcements(self) -> None:
        """A new term of leadership says again what a restarted daemon would."""
        self._announced.clear()

    def say_once(self, key: tuple[str, ...], kind: str, logical_job: str | None, what: str,
                 why: str, **detail: Any) -> None:
        """An audit entry that a level-triggered loop would otherwise repeat every round
        (waiting for a lease, a stranded job, a move awaiting approval)."""
        if key in self._announced:
            return
        self._announced.add(key)
        self.audit.append(kind, logical_job, what, why, **detail)
