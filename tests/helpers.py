"""Polling helpers for tests that wait on real Slurm."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def eventually(probe: Callable[[], T], accept: Callable[[T], bool], timeout_s: float = 60,
               interval_s: float = 0.5) -> T:
    """Call `probe` until `accept` holds for its result; fail with the last result seen."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if accept(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"still not accepted after {timeout_s} s: {value!r}")
        time.sleep(interval_s)
