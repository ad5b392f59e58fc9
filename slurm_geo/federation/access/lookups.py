"""How often a caller may make the daemon ask Slurm about a job it has not registered.

A home job's first lease request makes the daemon read Slurm's record of it (squeue, and
sacct for its environment) before it knows whether the job exists or is the caller's. Any
user with a MUNGE credential can send such requests for job ids of their choosing; without
a bound each one forks Slurm commands as root. So:

  - a job id Slurm did not know is remembered per (cluster, job id) for NOT_FOUND_TTL_S and
    answered 404 from memory meanwhile (a job submitted just after is asked about again
    once that passes; its trainer asks every second);
  - each caller (a uid) has a budget of LOOKUPS lookups, refilled at LOOKUPS_PER_S: past
    it a request is answered 429 and Slurm is not asked.

Both answers are refusals (audited at most once per source per interval:
federation.refusals) and change nothing. Memory is bounded: at most MAX_ENTRIES job ids and
MAX_ENTRIES callers are remembered, the oldest forgotten first. Pure but for the clock,
which is passed in.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from slurm_geo.lease.signing import Refused

NOT_FOUND_TTL_S = 10.0
LOOKUPS = 60           # a caller's burst: a user starting many jobs at once
# and its rate after that: a home job waiting for slurmdbd to record it asks once a
# second (each ask reads Slurm again), which this rate keeps up with; 555 in 10 s do not.
LOOKUPS_PER_S = 1.0
MAX_ENTRIES = 4096


class UnknownJob(Refused):
    """Slurm has no such job (asked just now, or within NOT_FOUND_TTL_S)."""

    status = 404


class TooManyLookups(Refused):
    """The caller spent its budget of Slurm lookups; it may ask again later."""

    status = 429


@dataclass(frozen=True)
class LookupLimits:
    not_found_ttl_s: float = NOT_FOUND_TTL_S
    lookups: float = LOOKUPS
    lookups_per_s: float = LOOKUPS_PER_S
    max_entries: int = MAX_ENTRIES


@dataclass
class _Bucket:
    tokens: float
    at: float


class SlurmLookups:
    """Safe to call from the service's threads; nothing slow runs under its lock."""

    def __init__(self, clock: Callable[[], float], limits: LookupLimits = LookupLimits()):
        self._clock, self.limits = clock, limits
        self._not_found: OrderedDict[tuple[str, int], float] = OrderedDict()  # -> until
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()
        self._lock = threading.Lock()

    def may_ask(self, caller: str, cluster: str, job_id: int) -> None:
        """Spend one of `caller`'s lookups on `cluster:job_id`, or refuse: UnknownJob (404)
        for a job id Slurm did not know a moment ago, TooManyLookups (429) past the
        caller's budget."""
        now = self._clock()
        with self._lock:
            until = self._not_found.get((cluster, job_id))
            if until is not None and now < until:
                raise UnknownJob(f"{cluster} has no job {job_id} (Slurm said so less than "
                                 f"{self.limits.not_found_ttl_s:g} s ago); ask again later")
            self._spend(caller, now)

    def not_found(self, cluster: str, job_id: int) -> UnknownJob:
        """Remember that Slurm has no `cluster:job_id`; the refusal to answer with."""
        with self._lock:
            self._not_found[(cluster, job_id)] = self._clock() + self.limits.not_found_ttl_s
            self._not_found.move_to_end((cluster, job_id))
            while len(self._not_found) > self.limits.max_entries:
                self._not_found.popitem(last=False)
        return UnknownJob(f"{cluster} has no job {job_id}")

    def _spend(self, caller: str, now: float) -> None:
        limits = self.limits
        bucket = self._buckets.pop(caller, None) or _Bucket(limits.lookups, now)
        self._buckets[caller] = bucket  # the most recently asking last
        while len(self._buckets) > limits.max_entries:
            self._buckets.popitem(last=False)
        bucket.tokens = min(limits.lookups,
                            bucket.tokens + (now - bucket.at) * limits.lookups_per_s)
        bucket.at = now
        if bucket.tokens < 1:
            wait_s = (1 - bucket.tokens) / limits.lookups_per_s
            raise TooManyLookups(f"{caller} asked about too many jobs the daemon does not know "
                                 f"({limits.lookups:g}, then {limits.lookups_per_s:g} a "
                                 f"second); ask again in {wait_s:.0f} s")
        bucket.tokens -= 1
