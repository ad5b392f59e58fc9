"""Throughput between stores, learned from timed probes and real transfers; pure, no I/O.

Every transfer between two stores (a probe object the daemon times, or a checkpoint that
checkpoint-sync copied) is one observation: `nbytes` moved in `seconds`. Per direction
(source store -> destination store) the model keeps two smoothed numbers:

- `bits_per_s`, from transfers of at least `min_bytes` (64 KiB by default). The current
  latency estimate is taken off the transfer's duration first, but never more than half
  of it, so a stale latency estimate cannot inflate a rate by more than 2x.
- `overhead_s`, the fixed cost of a transfer (connection, TLS, first byte), from
  transfers below `min_bytes`: their time is mostly latency, so they say little about
  throughput. A tiny transfer's overhead sample is its duration less what its bytes take
  at the current rate (its whole duration while no rate is known).

`overhead_s` is an exponentially weighted moving average: `new = alpha * sample +
(1 - alpha) * old`, the first sample taken as is. `bits_per_s` is one weighted by bytes:
a sample weighs its bytes against the path's `evidence`, the bytes behind the estimate,
each older byte discounted by `1 - alpha` per later sample:

    evidence' = (1 - alpha) * evidence + nbytes
    new       = old + (sample - old) * nbytes / evidence'

Samples of one size settle at weight `alpha` each, as a plain moving average; a sample
much larger than those before it counts for as much more. A large transfer far off the
estimate (SHIFT_FACTOR) starts it over: the link changed. That is what lets real
transfers teach the rate: the daemon's 4 MiB probe, timed when it starts, said 3.6 s for
a 444 MB checkpoint that took 6.5 and 7.9 s to replicate, and two such replications
smoothed with a plain average (weight 0.3 each) still left half the estimate the probe's.
A small transfer measures a link's bursts more than its sustained rate. Probes are also
counted, so the daemon can tell a path that real traffic keeps measured from one only
probes measure.

    predicted seconds = nbytes * 8 / bits_per_s + overhead_s      (0.0 within one store)

The daemon persists the model with `snapshot()` / `BandwidthModel.restore(rows)`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_ALPHA = 0.3
DEFAULT_MIN_BYTES = 64 * 1024
# A transfer of at least SHIFT_MIN_BYTES at more than SHIFT_FACTOR times, or less than
# 1/SHIFT_FACTOR of, the estimate is a changed link (a rate cut, another route), not
# noise: the estimate starts over from it. Measured on the sandbox's WAN cut from 200 to
# 50 Mbit/s: weighting it against what was learned before still predicted 36 s for a
# 444 MB copy that took 71 s after two such copies. Probes (4 MiB) never start it over.
SHIFT_FACTOR = 2.0
SHIFT_MIN_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Throughput:
    """The smoothed rate from one store to another, over `samples` rate observations."""

    source: str
    destination: str
    bits_per_s: float
    samples: int


@dataclass
class _Path:
    bits_per_s: float | None = None
    samples: int = 0
    overhead_s: float = 0.0
    overhead_samples: int = 0
    probe_samples: int = 0
    evidence: float = 0.0  # bytes behind bits_per_s, discounted (module docstring)


_SNAPSHOT_KEYS = ("source", "destination", "bits_per_s", "samples", "overhead_s",
                  "overhead_samples", "probe_samples")
# Snapshots from before the bytes weighting lack it; their rate then weighs as one sample
# of this many bytes: a plain average's first sample, no more.
_EVIDENCE_OF_OLD_SNAPSHOTS = DEFAULT_MIN_BYTES


class BandwidthModel:
    """Smoothed throughput and per-transfer overhead for each (source, destination)."""

    def __init__(self, *, alpha: float = DEFAULT_ALPHA, min_bytes: int = DEFAULT_MIN_BYTES):
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        if min_bytes < 0:
            raise ValueError(f"min_bytes must be >= 0, got {min_bytes!r}")
        self.alpha = alpha
        self.min_bytes = min_bytes
        self._paths: dict[tuple[str, str], _Path] = {}

    def observe(self, source: str, destination: str, nbytes: int, seconds: float, *,
                probe: bool = False) -> Throughput | None:
        """Learn from `nbytes` moved from `source` to `destination` in `seconds`.

        Returns the estimate after the update: None while only transfers below
        `min_bytes` (which teach the overhead, not the rate) have been seen on this path.
        Raises ValueError for a store to itself, nbytes < 0 or seconds <= 0 (or not finite).
        """
        if source == destination:
            raise ValueError(f"a transfer from store '{source}' to itself measures nothing")
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
        if not math.isfinite(seconds) or seconds <= 0:
            raise ValueError(f"seconds must be a finite number > 0, got {seconds!r}")
        path = self._paths.setdefault((source, destination), _Path())
        path.probe_samples += int(probe)
        if nbytes < self.min_bytes:
            self._observe_overhead(path, nbytes, seconds)
        else:
            transfer_s = max(seconds - path.overhead_s, seconds / 2)
            self._observe_rate(path, nbytes, nbytes * 8 / transfer_s)
        return self.estimate(source, destination)

    def _observe_rate(self, path: _Path, nbytes: int, bits_per_s: float) -> None:
        old = path.bits_per_s
        if old is not None and nbytes >= SHIFT_MIN_BYTES and \
                not 1 / SHIFT_FACTOR <= bits_per_s / old <= SHIFT_FACTOR:
            path.evidence = 0.0  # the link changed: what was learned of it no longer holds
        path.evidence = (1 - self.alpha) * path.evidence + nbytes
        path.bits_per_s = bits_per_s if old is None else \
            old + (bits_per_s - old) * nbytes / path.evidence
        path.samples += 1

    def _observe_overhead(self, path: _Path, nbytes: int, seconds: float) -> None:
        moving_s = nbytes * 8 / path.bits_per_s if path.bits_per_s else 0.0
        sample = max(seconds - moving_s, 0.0)
        path.overhead_s = (sample if path.overhead_samples == 0
                           else self._smooth(path.overhead_s, sample))
        path.overhead_samples += 1

    def _smooth(self, old: float | None, sample: float) -> float:
        return sample if old is None else self.alpha * sample + (1 - self.alpha) * old

    def estimate(self, source: str, destination: str) -> Throughput | None:
        """The smoothed rate from `source` to `destination`; None if none was measured."""
        path = self._paths.get((source, destination))
        if path is None or path.bits_per_s is None:
            return None
        return Throughput(source, destination, path.bits_per_s, path.samples)

    def overhead_s(self, source: str, destination: str) -> float:
        """The smoothed fixed cost of one transfer on this path; 0.0 until measured."""
        path = self._paths.get((source, destination))
        return path.overhead_s if path is not None else 0.0

    def predict_seconds(self, source: str, destination: str, nbytes: int) -> float | None:
        """Seconds to move `nbytes`: 0.0 within one store or for nothing to move, None
        while the path's rate is unknown."""
        if source == destination or nbytes == 0:
            return 0.0
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
        path = self._paths.get((source, destination))
        if path is None or path.bits_per_s is None:
            return None
        return nbytes * 8 / path.bits_per_s + path.overhead_s

    def snapshot(self) -> list[dict[str, Any]]:
        """One plain row per path, sorted; `restore` takes them back."""
        return [{"source": s, "destination": d, "bits_per_s": p.bits_per_s,
                 "samples": p.samples, "overhead_s": p.overhead_s,
                 "overhead_samples": p.overhead_samples, "probe_samples": p.probe_samples,
                 "evidence_bytes": p.evidence}
                for (s, d), p in sorted(self._paths.items())]

    @classmethod
    def restore(cls, rows: Iterable[Mapping[str, Any]], *, alpha: float = DEFAULT_ALPHA,
                min_bytes: int = DEFAULT_MIN_BYTES) -> BandwidthModel:
        """A model from `snapshot()` rows; ValueError names the first malformed row."""
        model = cls(alpha=alpha, min_bytes=min_bytes)
        for i, row in enumerate(rows):
            missing = [k for k in _SNAPSHOT_KEYS if k not in row]
            if missing:
                raise ValueError(f"bandwidth row {i}: missing {', '.join(missing)}")
            rate = row["bits_per_s"]
            if rate is not None and not (math.isfinite(rate) and rate > 0):
                raise ValueError(f"bandwidth row {i}: bits_per_s must be > 0 or None, "
                                 f"got {rate!r}")
            if not (math.isfinite(row["overhead_s"]) and row["overhead_s"] >= 0):
                raise ValueError(f"bandwidth row {i}: overhead_s must be >= 0, "
                                 f"got {row['overhead_s']!r}")
            evidence = row.get("evidence_bytes")
            if evidence is None:
                evidence = 0.0 if rate is None else _EVIDENCE_OF_OLD_SNAPSHOTS
            if not (math.isfinite(evidence) and evidence >= 0):
                raise ValueError(f"bandwidth row {i}: evidence_bytes must be >= 0, "
                                 f"got {evidence!r}")
            model._paths[(str(row["source"]), str(row["destination"]))] = _Path(
                None if rate is None else float(rate), int(row["samples"]),
                float(row["overhead_s"]), int(row["overhead_samples"]),
                int(row["probe_samples"]), float(evidence))
        return model
