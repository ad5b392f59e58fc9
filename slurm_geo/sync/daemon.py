"""The checkpoint-sync main loop: scan, plan, hand one attempt at a time to a worker thread
(`slurm_geo.sync.inflight`), and act on its result.

Daemon manners (docs/checkpoint-sync.md): signal handlers only enqueue the signal, and
`signal.set_wakeup_fd` wakes the loop (`slurm_geo.daemon.process.Wakeup`), which drains the
queue and dispatches to `_handle_term` or `_handle_hup`. READY is sent once the state is
open and the metrics endpoint listens, WATCHDOG on every turn of the loop, STOPPING on exit.

Crash-only: nothing here needs a clean exit to be correct. A restart puts every replica
left UPLOADING back to PENDING (`StateDB.recover_interrupted`), and the next copy skips what
the destination already holds. A worker stuck past its timeout (a hung socket) cannot be
killed from Python, so the daemon exits with EXIT_STUCK and lets systemd restart it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from slurm_geo.ckpt.stores.pacing import TokenBucket
from slurm_geo.daemon.events import event
from slurm_geo.daemon.notify import Notifier
from slurm_geo.daemon.process import Wakeup, apply_priority
from slurm_geo.errors import SlurmGeoError
from slurm_geo.exitcodes import ExitCode
from slurm_geo.sync.inflight import InFlight
from slurm_geo.sync.metrics import Live, SyncCollector, serve_metrics
from slurm_geo.sync.planner import lowest_steps, next_work, reconcile, retry_delay_s
from slurm_geo.sync.runtime import Runtime
from slurm_geo.sync.scanner import RootScan
from slurm_geo.sync.scrub import (
    REPORT_RECHECK_S,
    LastScrub,
    pick_scrub,
    report_recheck_s,
    scrub_due_at,
)
from slurm_geo.sync.sources import Sources
from slurm_geo.sync.state import Replica, StaleStatus, StateDB, Status, SyncError
from slurm_geo.sync.worker import Outcome, Result
from slurm_geo.sync.worldpass import WORLD_PASS_BYTES, WorldTurns
from slurm_geo.sync.worldstate import create_worlds_table

log = logging.getLogger("slurm_geo.sync")

EXIT_OK = 0
EXIT_BEHIND = 1        # --once: some replica is not verified
EXIT_STUCK = ExitCode.DAEMON_STUCK  # an attempt outlived its timeout: systemd restarts
STOP_GRACE_S = 60.0    # SIGTERM waits this long for the objects in flight
SCRUB_MARK = "scrub_last"  # meta: when the last scrub started and the bytes it read


class Daemon:
    """Replicates what `runtime` says, keeping its state in `state_path`; SIGHUP replaces
    the runtime with `reload()`'s."""

    def __init__(self, runtime: Runtime, reload: Callable[[], Runtime], state_path: Path, *,
                 notifier: Notifier | None = None, metrics_port: int = 0,
                 metrics_address: str = "127.0.0.1", clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic,
                 handle_signals: bool = True, set_priority: bool = True,
                 world_pass_bytes: int = WORLD_PASS_BYTES):
        self._load = reload
        self.runtime = runtime
        self.state_path = state_path
        self._notifier = notifier or Notifier({})
        self._metrics_port = metrics_port
        self._metrics_address = metrics_address
        self._clock = clock
        self._monotonic = monotonic
        self._handle_signals = handle_signals
        self._set_priority = set_priority
        self.live = Live()
        self._wakeup = Wakeup()
        self._stop = threading.Event()
        self._stop_deadline: float | None = None
        self._bucket = TokenBucket(self.runtime.sync.bandwidth_mb_s * 1e6, monotonic)
        self._inflight = InFlight(state_path, self._stop, self._bucket, self._wakeup.wake,
                                  clock, monotonic)
        self._worlds = WorldTurns(state_path, self._stop, self._bucket, self._wakeup.wake,
                                  clock, monotonic, world_pass_bytes)
        self._sources = Sources()
        self._scans: list[RootScan] = []
        self._next_scan = 0.0
        self._next_due: float | None = None
        self._scrub = ScrubTurns(clock)
        self._down_until = 0.0
        self._outages = 0
        self._state: StateDB | None = None
        self._server: Any = None

    def _live_now(self) -> Live:
        """What the metrics read at a scrape (on the server's thread)."""
        self.live.skipped_files = self.runtime.skipped.count
        return self.live

    # --- life -------------------------------------------------------------------------

    def run(self, once: bool = False) -> int:
        """Replicate until SIGTERM (or, with `once`, until nothing is due); the exit code."""
        if self._set_priority:
            sync = self.runtime.sync
            apply_priority(sync.nice, sync.io_class, sync.cpu_policy)
        with self._signals_installed():
            self._state = StateDB(self.state_path)
            try:
                self._start()
                return self._loop(once)
            finally:
                self._finish()

    def _start(self) -> None:
        assert self._state is not None
        sync = self.runtime.sync
        for replica in self._state.recover_interrupted(self._clock(), sync.max_attempts):
            event(log, "recovered", logging.WARNING, run=replica.run, step=replica.step,
                  destination=replica.destination, reason="attempt cut short")
        self._scrub.resume(self._state)
        create_worlds_table(self._state)
        if self._metrics_port:
            collector = SyncCollector(self.state_path, self._live_now, self._clock)
            try:
                self._server = serve_metrics(collector, self._metrics_address,
                                             self._metrics_port)
            except OSError as exc:
                raise SyncError(f"cannot serve metrics on {self._metrics_address}:"
                                f"{self._metrics_port} ({exc.strerror}); choose another "
                                "[sync] metrics_port") from None
        self.live.destination_up[self.runtime.destination] = True
        event(log, "started", pid=os.getpid(), roots=",".join(sync.roots),
              destination=self.runtime.destination, state=self.state_path,
              metrics=f"{self._metrics_address}:{self._metrics_port}"
              if self._metrics_port else "off")
        self._notifier.ready(f"replicating to {self.runtime.destination}")

    def _finish(self) -> None:
        self._notifier.stopping()
        if self._state is not None:
            self._inflight.put_back_unfinished(self._state, self._clock())
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._state is not None:
            self._state.close()
        self._wakeup.close()
        event(log, "stopped")

    def _loop(self, once: bool) -> int:
        while True:
            self._drain_signals()
            self._notifier.watchdog()
            self._collect()
            if self._inflight.is_stuck() or self._worlds.is_stuck():
                return EXIT_STUCK
            if self._stop.is_set():
                idle = not self._inflight.busy and not self._worlds.busy
                if idle or self._monotonic() > (self._stop_deadline or 0):
                    return EXIT_OK
            else:
                if self._monotonic() >= self._next_scan:
                    self._scan()
                if self._worlds.busy:
                    if checkpoint_due(self._state, self.runtime, self._scans, self._clock()):
                        self._worlds.give_way()  # a checkpoint never waits behind a world
                elif not self._inflight.busy and not self._dispatch() and not (
                        self._monotonic() >= self._down_until
                        and self._worlds.start_due(self._state, self.runtime, once,
                                                   world_records(self._scans,
                                                                 self.live.last_scan))):
                    if once:
                        return self._once_exit_code()
                    self._dispatch_scrub()
            self._wakeup.wait(self._timeout())

    # --- signals ----------------------------------------------------------------------

    @contextmanager
    def _signals_installed(self) -> Iterator[None]:
        if not self._handle_signals:
            yield
            return
        with self._wakeup.signals_installed():
            yield

    def _drain_signals(self) -> None:
        while self._wakeup.signals:
            signum = self._wakeup.signals.popleft()
            if signum == signal.SIGHUP:
                self._handle_hup()
            else:
                self._handle_term(signum)

    def _handle_term(self, signum: int) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._stop_deadline = self._monotonic() + STOP_GRACE_S
        self._notifier.stopping()
        event(log, "stopping", signal=signal.Signals(signum).name,
              in_flight=self._inflight.label)

    def _handle_hup(self) -> None:
        self._notifier.reloading()
        try:
            runtime = self._load()
        except SlurmGeoError as exc:
            event(log, "reload_failed", logging.ERROR, error=exc)
        else:
            self._apply(runtime)
        self._notifier.ready(f"replicating to {self.runtime.destination}")

    def _apply(self, runtime: Runtime) -> None:
        old = self.runtime.sync
        new = runtime.sync
        for name in ("state", "metrics_port", "metrics_address"):
            if getattr(old, name) != getattr(new, name):
                event(log, "restart_needed", logging.WARNING, setting=name,
                      reason="takes effect at the next start")
        runtime.skipped = self.runtime.skipped  # the metric counts since the start
        self.runtime = runtime
        self._bucket.set_rate(new.bandwidth_mb_s * 1e6)
        if self._set_priority:
            apply_priority(new.nice, new.io_class, new.cpu_policy)
        self._next_scan = 0.0
        self._down_until = 0.0
        self.live.destination_up.setdefault(runtime.destination, True)
        event(log, "reloaded", roots=",".join(new.roots), destination=runtime.destination,
              bandwidth_mb_s=new.bandwidth_mb_s, poll_interval_s=new.poll_interval_s)

    # --- scanning and planning --------------------------------------------------------

    def _scan(self) -> None:
        assert self._state is not None
        runtime = self.runtime
        scans = self._sources.scan(runtime, self._state, self._clock())
        self._scans = scans
        self.live.last_scan = self._clock()
        self._next_scan = self._monotonic() + runtime.sync.poll_interval_s
        rows = self._state.for_planning(runtime.destination, lowest_steps(scans))
        changes = reconcile(scans, rows, self._state.max_sequences(runtime.destination),
                            runtime.policy)
        if changes:
            apply_changes(self._state, runtime.destination, changes, self._clock())

    def _dispatch(self) -> bool:
        """Start the first due replica; False when nothing is due."""
        assert self._state is not None
        now = self._clock()
        if self._monotonic() < self._down_until:
            return False
        runtime = self.runtime
        rows = self._state.for_planning(runtime.destination, lowest_steps(self._scans))
        work = next_work(rows, [s.root for s in self._scans if s.ok], now)
        self._next_due = work.next_due
        for replica in work.due:
            if not runtime.reads(replica.root):
                continue  # its root left the config at a reload, or its job directory
            try:
                if replica.status is Status.PENDING:
                    self._state.move(replica.id, Status.PENDING, Status.UPLOADING, now,
                                     attempts=("+", 1), started_at=now)
                else:
                    self._state.update(replica.id, replica.status, now, attempts=("+", 1),
                                       started_at=now)
            except StaleStatus:
                continue
            self._inflight.start(self._state.replica(replica.id), runtime)
            return True
        return False

    def _dispatch_scrub(self) -> None:
        assert self._state is not None
        replica = self._scrub.next_replica(self._state, self.runtime,
                                           paused=self._monotonic() < self._down_until)
        if replica is not None:
            self._inflight.start(replica, self.runtime, scrub=True)

    # --- results ----------------------------------------------------------------------

    def _collect(self) -> None:
        self._worlds.collect()
        scrubbed = self._inflight.scrubbing
        finished = self._inflight.collect()
        if finished is None:
            return
        replica, result = finished
        if scrubbed:
            assert self._state is not None
            sync = self.runtime.sync
            self._scrub.finished(self._state, result, sync.retry_base_s,
                                 report_recheck_s(sync.scrub_interval_s, sync.retry_base_s))
        destination = self.runtime.destination
        if result.outcome is Outcome.OUTAGE and result.side == "destination":
            self._outages += 1
            delay = retry_delay_s(self._outages, self.runtime.sync.retry_base_s,
                                  self.runtime.sync.retry_max_s)
            self._down_until = self._monotonic() + delay
            self.live.destination_up[destination] = False
            event(log, "outage", logging.WARNING, destination=destination,
                  retry_in_s=round(delay, 1), error=result.detail)
        elif result.outcome is not Outcome.INTERRUPTED and self._outages:
            self._outages = 0
            self.live.destination_up[destination] = True
            event(log, "destination_back", destination=destination)
        self._notifier.status(f"last: {replica.run}@{replica.step} "
                              f"{result.outcome.value}")

    # --- waiting ----------------------------------------------------------------------

    def _timeout(self) -> float:
        now = self._monotonic()
        if self._stop.is_set():
            return 0.2
        candidates = [self._next_scan - now]
        if self._notifier.watchdog_interval_s:
            candidates.append(self._notifier.watchdog_interval_s)
        stuck_at = self._inflight.stuck_at
        if stuck_at is not None:
            candidates.append(stuck_at - now)
        else:
            if self._next_due is not None:
                candidates.append(self._next_due - self._clock())
            if self._scrub.due is not None:
                candidates.append(self._scrub.due - self._clock())
            if self._worlds.due is not None:
                candidates.append(self._worlds.due - self._clock())
        if self._worlds.stuck_at is not None:
            candidates.append(self._worlds.stuck_at - now)
            if self._down_until > now:
                candidates.append(self._down_until - now)
        return max(0.0, min(candidates))

    def _once_exit_code(self) -> int:
        """Behind while a replica is unsettled, or a job's directory cannot be replicated."""
        assert self._state is not None
        unsettled = self._state.replicas(
            "destination = ? AND status NOT IN (?, ?)",
            [self.runtime.destination, Status.VERIFIED.value, Status.SKIPPED.value])
        stuck = [s for s in self._state.sources() if s.kind == "job" and s.status.is_problem]
        return EXIT_OK if not unsettled and not stuck else EXIT_BEHIND


