"""Billing periods and ingest watermarks: UTC epoch seconds, half-open [start, end)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import lru_cache

from slurm_geo.billing.errors import BillingError


@dataclass(frozen=True)
class Period:
    """A window [start, end) in Unix seconds, with the label the user gave it."""

    label: str
    start: int
    end: int

    def clip(self, start: int, end: int) -> tuple[int, int] | None:
        """The part of [start, end) inside the period; None when they do not overlap."""
        low, high = max(start, self.start), min(end, self.end)
        return (low, high) if high > low else None

    def contains(self, moment: float) -> bool:
        return self.start <= moment < self.end


def epoch(moment: datetime) -> int:
    return int(moment.timestamp())


def iso(seconds: int | float) -> str:
    """Unix seconds as shown to people and scripts: 2026-11-29T18:00:00Z."""
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def utc_time(text: str) -> datetime:
    """An ISO date or date-time; UTC unless it carries an offset."""
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise BillingError(f"{text!r} is not a date or time (YYYY-MM-DD or "
                           "YYYY-MM-DDTHH:MM:SS, UTC)") from None
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


@lru_cache(maxsize=512)
def month(year: int, number: int) -> Period:
    start = datetime(year, number, 1, tzinfo=UTC)
    end = datetime(year + number // 12, number % 12 + 1, 1, tzinfo=UTC)
    return Period(f"{year:04d}-{number:02d}", epoch(start), epoch(end))


def parse_period(text: str) -> Period:
    """"2026-11" (a month), "2026-11-29" (a day) or "START..END" (ISO times, UTC)."""
    text = text.strip()
    if match := re.fullmatch(r"(\d{4})-(\d{2})", text):
        year, number = int(match[1]), int(match[2])
        if not 1 <= number <= 12:
            raise BillingError(f"period {text!r}: month must be 01-12")
        return month(year, number)
    if re.fullmatch(r"\d{4}-\d{2}-\d{2}", text):
        day = utc_time(text)
        return Period(text, epoch(day), epoch(day + timedelta(days=1)))
    start_text, sep, end_text = text.partition("..")
    if sep:
        start, end = epoch(utc_time(start_text)), epoch(utc_time(end_text))
        if end <= start:
            raise BillingError(f"period {text!r} ends before it starts")
        return Period(text, start, end)
    raise BillingError(f"period {text!r} is not YYYY-MM, YYYY-MM-DD or START..END")


@lru_cache(maxsize=4096)
def _month_of_day(day: int) -> Period:
    moment = datetime.fromtimestamp(day * 86400, UTC)
    return month(moment.year, moment.month)


def months_overlapping(start: int, end: int) -> list[Period]:
    """The calendar months (UTC) that [start, end] touches, oldest first."""
    only = _month_of_day(start // 86400)
    if only.end >= end:  # the common case: one month
        return [only]
    first = datetime.fromtimestamp(start, UTC)
    year, number = first.year, first.month
    periods = []
    while True:
        period = month(year, number)
        periods.append(period)
        if period.end >= end:
            return periods
        year, number = (year + 1, 1) if number == 12 else (year, number + 1)


def next_watermark(window_end: int, unfinished_since: list[int]) -> int:
    """Where the next ingest starts: the end of this window, unless an incarnation that has
    not finished (or whose record has not settled) began earlier; the next window must
    fetch it again."""
    return min([window_end, *unfinished_since])
