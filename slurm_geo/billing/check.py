"""`billing check`: does the billing database hold what its sources account for? Pure.

Per cluster, the incarnations that ran in the compared window, as the billing database
holds them and as the cluster's accounting (sacct, slurmrestd) returns them now: job count,
incarnation count, CPU-seconds and GPU-seconds, counted with the same arithmetic the cost
lines use (`costs.billed_seconds`). Per egress source, the transfers that finished in the
window: count and bytes. Every disagreement is a `Difference`, one line each: first the
totals that differ, then the incarnations (or transfers) that make them differ, by name,
up to NAMED per source.

Each incarnation is keyed by slurmdbd's own key (job id, submit time), as ingest stores
it, so a requeue is its own entry on both sides; a transfer by checkpoint-sync's key (run,
step, object, kind, start).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from slurm_geo.billing.costs import billed_seconds
from slurm_geo.billing.periods import Period, iso

NAMED = 5  # incarnations or transfers named per source; the rest are counted


class Incarnation(NamedTuple):
    """What the comparison needs of one incarnation (a `jobs` row, or a record as ingest
    would store it)."""

    job_id: int
    submit_ts: int
    start_ts: int | None
    end_ts: int | None
    elapsed_s: int
    cpus: int
    gpus: int
    as_of: int

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> Incarnation:
        return cls(*(row[name] for name in cls._fields))


IncarnationKey = tuple[int, int]          # (job id, submit time)
Usage = dict[IncarnationKey, tuple[int, int]]  # -> (cpu-seconds, gpu-seconds) in the window
TransferKey = tuple[str, int, str, str, float]  # (run, step, object, kind, started at)
Transfers = dict[TransferKey, int]         # -> bytes


def usage(incarnations: Iterable[Incarnation], window: Period) -> Usage:
    """CPU- and GPU-seconds of each incarnation that ran in `window`. One that began and
    ended within the same second there (a job requeuing itself at once) is an entry worth
    nothing: missing on one side, it is still named."""
    found: Usage = {}
    for inc in incarnations:
        span = billed_seconds(inc.start_ts, inc.end_ts, inc.elapsed_s, inc.as_of, window)
        if span is not None:
            found[(inc.job_id, inc.submit_ts)] = (inc.cpus * span[2], inc.gpus * span[2])
        elif inc.start_ts is not None and inc.end_ts == inc.start_ts \
                and window.contains(inc.start_ts):
            found[(inc.job_id, inc.submit_ts)] = (0, 0)
    return found


class Windows(NamedTuple):
    """A source's part of a period: `compared` (None: nothing), and `uncompared`, what
    ingest read past it, where the source may still be recording: [since, until), and when
    an ingest will have it settled (`after`)."""

    compared: Period | None
    uncompared: tuple[int, int, int] | None


def windows(period: Period, covered: int | None, ingested: int | None, now: int,
            settle_s: int) -> Windows:
    """Where `billing check` compares a source in `period`: up to where ingest read it
    completely and settled (`covered`; a source never ingested, up to now less `settle_s`,
    so that all it holds shows as missing), and what billing holds past that (up to
    `ingested`, the end of the latest window read) that it cannot compare yet."""
    end = min(period.end, covered if covered is not None else now - settle_s)
    compared = Period(period.label, period.start, end) if end > period.start else None
    low = max(period.start, end)
    high = min(period.end, ingested if ingested is not None else low)
    return Windows(compared, (low, high, high + settle_s) if high > low else None)


def not_compared(source: str, label: str, uncompared: tuple[int, int, int]) -> str:
    """The line naming a window billing holds but `billing check` could not compare yet."""
    since, until, after = uncompared
    return (f"{source} {label}: {iso(since)} .. {iso(until)} is billed but not compared yet "
            f"(the source may still be recording it); run `slurm-geo billing ingest` after "
            f"{iso(after)}, then check again")


def transfer_key(row: Mapping[str, Any]) -> TransferKey:
    return (row["run"], row["step"], row["object"], row["kind"], float(row["started_at"]))


@dataclass(frozen=True)
class Totals:
    jobs: int
    incarnations: int
    cpu_seconds: int
    gpu_seconds: int

    @classmethod
    def of(cls, found: Usage) -> Totals:
        return cls(len({job for job, _ in found}), len(found),
                   sum(cpu for cpu, _ in found.values()), sum(gpu for _, gpu in found.values()))

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class Difference:
    source: str      # accounting:CLUSTER, egress:checkpoint-sync, egress:federation
    measure: str     # jobs, incarnations, cpu-seconds, gpu-seconds, transfers, bytes; or
    #                  incarnation / transfer: one entry that is missing or valued otherwise
    billed: Any      # what the billing database holds (None: nothing)
    accounted: Any   # what the source holds (None: nothing)
    message: str     # the line shown

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def compare_usage(source: str, cluster: str, window: Period, billed: Usage,
                  accounted: Usage) -> list[Difference]:
    """Where billing's incarnations of `window` and the cluster's accounting disagree."""
    where = f"{source} {window.label}"
    ours, theirs = Totals.of(billed).as_dict(), Totals.of(accounted).as_dict()
    out = []
    for field_name, mine in ours.items():
        measure, slurms = field_name.replace("_", "-"), theirs[field_name]
        if mine != slurms:
            out.append(Difference(source, measure, mine, slurms, f"{where}: {measure}: Slurm "
                                  f"accounts for {slurms}, billing holds {mine}"))
    entries = _Entries(source, where, "incarnation", "Slurm's accounting", "Slurm accounts for",
                       lambda key: f"incarnation {cluster}:{key[0]} submitted {iso(key[1])}",
                       lambda pair: f"{pair[0]} cpu-s and {pair[1]} gpu-s")
    return out + entries.differences(billed, accounted)


def compare_transfers(source: str, origin: str, window: Period, billed: Transfers,
                      recorded: Transfers) -> list[Difference]:
    """Where billing's egress rows of `window` and `origin`'s own transfers disagree."""
    where = f"{source} {window.label}"
    out = []
    for measure, mine, theirs in (("transfers", len(billed), len(recorded)),
                                  ("bytes", sum(billed.values()), sum(recorded.values()))):
        if mine != theirs:
            out.append(Difference(source, measure, mine, theirs, f"{where}: {measure}: "
                                  f"{origin} recorded {theirs}, billing holds {mine}"))
    entries = _Entries(source, where, "transfer", origin, f"{origin} recorded",
                       lambda key: f"transfer {key[0]}@{key[1]} {key[2]} ({key[3]}, started "
                                   f"{iso(key[4])})",
                       lambda size: f"{size} bytes")
    return out + entries.differences(billed, recorded)


@dataclass(frozen=True)
class _Entries:
    """How the entries of one source are named in a line, and their amounts shown."""

    source: str
    where: str
    measure: str
    holder: str                       # "Slurm's accounting", "checkpoint-sync"
    says: str                         # "Slurm accounts for", "checkpoint-sync recorded"
    name: Callable[[Any], str]
    amount: Callable[[Any], str]

    def differences(self, billed: Mapping[Any, Any], theirs: Mapping[Any, Any]
                    ) -> list[Difference]:
        """A line per entry missing on one side or valued otherwise; NAMED at most."""
        lines = []
        for key in sorted(set(billed) | set(theirs)):
            mine, other = billed.get(key), theirs.get(key)
            if mine != other:
                lines.append(Difference(self.source, self.measure, _json(mine), _json(other),
                                        f"{self.where}: {self.line(key, mine, other)}"))
        if len(lines) > NAMED:
            rest = len(lines) - NAMED
            lines = lines[:NAMED] + [Difference(
                self.source, self.measure, None, None,
                f"{self.where}: and {rest} more {self.measure}(s) that differ")]
        return lines

    def line(self, key: Any, mine: Any, other: Any) -> str:
        if mine is None:
            return f"{self.name(key)} ({self.amount(other)}) is in {self.holder}, not in billing"
        if other is None:
            return f"{self.name(key)} ({self.amount(mine)}) is in billing, not in {self.holder}"
        return f"{self.name(key)}: billing holds {self.amount(mine)}, {self.says} " \
               f"{self.amount(other)}"


def _json(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