class ScrubTurns:
    """When the next scrub may start and which verified replica it re-reads: the one read
    longest ago, at most `scrub_gb_per_day`. The pacing survives restarts as a state mark."""

    def __init__(self, clock: Callable[[], float]):
        self._clock = clock
        self._last: LastScrub | None = None
        self.due: float | None = None  # Unix seconds; None: nothing to scrub
        self._retry_at = 0.0
        self._started = 0.0

    def resume(self, state: StateDB) -> None:
        self._last = _parse_last_scrub(state.mark(SCRUB_MARK))

    def next_replica(self, state: StateDB, runtime: Runtime, paused: bool) -> Replica | None:
        """The replica to scrub now, or None while the rate, an outage or a retry says wait."""
        due = scrub_due_at(runtime.sync.scrub_gb_per_day * 1e9, self._last)
        self.due = None if due is None else max(due, self._retry_at)
        now = self._clock()
        if self.due is None or self.due > now or paused:
            return None
        replica = pick_scrub((r for r in state.replicas(
            "destination = ? AND status = ?", [runtime.destination, Status.VERIFIED.value])
            if runtime.reads(r.root)), now, runtime.sync.scrub_interval_s)  # repairs read it
        if replica is None:
            self.due = None  # until the next scan looks again
            return None
        self._started = now
        return replica

    def finished(self, state: StateDB, result: Result, retry_base_s: float,
                 recheck_s: float = REPORT_RECHECK_S) -> None:
        if result.outcome is Outcome.RETRY:
            self._retry_at = self._clock() + retry_base_s
        if result.outcome is Outcome.STALE:  # scrub-here has not run since: no news yet
            self._retry_at = self._clock() + recheck_s
        if result.outcome in (Outcome.SCRUBBED, Outcome.CORRUPTED):
            self._last = LastScrub(self._started, result.bytes_read)
            state.set_mark(SCRUB_MARK, f"{self._started} {result.bytes_read}")


