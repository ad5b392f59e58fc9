"""The drill's waits: poll until something holds or the deadline passes, saying every
WAIT_REPORT_S what is awaited and how far it got (issue 29: `make drill` printed nothing for
minutes), and naming it when the wait runs out."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from slurm_geo.errors import SlurmGeoError
from slurm_geo.exitcodes import ExitCode

Progress = Callable[[str], None]


class DrillFailed(SlurmGeoError):
    exit_code = ExitCode.DRILL_FAILED


# A long wait says what it waits for this often, with how long it has waited and what
# `status` (if given) says of the progress made: never minutes of silence.
WAIT_REPORT_S = 30.0


def wait_for(check: Callable[[], Any], deadline: float, what: str,
             progress: Progress | None = None,
             status: Callable[[], str] | None = None) -> Any:
    started = time.time()

    def report() -> None:
        if progress is not None:
            said = f"; {status()}" if status is not None else ""
            left = max(0.0, deadline - time.time())
            progress(f"still waiting for {what}: {time.time() - started:.0f} s so far"
                     f"{said} (gives up in {left:.0f} s)")
    found = wait_or_none(check, deadline, report)
    if found is None or found is False:
        raise DrillFailed(f"timed out waiting for {what}")
    return found


def wait_or_none(check: Callable[[], Any], deadline: float,
                 every: Callable[[], None] | None = None) -> Any:
    last = time.time()
    while time.time() < deadline:
        found = check()
        if found:
            return found
        if every is not None and time.time() - last >= WAIT_REPORT_S:
            every()
            last = time.time()
        time.sleep(0.2)
    return None
