"""The home job stages its own world (issue 31: staged ahead, not on demand).

The federation daemon's key reply grants a job of a run with a declared world two trees
per root (`TreeGrant`: its inputs, environment and working directory, each in its owner's
domain and in the root's shared one, with the domains' key rings; federation.worldgrants).
The daemon never reads those paths: the home job does, as its owner, so it reads exactly
what its owner may. For each root it stages a snapshot into the home store, into the
shared tree while every user may read the root (slurm_geo.stage.public; the rules against
what other grantees write there: slurm_geo.stage.sharing), else into its owner's
(`Trees.stage`, through a `LocalOpener`: this process's own system calls, never following
a link), and then pins what it staged in the run's world record (`worlds/<run>`, sealed
under the run key, docs/format.md §11.8), which a moved incarnation materialises and
checks. checkpoint-sync copies the sealed objects on; nothing here talks to another site.

Staging runs in a background thread of the trainer's process (`start`), at low CPU
priority, never before the first step: a first staging of a large dataset takes as long
as reading it, and training does not wait for it. Then again every `interval_s`
(`SLURM_GEO_STAGE_INTERVAL_S`, default 1800; 0: once), each pass incremental (files
unchanged by their stat are not read again, in a shared tree only since the snapshot the
run pinned; a changed file stores its new chunks only; an unchanged tree writes
nothing). A root that cannot be staged (unreadable, gone) is said once per pass in the log
and keeps its earlier pin, if any; it never stops training.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from slurm_geo.ckpt.errors import CkptError
from slurm_geo.ckpt.format.keys import RandomBytes, RunKeyRing
from slurm_geo.ckpt.stores.open_store import open_store
from slurm_geo.ckpt.stores.store import Store
from slurm_geo.errors import SlurmGeoError
from slurm_geo.lease.protocol import KeyReply, TreeGrant
from slurm_geo.stage.keys import GivenTreeKeys
from slurm_geo.stage.public import root_private
from slurm_geo.stage.record import (
    PinnedTree,
    WorldRecord,
    manifest_digest,
    read_world_record,
    write_world_record,
)
from slurm_geo.stage.sharing import NotPublic, Shared
from slurm_geo.stage.trees import Staged, Trees
from slurm_geo.stage.walk import LocalOpener, Opener

log = logging.getLogger("slurm_geo.stage")

INTERVAL_ENV = "SLURM_GEO_STAGE_INTERVAL_S"
DEFAULT_INTERVAL_S = 1800.0
NICE = 10  # the stager's threads yield the CPU to the trainer's
WHATS = ("input", "env", "workdir", "script")


@dataclass(frozen=True)
class RootStaged:
    """One root's outcome in a pass: what staging did, or why it failed."""

    grant: TreeGrant
    staged: Staged | None
    error: str | None = None


@dataclass(frozen=True)
class Pass:
    roots: tuple[RootStaged, ...]
    record: WorldRecord | None  # as written (or left standing); None: nothing pinned

    @property
    def stored_bytes(self) -> int:
        return sum(r.staged.stored_bytes for r in self.roots if r.staged is not None)

    @property
    def failed(self) -> tuple[RootStaged, ...]:
        return tuple(r for r in self.roots if r.error is not None)


