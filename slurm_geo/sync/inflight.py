"""The one replication attempt in flight: its worker thread, its deadline, what it left.

checkpoint-sync's main loop (sync.daemon) starts at most one attempt at a time here and
collects it once the worker has woken the loop. The worker opens its own StateDB (SQLite
connections stay in their thread); the loop never waits on it except to join a thread that
has finished. A worker stuck past its timeout cannot be killed from Python: `is_stuck`
says so and the daemon exits, leaving the restart to systemd.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from slurm_geo.ckpt.stores.pacing import TokenBucket
from slurm_geo.daemon.events import event
from slurm_geo.sync.runtime import Runtime
from slurm_geo.sync.state import Replica, StateDB, Status, SyncError
from slurm_geo.sync.worker import Attempt, Guard, Limits, Result, Route

log = logging.getLogger("slurm_geo.sync")

STUCK_GRACE_S = 60.0   # past an attempt's timeout before it counts as stuck


@dataclass
class _Job:
    replica: Replica
    attempt: Callable[[StateDB], Attempt]  # built in the worker thread, with its own DB
    thread: threading.Thread
    deadline: float
    scrub: bool = False  # a re-read of a verified replica (Attempt.scrub), not an attempt
    result: Result | None = None
    error: BaseException | None = None  # the attempt itself broke (the state DB failed)

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None


class InFlight:
    """Runs one attempt at a time on a worker thread and hands its result to the loop."""

    def __init__(self, state_path: Path, stop: threading.Event, bucket: TokenBucket,
                 wake: Callable[[], None], clock: Callable[[], float],
                 monotonic: Callable[[], float]):
        self._state_path = state_path
        self._stop = stop
        self._bucket = bucket
        self._wake = wake
        self._clock = clock
        self._monotonic = monotonic
        self._job: _Job | None = None

    @property
    def busy(self) -> bool:
        return self._job is not None

    @property
    def label(self) -> str | None:
        """`run@step` of the replica in flight, for the log; None when idle."""
        job = self._job
        return None if job is None else f"{job.replica.run}@{job.replica.step}"

    @property
    def stuck_at(self) -> float | None:
        """The monotonic time at which the attempt in flight counts as stuck."""
        return None if self._job is None else self._job.deadline + STUCK_GRACE_S

    def start(self, replica: Replica, runtime: Runtime, scrub: bool = False) -> None:
        sync = runtime.sync
        limits = Limits(sync.max_attempts, sync.attempt_timeout_s, sync.retry_base_s,
                        sync.retry_max_s)
        route = Route(replica.root, runtime.root_store(replica.root),
                      runtime.region_of(replica.root), runtime.destination,
                      runtime.destination_store, runtime.destination_region,
                      runtime.transfer_plan.streams, sync.scrub_at)
        deadline = self._monotonic() + sync.attempt_timeout_s
        guard = Guard(self._stop, deadline, self._monotonic)

        def attempt(state: StateDB) -> Attempt:
            return Attempt(state, runtime.master_keys, route, guard, self._bucket, limits,
                           self._clock)

        thread = threading.Thread(target=self._work, name=f"sync-{replica.run}-{replica.step}",
                                  daemon=True)
        self._job = _Job(replica, attempt, thread, deadline, scrub)
        if scrub:
            event(log, "scrubbing", run=replica.run, step=replica.step,
                  destination=replica.destination)
        else:
            event(log, "uploading" if replica.status is Status.UPLOADING else "verifying",
                  run=replica.run, step=replica.step, destination=replica.destination,
                  attempt=replica.attempts)
        thread.start()

    def _work(self) -> None:
        job = self._job
        assert job is not None
        try:
            state = StateDB(self._state_path)
            try:
                attempt = job.attempt(state)
                job.result = (attempt.scrub if job.scrub else attempt.run)(job.replica)
            finally:
                state.close()
        except BaseException as exc:  # handed to the main loop, which exits with it
            job.error = exc
        finally:
            self._wake()

    @property
    def scrubbing(self) -> bool:
        return self._job is not None and self._job.scrub

    def collect(self) -> tuple[Replica, Result] | None:
        """The finished attempt's (or scrub's) replica and result (None while none has
        finished); an attempt that broke is raised again here."""
        job = self._job
        if job is None or not job.done:
            return None
        job.thread.join()
        self._job = None
        if job.error is not None:
            raise job.error  # crash-only: systemd restarts us, recovery puts it back
        assert job.result is not None
        return job.replica, job.result

    def is_stuck(self) -> bool:
        job = self._job
        if job is None or self._monotonic() < job.deadline + STUCK_GRACE_S:
            return False
        event(log, "stuck", logging.CRITICAL, run=job.replica.run, step=job.replica.step,
              reason="the attempt outlived its timeout; exiting so that systemd restarts us")
        return True

    def put_back_unfinished(self, state: StateDB, now: float) -> None:
        """An attempt left after the stop grace goes back to PENDING: never half-done."""
        job = self._job
        if job is None or job.done:
            return
        replica = job.replica
        try:
            current = state.replica(replica.id)
            if current.status is Status.UPLOADING:
                state.move(replica.id, Status.UPLOADING, Status.PENDING, now,
                           next_attempt_at=now)
        except SyncError:
            pass  # the worker moved it after all
