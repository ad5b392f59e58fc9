"""A pass over the runs' worlds, behind the checkpoints (docs/checkpoint-sync.md, "A run's
world"): checkpoint-sync's main loop starts one only when no checkpoint is due and no
attempt or scrub is in flight, on a thread of its own, and while it runs asks it to give
way as soon as a scan finds a checkpoint due. The pass then stops before its next object
(`Yielded`), commits nothing half-done (a snapshot's manifest is its commit point, the
world record the run's) and the checkpoint goes first; the next pass resumes with what is
missing. A pass also stops once it has put `budget_bytes`, so that a big dataset never
holds the loop for long even when nothing else is waiting.

What each run's world looks like off-site is written to the `worlds` table as it goes
(slurm_geo.sync.worldstate), so the metrics show the bytes staged and pending while a
pass runs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from slurm_geo.ckpt.errors import CkptError, StoreUnavailable
from slurm_geo.ckpt.stores.open_store import paced
from slurm_geo.ckpt.stores.pacing import TokenBucket
from slurm_geo.ckpt.stores.store import LocalDirStore, Store
from slurm_geo.daemon.events import event
from slurm_geo.stage.residency import checker as residency_checker
from slurm_geo.sync.jobdirs import FILE
from slurm_geo.sync.planner import retry_delay_s
from slurm_geo.sync.runtime import Runtime
from slurm_geo.sync.state import StateDB
from slurm_geo.sync.worker import AttemptTimedOut, Guard, Interrupted
from slurm_geo.sync.worlds import WorldCopy, read_only
from slurm_geo.sync.worldstate import (
    WorldQueue,
    WorldRow,
    add_verified_pack,
    create_worlds_table,
    put_world_row,
    remember_residency,
    synced_runs,
    verified_packs,
    world_rows,
)

log = logging.getLogger("slurm_geo.sync")

WORLD_PASS_BYTES = 256 * 1024 * 1024  # put by one pass at most (a pack may overshoot it)
WORLD_RECHECK_S = 30.0  # a complete world (or none) is looked at again after this


class Yielded(Exception):
    """The pass gives way: a checkpoint is due, or its byte budget is spent."""


class PassGuard:
    """The attempt's guard (stop, deadline), and: give way when asked, or once `budget`
    bytes were put. Checked before every object, in whichever thread puts it."""

    def __init__(self, guard: Guard, give_way: threading.Event, budget: int):
        self._guard, self._give_way, self._budget = guard, give_way, budget
        self.sent = 0
        self.pack_bytes = 0  # of tree packs: what the world has gained off-site so far
        self.first_put: float | None = None  # when the pass's first object went up
        self._lock = threading.Lock()

    def check(self) -> None:
        self._guard.check()
        if self._give_way.is_set():
            raise Yielded("a checkpoint is due")
        if self.sent >= self._budget:
            raise Yielded("the pass's byte budget is spent")

    def sleep(self, seconds: float) -> None:
        self._guard.sleep(seconds)
        self.check()

    def read(self, size: int) -> None:
        """Bytes read back to verify count against the budget as bytes put do."""
        with self._lock:
            self.sent += size

    def count(self, _name: str, size: int, _started: float, _finished: float) -> None:
        with self._lock:
            if self.first_put is None:
                self.first_put = _started
            self.sent += size
            if _name.startswith("tree-packs/"):
                self.pack_bytes += size


@dataclass(frozen=True)
class PassResult:
    runs: int = 0            # runs looked at
    yielded: str | None = None
    bytes_sent: int = 0      # put, and read back to verify
    failed: int = 0
    took_s: float = 0.0      # the pass, from its start to its end
    setup_s: float | None = None  # from its start to its first object put (None: none)


class WorldPass:
    """One pass at a time on a thread of its own; the loop starts, nudges and collects it."""

    def __init__(self, state_path: Path, stop: threading.Event, bucket: TokenBucket,
                 wake: Callable[[], None], clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic,
                 budget_bytes: int = WORLD_PASS_BYTES):
        self._state_path, self._stop, self._bucket, self._wake = state_path, stop, bucket, wake
        self._clock, self._monotonic = clock, monotonic
        self.budget_bytes = budget_bytes
        self._give_way = threading.Event()
        self._thread: threading.Thread | None = None
        self._deadline = 0.0
        self._result: PassResult | None = None
        self._error: BaseException | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None

    @property
    def stuck_at(self) -> float | None:
        return None if self._thread is None else self._deadline + 60.0

    def give_way(self) -> None:
        """Stop before the next object: a checkpoint is due."""
        if self._thread is not None and not self._give_way.is_set():
            self._give_way.set()
            event(log, "world_giving_way", reason="a checkpoint is due")

    def start(self, runs: list[tuple[str, str]], runtime: Runtime) -> None:
        self._give_way.clear()
        self._result = self._error = None
        self._deadline = self._monotonic() + runtime.sync.attempt_timeout_s
        guard = PassGuard(Guard(self._stop, self._deadline, self._monotonic), self._give_way,
                          self.budget_bytes)
        self._thread = threading.Thread(target=self._work, args=(runs, runtime, guard),
                                        name="sync-worlds", daemon=True)
        self._thread.start()

    def collect(self) -> PassResult | None:
        """The finished pass's result (None while running or idle); a pass that broke
        (its state database failed) is raised again, as an attempt's is."""
        if self._thread is None or (self._result is None and self._error is None):
            return None
        self._thread.join()
        self._thread = None
        if self._error is not None:
            raise self._error
        return self._result

    def _work(self, runs: list[tuple[str, str]], runtime: Runtime, guard: PassGuard) -> None:
        try:
            state = StateDB(self._state_path)
            try:
                self._result = run_pass(state, runs, runtime, guard, self._bucket, self._clock)
            finally:
                state.close()
        except BaseException as exc:  # handed to the main loop, which exits with it
            self._error = exc
        finally:
            self._wake()


