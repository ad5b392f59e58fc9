"""Bytes over the WAN per checkpoint, as the link's own counters saw them (issue 32).

While the drill waits for checkpoints verified off-site, `LinkWatch` reads the kernel's
counters of the home-remote link (`slurm_geo.sandbox.wire`: both veth ends' interface
statistics, never checkpoint-sync's accounting) twice a second. Each checkpoint verified
before the loss was replicated between its replica's start (uploading) and its
verification, by checkpoint-sync's state; `per_checkpoint` takes the last reading
before that window and the first after it, so a figure holds every byte of the
checkpoint's replication, each way, plus whatever else crossed the link meanwhile
(etcd, the federation's calls: small beside a checkpoint worth judging). Its stored
bytes are those of the pack entries it added to the run's store (`ckpt.usage`), as
read from the destination after the drill.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from slurm_geo.config.model import SiteConfig
from slurm_geo.sandbox import Sandbox
from slurm_geo.sandbox.sites import Topology, WanLink
from slurm_geo.sandbox.wire import LinkBytes, crossing, link_bytes

if TYPE_CHECKING:
    from slurm_geo.ckpt import Repository

READ_EVERY_S = 0.5


@dataclass(frozen=True)
class Reading:
    """The link's counters, read after `before` and before `after` (time.time())."""

    before: float
    after: float
    link: LinkBytes


@dataclass(frozen=True)
class Window:
    """A checkpoint's replication: from its replica's start to its verification."""

    step: int
    started_at: float | None
    verified_at: float | None
    stored_bytes: int | None
    lag_s: float | None


def per_checkpoint(readings: list[Reading], windows: Iterable[Window]) -> list[dict[str, Any]]:
    """One row per window: its step, stored bytes and lag, and the bytes the link carried
    from the last reading before the window to the first after it (`wan_bytes`, both
    ways; `wan_out` home to remote, `wan_back` the other way); None where no reading
    brackets it (pure)."""
    rows = []
    for window in windows:
        start = max((r for r in readings if window.started_at is not None
                     and r.after <= window.started_at), key=lambda r: r.after, default=None)
        end = min((r for r in readings if window.verified_at is not None
                   and r.before >= window.verified_at), key=lambda r: r.before, default=None)
        crossed = None if start is None or end is None else crossing(start.link, end.link)
        rows.append({"step": window.step, "stored_bytes": window.stored_bytes,
                     "lag_s": window.lag_s,
                     "wan_bytes": None if crossed is None else crossed.total,
                     "wan_out": None if crossed is None else crossed.forward,
                     "wan_back": None if crossed is None else crossed.backward})
    return rows


class LinkWatch:
    """Reads a link's counters every READ_EVERY_S from `start` to `stop` (and once more
    at the stop), in a thread of its own; a failed reading is left out."""

    def __init__(self, read: Callable[[], LinkBytes], every_s: float = READ_EVERY_S,
                 clock: Callable[[], float] = time.time):
        self._read = read
        self._every_s = every_s
        self._clock = clock
        self.readings: list[Reading] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="drill-link", daemon=True)

    @classmethod
    def home_remote(cls, topo: Topology) -> LinkWatch:
        return cls(lambda: link_bytes(topo, WanLink.HOME_REMOTE))

    def start(self) -> LinkWatch:
        self._take()
        self._thread.start()
        return self

    def stop(self) -> list[Reading]:
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join(timeout=15)
            self._take()
        return list(self.readings)

    def _loop(self) -> None:
        while not self._stop.wait(self._every_s):
            self._take()

    def _take(self) -> None:
        before = self._clock()
        try:
            link = self._read()
        except (OSError, ValueError, KeyError, IndexError):  # `ip` failed or said no stats
            return
        self.readings.append(Reading(before, self._clock(), link))


def offsite_repository(sandbox: Sandbox, site: SiteConfig) -> Repository:
    """The run's checkpoints at checkpoint-sync's destination, read with the daemons' key
    to the store and the master key (root's, as the drill runs)."""
    from slurm_geo.ckpt import Repository
    from slurm_geo.ckpt.format.keys import load_master_key
    from slurm_geo.ckpt.stores.open_store import open_store
    from slurm_geo.sandbox.layout import S3_REGION

    assert site.sync is not None
    store_config, key = site.stores[site.sync.destination], sandbox.daemons_s3_key()
    store = open_store(store_config.url, endpoint_url=store_config.endpoint_url or None,
                       region_name=S3_REGION, access_key_id=key.access_key_id,
                       secret_access_key=key.secret_access_key, ca_file=store_config.ca_file)
    return Repository(store, load_master_key(sandbox.layout.master_key))


def measured(sandbox: Sandbox, site: SiteConfig, run: str, steps: list[int],
             readings: list[Reading]) -> list[dict[str, Any]]:
    """The WAN rows of the checkpoints at `steps` (those verified off-site before the
    loss): their windows from checkpoint-sync's state, their stored bytes from the
    destination's manifests (None where one does not open)."""
    from slurm_geo.ckpt.errors import CkptError
    from slurm_geo.ckpt.ops.usage import checkpoint_usage
    from slurm_geo.sync.reader import SyncStateReader

    if site.sync is None or not steps:
        return []
    replicas = {r.step: r for r in SyncStateReader(site.sync.state).replicas(run)
                if r.destination == site.sync.destination and r.step in steps}
    repository = offsite_repository(sandbox, site)
    try:
        manifests = [repository.manifest(run, step) for step in repository.steps(run)
                     if step <= max(steps)]
        added = {u.step: u.added_bytes for u in checkpoint_usage(manifests)}
    except CkptError:
        added = {}
    return per_checkpoint(readings, [
        Window(step, replicas[step].started_at, replicas[step].verified_at, added.get(step),
               replicas[step].lag_s) for step in sorted(replicas)])
