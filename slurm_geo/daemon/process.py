"""Process manners of a daemon: a signal queue, a wakeup for its loop, its priority.

Signal handlers only append to a queue; `signal.set_wakeup_fd` makes the kernel-level
handler write to a socket that the loop waits on, so a signal ends the wait at once
without the Python handler doing any I/O. Worker threads wake the loop the same way.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

from slurm_geo.daemon.events import event

log = logging.getLogger("slurm_geo.sync")  # the name it logged under before the move

HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Wakeup:
    """What the loop sleeps on: a timeout, a signal, or `wake()` from another thread."""

    def __init__(self) -> None:
        self._r, self._w = socket.socketpair()
        for end in (self._r, self._w):
            end.setblocking(False)
        self.signals: deque[int] = deque()

    @contextmanager
    def signals_installed(self) -> Iterator[None]:
        """Route SIGTERM, SIGINT and SIGHUP into `signals` (main thread only)."""
        previous = {s: signal.signal(s, self._enqueue) for s in HANDLED}
        previous_fd = signal.set_wakeup_fd(self._w.fileno(), warn_on_full_buffer=False)
        try:
            yield
        finally:
            signal.set_wakeup_fd(previous_fd)
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _enqueue(self, signum: int, _frame: object) -> None:
        self.signals.append(signum)  # nothing else: no I/O, no locks, no logging

    def wait(self, timeout: float) -> None:
        readable, _, _ = select.select([self._r], [], [], max(0.0, timeout))
        if readable:
            try:
                while self._r.recv(4096):
                    pass
            except BlockingIOError:
                pass

    def wake(self) -> None:
        try:
            self._w.send(b"\0")
        except OSError:
            pass  # the buffer is full (a wakeup is pending anyway) or we are closing

    def close(self) -> None:
        self._r.close()
        self._w.close()


CPU_POLICIES = {"idle": "SCHED_IDLE", "batch": "SCHED_BATCH", "normal": "SCHED_OTHER"}


def apply_priority(nice: int, io_class: str, cpu_policy: str = "normal") -> None:
    """Lower our CPU and I/O priority (niceness is only ever raised). These are per thread
    on Linux: call it before starting threads, which inherit them."""
    try:
        current = os.getpriority(os.PRIO_PROCESS, 0)
        if nice > current:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
        policy = getattr(os, CPU_POLICIES[cpu_policy])
        if os.sched_getscheduler(0) != policy:
            os.sched_setscheduler(0, policy, os.sched_param(0))
    except OSError as exc:
        event(log, "priority_unchanged", logging.WARNING, nice=nice, cpu_policy=cpu_policy,
              error=exc.strerror)
    if io_class == "none":
        return
    try:
        import psutil

        process = psutil.Process()
        if io_class == "idle":
            process.ionice(psutil.IOPRIO_CLASS_IDLE)
        else:
            process.ionice(psutil.IOPRIO_CLASS_BE, 7)
    except (OSError, AttributeError, ValueError) as exc:
        event(log, "io_priority_unchanged", logging.WARNING, io_class=io_class, error=exc)
