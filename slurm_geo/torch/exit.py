"""How a rank's process ends: `run_rank(main)` runs main and ends the process with its exit
code as `sys.exit(main())` would, except that the interpreter is not finalized.

Why: torch 2.13 keeps a destroyed gloo process group alive when DTensors have used it
(FSDP2, a resharded load, `full_tensor`): after `destroy_process_group` its
`pt_gloo_runloop` and `gloo_tcp_loop` threads, and rank 0's `pt_tcpstore_uv`, still run
(tests/test_torch_exit.py shows it; clearing DTensor's caches does not free the group).
Once finalization begins, Python 3.11 ends any thread that asks for the GIL by
pthread_exit; a gloo thread still finishing a collective then unwinds into C++ that
cannot unwind, and the rank aborts ("terminate called without an active exception",
SIGABRT; PyTorch's PR #179291). Two ranks leaving with 200 all-reduces in flight: a rank
aborted in 26 of 30 pairs by sys.exit, in none of 30 by run_rank. srun then fails a job
whose work was done, or turns a requeue's exit 75 into 134: two srun ranks of stop 26's
CI run ended so, after their loads. Without finalization no thread is ended that way.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import NoReturn


def run_rank(main: Callable[[], int | None]) -> NoReturn:
    """Run a rank's `main` and end the process with its exit code, as `sys.exit(main())`
    would: a SystemExit's code, 1 and the traceback for any other exception. Python's own
    exit steps run first (non-daemon threads joined, atexit handlers, streams flushed);
    then os._exit, so nothing torch left running is torn down. Call it once main has
    destroyed its process group."""
    try:
        code = exit_code(main())
    except SystemExit as stop:
        code = exit_code(stop.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # multiprocessing children do too
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing more can reach it
            pass
    os._exit(code)


def exit_code(value: object) -> int:
    """The status Python gives `sys.exit(value)`: None is 0, an int itself, anything else
    is printed to stderr and is 1."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    print(value, file=sys.stderr)
    return 1
