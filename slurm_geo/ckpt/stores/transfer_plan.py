"""How puts to a store use the link: parallel streams and part sizes; pure, no I/O.

One TCP stream carries at most its window per round trip, so on a link with latency one
stream cannot fill it: it takes `ceil(rate * rtt / window)` streams to cover the link's
bandwidth-delay product. `plan_transfers` derives from the link's rate and round-trip time:

- `streams`: that many, from MIN_STREAMS to MAX_STREAMS. checkpoint-sync copies that many
  packs at once (slurm_geo.ckpt.ops.replicate), and an S3 multipart upload sends that many
  parts at once. Never one on a known link: each PUT ends with a turnaround (the last
  byte sent, the server's write, its answer) in which one stream sends nothing; a second
  object in flight fills it.
- `part_size`: large enough that the round trip each part's request costs is at most
  ROUND_TRIP_SHARE of the part's transfer at one stream's rate (in whole MiB), and never
  below DEFAULT_PART_SIZE. `TransferPlan.part_size_for` then lowers it for one object so the
  object still splits over every stream, within S3's limits (5 MiB, 10,000 parts).
- objects below `multipart_threshold` (64 MiB) still go up in one PUT: packs (16-64 MiB)
  run in parallel as whole objects, which costs no extra requests.

An unknown rate or round trip gives today's defaults: one stream, 8 MiB parts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIB = 1024 * 1024
# Packs are 16-64 MiB: one PUT each. A multipart upload of a 16 MiB pack took five
# requests (list unfinished uploads, create, two parts, complete); one checkpoint-sync
# copy of 1 GiB over a 200 Mbit/s WAN ran at 0.79 of the link that way, 0.88 with one.
DEFAULT_MULTIPART_THRESHOLD = 64 * MIB
# Parts where a round trip costs (next to) nothing, or nothing is known: requests still
# cost (above), so fewer of them than at S3's 5 MiB minimum.
DEFAULT_PART_SIZE = 8 * MIB
MIN_PART_SIZE = 5 * MIB  # S3 refuses smaller parts (but the last) when completing
MAX_PARTS = 10_000       # S3's most parts in one upload
# What one stream keeps in flight: Linux caps a socket's send buffer, and so its window, at
# net.ipv4.tcp_wmem's maximum, 4 MiB by default. A host tuned higher needs fewer streams.
TCP_WINDOW = 4 * MIB
# 15 streams cover 10 Gbit/s at 50 ms. Each holds one pack in memory twice (read from the
# root, and sent), up to 64 MiB each: 16 bound that to 2 GiB.
MAX_STREAMS = 16
# A part waits one round trip for its request's answer before the stream takes the next.
ROUND_TRIP_SHARE = 0.05
# Staging a 256 MB snapshot over the sandbox's 200 Mbit/s WAN (bench/stage_wan.py, one
# run, alternating): one stream 0.886 and 0.863 of the link, two 0.921 and 0.928.
MIN_STREAMS = 2


@dataclass(frozen=True)
class TransferPlan:
    """How puts go: `streams` objects, or parts of one object, at once; objects of
    `multipart_threshold` bytes or more in parts of about `part_size` (`part_size_for`)."""

    streams: int = 1
    part_size: int = DEFAULT_PART_SIZE
    multipart_threshold: int = DEFAULT_MULTIPART_THRESHOLD

    def __post_init__(self) -> None:
        if not 1 <= self.streams <= MAX_STREAMS:
            raise ValueError(f"streams must be 1 to {MAX_STREAMS}, not {self.streams}")
        if self.part_size < MIN_PART_SIZE:
            raise ValueError(f"S3 parts are at least {MIN_PART_SIZE} bytes, not "
                             f"{self.part_size}")

    def part_size_for(self, size: int) -> int:
        """The part size for an object of `size` bytes: `part_size`, lowered so that the
        object splits into at least `streams` parts, but never below S3's minimum, nor so
        small that it takes more than MAX_PARTS."""
        split = math.ceil(size / self.streams)
        return max(MIN_PART_SIZE, math.ceil(size / MAX_PARTS), min(self.part_size, split))


DEFAULT_PLAN = TransferPlan()  # a store opened with no link in mind: one stream, 8 MiB parts
# A link whose rate is not known: two objects at once, so that the turnaround at the end of
# each put (its checks: the source's hash, the destination's digest) never leaves it idle.
# Measured on the sandbox's 200 Mbit/s WAN (docs/benchmarks.md, "One crossing").
UNKNOWN_LINK_PLAN = TransferPlan(streams=MIN_STREAMS)


def plan_transfers(rate: float | None, rtt_s: float | None,
                   window: int = TCP_WINDOW) -> TransferPlan:
    """The plan for a link of `rate` bytes a second and `rtt_s` seconds of round trip;
    either None (or a rate of 0) when unknown, which gives the defaults."""
    if not rate or rtt_s is None:
        return UNKNOWN_LINK_PLAN
    in_flight = round(rate * rtt_s)  # bytes: rounded, so float noise adds no stream
    streams = min(MAX_STREAMS, max(MIN_STREAMS, math.ceil(in_flight / window)))
    per_stream = rate / streams if rtt_s == 0 else min(rate / streams, window / rtt_s)
    part_mib = math.ceil(round(per_stream * rtt_s / ROUND_TRIP_SHARE) / MIB)
    return TransferPlan(streams, max(DEFAULT_PART_SIZE, part_mib * MIB))