class WorldTurns:
    """When checkpoint-sync's loop starts a world pass and which runs it takes
    (`WorldQueue`); the pass itself (`WorldPass`)."""

    def __init__(self, state_path: Path, stop: threading.Event, bucket: TokenBucket,
                 wake: Callable[[], None], clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic,
                 budget_bytes: int = WORLD_PASS_BYTES, recheck_s: float | None = None):
        self.passes = WorldPass(state_path, stop, bucket, wake, clock, monotonic, budget_bytes)
        self._recheck_s = recheck_s
        self.queue = WorldQueue(recheck_s or 0.0)
        self.due: float | None = None  # when a run's world is next due (None: not by itself)
        self._clock, self._monotonic = clock, monotonic

    @property
    def busy(self) -> bool:
        return self.passes.busy

    @property
    def stuck_at(self) -> float | None:
        return self.passes.stuck_at

    def give_way(self) -> None:
        self.passes.give_way()

    def start_due(self, state: StateDB | None, runtime: Runtime, once: bool,
                  recorded: Mapping[tuple[str, str], float] | None = None) -> bool:
        """Start a pass over the worlds of the runs due; False when none is. `recorded`:
        the (root, run) a scan found a world record for at home, and when."""
        assert state is not None
        self.queue.recheck_s = self._recheck_s or max(runtime.sync.poll_interval_s,
                                                      WORLD_RECHECK_S)
        runs = [key for key in synced_runs(state, runtime.destination)
                if runtime.reads(key[0])]
        rows = world_rows(state, runtime.destination)
        due = self.queue.due(runs, rows, self._clock(), once, recorded)
        if not due:
            self.due = self.queue.next_due(runs, rows, once, recorded)
            return False
        self.queue.seen.update(due)
        self.due = None
        self.passes.start(due, runtime)
        return True

    def collect(self) -> None:
        done = self.passes.collect()
        if done is None:
            return
        if done.bytes_sent or done.failed or done.yielded:  # a recheck that found all well
            event(log, "world_pass", runs=done.runs, bytes=done.bytes_sent,  # says nothing
                  failed=done.failed, gave_way=done.yielded or "-",
                  took_s=round(done.took_s, 2), setup_s="-" if done.setup_s is None
                  else round(done.setup_s, 2))
        if done.yielded and done.yielded != "stopping":
            self.queue.seen.clear()  # the next pass resumes where this one stopped

    def is_stuck(self) -> bool:
        stuck_at = self.passes.stuck_at
        if stuck_at is None or self._monotonic() < stuck_at:
            return False
        event(log, "stuck", logging.CRITICAL, run="-", reason="a world pass outlived its "
              "timeout; exiting so that systemd restarts us")
        return True