def interval_from(env: Mapping[str, str]) -> float:
    """The restaging interval the environment asks for (seconds; 0: stage once)."""
    raw = env.get(INTERVAL_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_INTERVAL_S
    except ValueError:
        log.warning("%s=%r is not a number of seconds: staging every %g s", INTERVAL_ENV,
                    raw, DEFAULT_INTERVAL_S)
        return DEFAULT_INTERVAL_S
    return max(0.0, value)


class HomeStager:
    """Stages the granted roots of one run's world into `store` as this process's user,
    and keeps the run's world record pinning the latest snapshot of each."""

    def __init__(self, store: Store, run: str, run_ring: RunKeyRing,
                 grants: Sequence[TreeGrant], *,
                 opener_for: Callable[[str], Opener] = LocalOpener,
                 clock: Callable[[], float] = time.time,
                 random_bytes: RandomBytes = os.urandom):
        self.store = store
        self.run = run
        self.run_ring = run_ring
        self.grants = tuple(g for g in grants if g.what in WHATS and g.path.startswith("/"))
        self._roots: dict[str, tuple[TreeGrant | None, TreeGrant | None]] = {}
        for g in self.grants:  # (own, shared) per path, in the grants' order
            own, shared = self._roots.get(g.path, (None, None))
            self._roots[g.path] = (own, g) if g.shared else (g, shared)
        self._try_shared: dict[str, bool] = {}
        self._opener_for = opener_for
        self._clock = clock
        self._random_bytes = random_bytes
        self._trees = Trees(store, GivenTreeKeys({g.domain: g.ring for g in self.grants}),
                            random_bytes=random_bytes)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last: Pass | None = None

    def stage_once(self) -> Pass:
        """Stage every root once, then write the world record if any pin changed."""
        earlier = self._earlier_record()
        results = tuple(self._stage_root(own, shared, earlier)
                        for own, shared in self._roots.values())
        pins: list[PinnedTree] = []
        for result in results:
            pin = self._pin(result) if result.staged is not None else (
                None if earlier is None else earlier.pinned(result.grant.path))
            trees = {g.tree for g in self._roots[result.grant.path] if g is not None}
            if pin is not None and pin.tree in trees:
                pins.append(pin)
        record = earlier
        if pins and (earlier is None or earlier.trees != tuple(pins)):
            record = WorldRecord(self.run, tuple(pins), self._clock())
            write_world_record(self.store, self.run_ring, record, self._random_bytes)
        self.last = Pass(results, record)
        return self.last

    def _stage_root(self, own: TreeGrant | None, shared: TreeGrant | None,
                    earlier: WorldRecord | None) -> RootStaged:
        """A root in its shared tree while every user may read it (slurm_geo.stage.public),
        else in its owner's tree. One found private is staged in the owner's tree from
        then on, each pass noting whether it became readable to all again."""
        if shared is not None and self._try_shared.get(shared.path, True):
            why = root_private(shared.path)
            if why is None:
                pin = None if earlier is None else earlier.pinned(shared.path)
                pinned = None if pin is None or pin.tree != shared.tree else (
                    pin.snapshot, pin.manifest_sha256)
                try:
                    return self._stage(shared, Shared(pinned))
                except NotPublic as exc:
                    why = str(exc)
            self._try_shared[shared.path] = False
            log.info("%s %s is staged for its owner only: %s", shared.what, shared.path,
                     why)
        if own is None:
            assert shared is not None
            return RootStaged(shared, None, f"{shared.path} is not readable by every user "
                              "and no tree of its owner's was granted")
        result = self._stage(own, None, note_public=shared is not None)
        if shared is not None and result.staged is not None and result.staged.public:
            self._try_shared[shared.path] = True  # the next pass shares it again
        return result

    def _stage(self, grant: TreeGrant, shared: Shared | None, note_public: bool = False
               ) -> RootStaged:
        try:
            staged = self._trees.stage(grant.tree, self._opener_for(grant.path), grant.path,
                                       grant.domain, shared=shared, note_public=note_public)
        except NotPublic:
            raise
        except (SlurmGeoError, OSError) as exc:
            log.warning("not staged: %s %s: %s", grant.what, grant.path, exc)
            return RootStaged(grant, None, str(exc))
        if staged.skipped:
            log.info("staged %s %s without %d device(s), FIFO(s) or socket(s): %s",
                     grant.what, grant.path, len(staged.skipped), ", ".join(staged.skipped[:5]))
        return RootStaged(grant, staged)

    def _pin(self, result: RootStaged) -> PinnedTree:
        """The pin of what was staged, bound to the manifest object as staging read or
        wrote it (not as it lies now: a grantee of a shared tree may replace a snapshot
        object he wrote; then the pin refuses it, never follows it)."""
        assert result.staged is not None
        grant, snapshot = result.grant, result.staged.manifest.snapshot
        return PinnedTree(grant.what, grant.path, grant.tree, grant.domain,  # type: ignore[arg-type]
                          snapshot, result.staged.manifest.sha256
                          or manifest_digest(self.store, grant.tree, snapshot))

    def _earlier_record(self) -> WorldRecord | None:
        try:
            return read_world_record(self.store, self.run_ring, self.run)
        except CkptError as exc:  # another key's, or damaged: this pass writes a new one
            log.warning("the world record of run %s does not open (%s): writing it anew",
                        self.run, exc)
            return None

    # --- in the background -------------------------------------------------------------

    def start(self, interval_s: float = DEFAULT_INTERVAL_S) -> threading.Thread:
        """Stage in a daemon thread now, then every `interval_s` (0: once) until `stop`."""
        self._thread = threading.Thread(target=self._loop, args=(interval_s,),
                                        name="slurm-geo-stage", daemon=True)
        self._thread.start()
        return self._thread

    def stop(self, wait_s: float = 0.0) -> None:
        """No further pass; wait up to `wait_s` for the one under way (it is cut where the
        process exits: the snapshot it was writing is never committed, the last stands)."""
        self._stop.set()
        if self._thread is not None and wait_s > 0:
            self._thread.join(wait_s)

    def _loop(self, interval_s: float) -> None:
        _lower_priority()
        while not self._stop.is_set():
            try:
                done = self.stage_once()
                log.info("staged the world of run %s: %d root(s), %d new byte(s), %d "
                         "failed", self.run, len(done.roots), done.stored_bytes,
                         len(done.failed))
            except Exception:  # noqa: BLE001 - staging never stops training
                log.exception("staging the world of run %s failed", self.run)
            if interval_s <= 0 or self._stop.wait(interval_s):
                return


def _lower_priority() -> None:
    """This thread (and the threads it starts, which inherit it) at a lower CPU priority:
    Linux keeps a nice value per thread."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
    except (AttributeError, OSError):
        pass


def start_home_staging(store: Store, run: str, run_ring: RunKeyRing,
                       grants: Sequence[TreeGrant],
                       env: Mapping[str, str] = os.environ) -> HomeStager | None:
    """A stager running in the background for `grants`; None where there are none."""
    if not grants:
        return None
    stager = HomeStager(store, run, run_ring, grants)
    stager.start(interval_from(env))
    return stager


def for_key_reply(reply: KeyReply, generation: int, store_url: str, store_endpoint: str = "",
                  env: Mapping[str, str] = os.environ) -> HomeStager | None:
    """What a FederatedRun calls with its key reply: the home job (generation 0, the one
    its owner submitted, where its paths are) stages the trees the reply grants into its
    store, in the background; a moved incarnation (or a job granted none) stages
    nothing: None. A store that does not open is said in the log; training goes on."""
    if generation != 0 or not reply.trees:
        return None
    try:
        store = open_store(store_url, endpoint_url=store_endpoint or None)
    except (SlurmGeoError, OSError) as exc:
        log.warning("the world of run %s is not staged: %s", reply.run, exc)
        return None
    return start_home_staging(store, reply.run, reply.data_keys, reply.trees, env)
