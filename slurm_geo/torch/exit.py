"""How a rank's process ends: `run_rank(main)` runs main and ends the process with its exit
code the way torch.multiprocessing's children end, without finalizing the interpreter.

Why: torch 2.13 keeps a destroyed gloo process group alive when DTensors have used it
(FSDP2, DCP's resharding, `full_tensor`): after `destroy_process_group` its
`pt_gloo_runloop` and `gloo_tcp_loop` threads, and rank 0's `pt_tcpstore_uv`, still run.
It is then torn down while Python finalizes, where now and then a rank aborts
("terminate called without an active exception", SIGABRT) after its work is done, and
srun fails the job, or turns a requeue's exit 75 into 134. Two of the ranks CI launched
for stop 26 ended so; ranks under torch.multiprocessing, which leaves by os._exit, never
did. Clearing DTensor's caches does not free the group.
"""

from __future__ import annotations

import atexit
import os
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn


def run_rank(main: Callable[[], int | None]) -> NoReturn:
    """Run a rank's `main` and end the process with its exit code, as `sys.exit(main())`
    would: a SystemExit's code, 1 and the traceback for any other exception. Streams are
    flushed and atexit handlers run first; then os._exit, so nothing torch left running
    is torn down. Call it once main has destroyed its process group."""
    try:
        code = exit_code(main())
    except SystemExit as stop:
        code = exit_code(stop.code)
    except BaseException:
        traceback.print_exc()
        code = 1
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
