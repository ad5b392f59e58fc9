"""Stop on Slurm's warning signal, after a final checkpoint, and get the job requeued.

`sbatch --signal=B:USR1@60 --requeue` makes Slurm send SIGUSR1 to the batch shell 60 s
(up to 60 s more, by Slurm's event resolution) before the time limit. The handler here
only records that the signal came; no I/O, no logging, no locks, since it runs between
two bytecodes of whatever the main thread was doing. The training loop polls
`requested` once per step, saves a final checkpoint, waits for the write, and then calls
`requeue_and_exit()`:

1. `request_requeue()` marks the requeue as planned in the job's comment (`scontrol
   update JobId=$SLURM_JOB_ID Comment=geo:planned-requeue=N ...`, what the user wrote
   kept: slurm_geo.policy.restarts), so it never counts toward the site's max_restarts,
   then runs `scontrol requeue $SLURM_JOB_ID`. A batch job that exits on its own is
   *not* requeued by Slurm (`--requeue` covers node failure and preemption), so the job
   asks for it. Slurm then ends this incarnation and queues the job again; the next
   incarnation resumes from the checkpoint.
2. The process exits with `EXIT_REQUEUE` (75, `EX_TEMPFAIL`: "try again later"). Where
   `scontrol` is not usable, a batch script can test for 75 and requeue itself, or an
   admin can list 75 in slurm.conf's `RequeueExit` for the same effect.

These are the only Slurm commands on the training side; like every Slurm command they
are run by the Slurm layer (slurm_geo.slurm.jobside: they need nothing but the job's own
id and restart count, none of the clusters' configuration), imported only when a job asks.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from collections.abc import Callable, Iterable, Mapping
from types import FrameType
from typing import Any, NoReturn

from slurm_geo.exitcodes import ExitCode

EXIT_REQUEUE = ExitCode.REQUEUE  # EX_TEMPFAIL: state saved, run again to continue

log = logging.getLogger(__name__)

Runner = Callable[..., "subprocess.CompletedProcess[Any]"]


def request_requeue(env: Mapping[str, str] = os.environ, run: Runner = subprocess.run) -> bool:
    """Ask Slurm to requeue the job this process runs in; False outside Slurm or on failure
    (slurm_geo.slurm.jobside, loaded only when a job asks)."""
    from slurm_geo.slurm.jobside import requeue_self

    return requeue_self(env, run)


class RequeueOnSignal:
    """Records SIGUSR1 (or `signals`) while installed; the loop polls `requested`.

    Use it as a context manager around the training loop; the previous handlers come
    back on exit. Install it before anything slow (imports aside): until then the
    signal's default action, for SIGUSR1 termination, applies.
    """

    def __init__(
        self,
        signals: Iterable[signal.Signals] = (signal.SIGUSR1,),
        requeue: Callable[[], bool] = request_requeue,
    ):
        self.signals = tuple(signals)
        self.received: int | None = None  # the signal number, once one came
        self._requeue = requeue
        self._previous: dict[signal.Signals, Any] = {}

    @property
    def requested(self) -> bool:
        return self.received is not None

    def request(self, signum: int = signal.SIGUSR1) -> None:
        """Act as if the signal came (a stop the script decides on itself)."""
        self.received = signum

    def install(self) -> RequeueOnSignal:
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def uninstall(self) -> None:
        while self._previous:
            signum, previous = self._previous.popitem()
            signal.signal(signum, previous)

    def __enter__(self) -> RequeueOnSignal:
        return self.install()

    def __exit__(self, *exc_info: object) -> None:
        self.uninstall()

    def requeue_and_exit(self) -> NoReturn:
        """Ask for the requeue, then exit with `EXIT_REQUEUE`. Save and wait before this."""
        self._requeue()
        raise SystemExit(EXIT_REQUEUE)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum  # nothing else: see the module docstring