def _parse_last_scrub(mark: str | None) -> LastScrub | None:
    """The scrub pacing kept across restarts: "<started_at> <bytes_read>"."""
    try:
        started, read = (mark or "").split()
        return LastScrub(float(started), int(read))
    except ValueError:
        return None



def apply_changes(state: StateDB, destination: str, changes: Any, now: float) -> None:
    """Write the planner's `reconcile` changes into the state, an event for each."""
    state.add([{"root": n.root, "run": n.run, "step": n.step, "destination": destination,
                "sequence": n.sequence, "status": n.status.value, "promoted": n.promoted}
               for n in changes.new], now)
    for n in changes.new:
        event(log, "discovered", run=n.run, step=n.step, root=n.root,
              destination=destination, status=n.status.value)
    for replica, wanted in [*((r, Status.SKIPPED) for r in changes.skip),
                            *((r, Status.PENDING) for r in changes.unskip)]:
        try:
            state.move(replica.id, replica.status, wanted, now, next_attempt_at=now)
        except StaleStatus:
            continue
        event(log, "skipped" if wanted is Status.SKIPPED else "requeued", run=replica.run,
              step=replica.step, destination=destination,
              reason="retention tier 2 no longer wants it, or it left the root"
              if wanted is Status.SKIPPED else "retention tier 2 wants it again")


def world_records(scans: list[RootScan], at: float | None) -> dict[tuple[str, str], float]:
    """(root, run) of each world record the scans (made `at`) found at home."""
    return {(scan.root, run): at or 0.0 for scan in scans for run in scan.worlds}


def checkpoint_due(state: StateDB | None, runtime: Runtime, scans: list[RootScan],
                   now: float) -> bool:
    """Whether a replica is due now (read-only: nothing moves): a world pass gives way."""
    assert state is not None
    rows = state.for_planning(runtime.destination, lowest_steps(scans))
    return any(runtime.reads(r.root) for r in next_work(
        rows, [s.root for s in scans if s.ok], now).due)