def run_pass(state: StateDB, runs: list[tuple[str, str]], runtime: Runtime, guard: PassGuard,
             bucket: TokenBucket | None, clock: Callable[[], float] = time.time) -> PassResult:
    """Copy the worlds of `runs` in order until done, told to give way, or out of budget."""
    started = clock()
    create_worlds_table(state)
    destination = runtime.destination

    def ended(looked: int, yielded: str | None, failed: int) -> PassResult:
        return PassResult(looked, yielded, guard.sent, failed, clock() - started,
                          None if guard.first_put is None else guard.first_put - started)
    rows = {(r.root, r.run): r for r in world_rows(state, destination)}
    sound = verified_packs(state, destination)
    looked = failed = 0
    for root, run in runs:
        row = rows.get((root, run)) or WorldRow(root, run, destination)
        writer = home_writer(runtime, root)
        source = paced(runtime.root_store(root), "root", guard=guard, clock=clock)
        residency = residency_checker(runtime.root_store(root), runtime.master_keys,
                                      runtime.destination_region,
                                      runtime.geo_policy.data_classes,
                                      partial(remember_residency, state))
        copier = WorldCopy(source if writer is not None else read_only(source),
                           paced(runtime.destination_store, "destination", bucket, guard=guard,
                                 on_put=guard.count, clock=clock),
                           runtime.master_keys, runtime.transfer_plan.streams,
                           None if writer is None else paced(writer, "root", guard=guard,
                                                             clock=clock),
                           sound, lambda name: add_verified_pack(state, destination, name,
                                                                 clock()), guard.read,
                           residency, clock, residency.forbids,
                           partial(_withdrawn, run, destination))
        progress = _Progress(state, guard, row, clock)
        try:
            done = copier.copy(row, progress)
        except Yielded as exc:
            progress.cut()
            event(log, "world_yielded", run=run, destination=destination, reason=exc)
            return ended(looked, str(exc), failed)
        except (Interrupted, AttemptTimedOut):
            progress.cut()
            return ended(looked, "stopping", failed)
        except CkptError as exc:
            failed += 1
            now = clock()
            failures = progress.row.failures + 1
            delay = retry_delay_s(failures, runtime.sync.retry_base_s, runtime.sync.retry_max_s)
            put_world_row(state, replace(progress.row, failures=failures, last_error=str(exc),
                                         next_attempt_at=now + delay, checked_at=now,
                                         complete=False, updated_at=now))
            event(log, "world_failed", logging.WARNING, run=run, destination=destination,
                  retry_in_s=round(delay, 1), error=exc,
                  side=exc.side if isinstance(exc, StoreUnavailable) else None)
            looked += 1
            continue
        now = clock()
        if done.refused is not None:
            # Not a failure to back off from: looked at again as a complete world is (its
            # record may change, or the daemon's residency record be written).
            put_world_row(state, replace(done, checked_at=now, updated_at=now, failures=0,
                                         last_error=None, next_attempt_at=now +
                                         max(runtime.sync.poll_interval_s, WORLD_RECHECK_S)))
            if done.refused != row.refused:
                event(log, "world_residency_refused", logging.WARNING, run=run,
                      destination=destination, region=runtime.destination_region,
                      reason=done.refused)
            looked += 1
            continue
        put_world_row(state, replace(done, checked_at=now, updated_at=now, last_error=None,
                                     failures=0 if done.complete else done.failures))
        if done.complete and not row.complete and done.record_sha256 is not None:
            event(log, "world_verified", run=run, destination=destination, trees=done.trees,
                  bytes=done.bytes_total)
        looked += 1
    return ended(looked, None, failed)


def home_writer(runtime: Runtime, root: str) -> Store | None:
    """Where outputs come home for `root`: a configured root's store (a local directory
    through a plain store at its real path, as its other writers write it: a shared store
    keeps its own modes); None for a job's own checkpoint directory, which checkpoint-sync
    never writes into."""
    if root not in runtime.root_urls:
        return None
    url, _endpoint = runtime.root_urls[root]
    if url.startswith(FILE):
        return LocalDirStore(Path(url.removeprefix(FILE)).resolve())
    return runtime.root_store(root)


class _Progress:
    """Writes a run's row as its copy goes; at a cut, counts the packs put since the
    sizes were last read (exact: a pack crosses as the bytes it is at home)."""

    def __init__(self, state: StateDB, guard: PassGuard, row: WorldRow,
                 clock: Callable[[], float]):
        self._state, self._guard, self.row, self._clock = state, guard, row, clock
        self._counted = guard.pack_bytes

    def __call__(self, row: WorldRow) -> None:
        self.row = replace(row, updated_at=self._clock())
        self._counted = self._guard.pack_bytes
        put_world_row(self._state, self.row)

    def cut(self) -> None:
        gained = self._guard.pack_bytes - self._counted
        self(replace(self.row, bytes_there=min(self.row.bytes_total,
                                               self.row.bytes_there + gained)))


def _withdrawn(run: str, destination: str, count: int) -> None:
    event(log, "world_withdrawn", logging.WARNING, run=run, destination=destination,
          objects=count, reason="its residency no longer allows the destination's region")
