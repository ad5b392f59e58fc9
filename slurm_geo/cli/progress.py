"""A progress bar on stderr for the commands a person waits on; silent in scripts.

The layers below report `(done, total)` in bytes (or in objects) through a plain callback
and know nothing of terminals; `progress()` turns that into one redrawn line, only when
stderr is a terminal and --json was not asked for. Redraws are throttled: a callback per
chunk must not cost a write per chunk. The same object counts the bytes and seconds
every command's --json reports, drawn or not.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

REDRAW_S = 0.25  # a line redrawn 4 times a second reads as moving, and costs nothing
BAR_WIDTH = 24
MIN_BAR_WIDTH = 6  # narrower than this, the bar is left out: the figures matter more
DEFAULT_COLUMNS = 80
_CLEAR_TO_END = "\x1b[K"


_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def human_bytes(count: float) -> str:
    """1536 -> '1.5 KiB': binary units, one decimal from KiB on."""
    value, unit = float(count), 0
    while value >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    return f"{count:.0f} B" if unit == 0 else f"{value:.1f} {_UNITS[unit]}"


def human_seconds(seconds: float) -> str:
    """42.3 -> '42 s', 185 -> '3m05s', 7300 -> '2h01m'."""
    whole = round(seconds)
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def _amount(count: int, unit: str) -> str:
    return human_bytes(count) if unit == "bytes" else f"{count} {unit}"


def _speed(done: int, elapsed: float, unit: str) -> str:
    rate = done / elapsed if elapsed > 0 else 0.0
    return f"{human_bytes(rate)}/s" if unit == "bytes" else f"{rate:.1f} {unit}/s"


def _figures(done: int, total: int, unit: str) -> str:
    return (f"{human_bytes(done)} / {human_bytes(total)}" if unit == "bytes"
            else f"{done}/{total} {unit}")


def bar_line(label: str, done: int, total: int | None, elapsed: float,
             unit: str = "bytes", columns: int = DEFAULT_COLUMNS) -> str:
    """The line drawn while it runs: bar, done / total, throughput and ETA (the ETA and
    the bar only when the total is known), within `columns`."""
    speed = _speed(done, elapsed, unit)
    if not total:
        return f"{label}  {_amount(done, unit)}  {speed}"[:columns]
    fraction = min(1.0, done / total)
    eta = human_seconds((total - done) * elapsed / done) if done and elapsed > 0 else "--"
    tail = f"{fraction:4.0%}  {_figures(done, total, unit)}  {speed}  ETA {eta}"
    # Room for the longest tail this total can have: the bar keeps its width as it runs.
    longest = f"100%  {_figures(total, total, unit)}  1023.9 MiB/s  ETA 59m59s"
    width = min(BAR_WIDTH, columns - len(label) - len(longest) - 5)
    if width < MIN_BAR_WIDTH:
        return f"{label}  {tail}"[:columns]
    filled = round(fraction * width)
    return f"{label}  [{'#' * filled}{'-' * (width - filled)}] {tail}"


def final_line(label: str, done: int, elapsed: float, unit: str = "bytes") -> str:
    """The line left on the terminal once it is done."""
    return f"{label}  {_amount(done, unit)} in {elapsed:.1f} s ({_speed(done, elapsed, unit)})"


class Progress:
    """Call it with `(done, total)`; draws on `stream` when `draw`, else only counts."""

    def __init__(self, label: str, stream: TextIO, draw: bool, unit: str = "bytes",
                 clock: Callable[[], float] = time.monotonic):
        self.label, self.unit = label, unit
        self.done: int = 0
        self.total: int | None = None
        self._stream, self._draw, self._clock = stream, draw, clock
        self._started = self._updated_at = clock()
        self._drawn_at: float | None = None

    @property
    def seconds(self) -> float:
        return self._clock() - self._started

    def __call__(self, done: int, total: int | None = None) -> None:
        self.done, self.total = done, total
        now = self._updated_at = self._clock()
        if self._draw and (self._drawn_at is None or now - self._drawn_at >= REDRAW_S):
            self._drawn_at = now
            self._write("\r" + bar_line(self.label, done, total, now - self._started,
                                        self.unit, self._columns() - 1) + _CLEAR_TO_END)

    def then(self, label: str, unit: str = "bytes") -> Callable[[int, int], None]:
        """The callback of the stage that follows this one, on the same bar: its first
        call leaves this stage's final line and starts counting afresh, timed from this
        stage's last update (the first report of a stage comes after some of its work)."""
        def advance(done: int, total: int) -> None:
            if (self.label, self.unit) != (label, unit):
                self.finish()
                self.label, self.unit, self._drawn_at = label, unit, None
                self._started = self._updated_at
            self(done, total)
        return advance

    def finish(self) -> None:
        if self._draw:
            line = final_line(self.label, self.done, self._updated_at - self._started,
                              self.unit)
            self._write("\r" + line[:self._columns() - 1] + _CLEAR_TO_END + "\n")

    def abandon(self) -> None:
        """Cut short: wipe the bar, so that the error is read on a clean line."""
        if self._draw and self._drawn_at is not None:
            self._write("\r" + _CLEAR_TO_END)

    def _columns(self) -> int:
        try:
            columns = os.get_terminal_size(self._stream.fileno()).columns
        except (OSError, ValueError, AttributeError):
            columns = 0
        return max(columns or DEFAULT_COLUMNS, 20)

    def _write(self, text: str) -> None:
        self._stream.write(text)
        self._stream.flush()


@contextmanager
def progress(label: str, as_json: bool, unit: str = "bytes",
             stream: TextIO | None = None) -> Iterator[Progress]:
    """A `Progress` drawn on stderr (or `stream`) only when it is a terminal and the
    command prints --json; its final line when the block ends well."""
    out = sys.stderr if stream is None else stream
    bar = Progress(label, out, draw=not as_json and out.isatty(), unit=unit)
    try:
        yield bar
    except BaseException:
        bar.abandon()
        raise
    bar.finish()
