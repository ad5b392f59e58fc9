"""One manual clock for every test: time moves only when the test moves it."""

from __future__ import annotations


class ManualClock:
    """A clock to pass where code takes `clock: Callable[[], float]` (or a monotonic one).

    `now` is the time, a plain attribute a test may read or set; `advance(s)` and
    `sleep(s)` move it on (`slept` keeps each sleep asked for). `step`, when not 0, moves
    it on by that much at every read (a clock for code that must see time pass between two
    calls)."""

    def __init__(self, now: float = 1_800_000_000.0, *, step: float = 0.0) -> None:
        self.now = now
        self.step = step
        self.slept: list[float] = []

    def __call__(self) -> float:
        if self.step:
            self.now += self.step
        return float(self.now)

    def time(self) -> float:
        return self()

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def sleep(self, seconds: float) -> None:
        """For code that takes a `sleep`: sleeping is the clock moving on."""
        self.slept.append(seconds)
        self.advance(seconds)

    def __repr__(self) -> str:
        return f"ManualClock(now={self.now!r}, step={self.step!r})"
