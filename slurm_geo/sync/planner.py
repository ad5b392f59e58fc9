"""What to replicate next: pure decisions over the state and the latest scans.

`reconcile` turns what the scans found into changes of the state: new replicas (PENDING
when retention tier 2 wants them off-site, SKIPPED when it does not), PENDING replicas it
no longer wants (superseded as the newest, or gone from the root) to SKIPPED, and SKIPPED
ones it wants again (promoted since) back to PENDING. `next_work` orders what is due.

Sequence numbers (for "every k-th") are given once, when a checkpoint is first seen, in
step order, so that deleting old local checkpoints (tier 1) never shifts them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from slurm_geo.policy.retention import CheckpointRef, RetentionPolicy, to_replicate
from slurm_geo.sync.scanner import Found, RootScan
from slurm_geo.sync.state import Replica, Status

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)  # to_replicate does not look at creation times


@dataclass(frozen=True)
class NewReplica:
    root: str
    run: str
    step: int
    sequence: int
    promoted: bool
    status: Status


@dataclass(frozen=True)
class Changes:
    new: tuple[NewReplica, ...] = ()
    skip: tuple[Replica, ...] = ()      # PENDING -> SKIPPED
    unskip: tuple[Replica, ...] = ()    # SKIPPED -> PENDING

    def __bool__(self) -> bool:
        return bool(self.new or self.skip or self.unskip)


@dataclass(frozen=True)
class Work:
    due: tuple[Replica, ...]     # in the order to work on them
    next_due: float | None       # when the earliest waiting replica becomes due


def reconcile(scans: Iterable[RootScan], replicas: Iterable[Replica],
              max_sequences: Mapping[tuple[str, str], int],
              policy: RetentionPolicy) -> Changes:
    """The state changes the scans call for. Roots whose scan failed change nothing."""
    found: dict[tuple[str, str], dict[int, Found]] = defaultdict(dict)
    scanned = set()
    for scan in scans:
        if scan.ok:
            scanned.add(scan.root)
            for f in scan.found:
                found[(f.root, f.run)][f.step] = f
    known: dict[tuple[str, str], dict[int, Replica]] = defaultdict(dict)
    for replica in replicas:
        if replica.root in scanned:
            known[(replica.root, replica.run)][replica.step] = replica
    new: list[NewReplica] = []
    skip: list[Replica] = []
    unskip: list[Replica] = []
    for group in sorted(set(found) | set(known)):
        n, s, u = _reconcile_run(group, found.get(group, {}), known.get(group, {}),
                                 max_sequences.get(group, -1), policy)
        new += n
        skip += s
        unskip += u
    return Changes(tuple(new), tuple(skip), tuple(unskip))


def _reconcile_run(group: tuple[str, str], present: dict[int, Found],
                   rows: dict[int, Replica], top_sequence: int, policy: RetentionPolicy,
                   ) -> tuple[list[NewReplica], list[Replica], list[Replica]]:
    root, run = group
    fresh = sorted(step for step in present if step not in rows)
    sequence = {step: r.sequence for step, r in rows.items()}
    sequence.update({step: top_sequence + 1 + i for i, step in enumerate(fresh)})
    local = [CheckpointRef(step, sequence[step], _EPOCH, present[step].promoted)
             for step in present]
    wanted = {c.step for c in to_replicate(policy, local, ())}
    new = [NewReplica(root, run, step, sequence[step], present[step].promoted,
                      Status.PENDING if step in wanted else Status.SKIPPED) for step in fresh]
    skip = [r for r in rows.values() if r.status is Status.PENDING and r.step not in wanted]
    unskip = [r for r in rows.values() if r.status is Status.SKIPPED and r.step in wanted]
    return new, skip, unskip


def next_work(replicas: Iterable[Replica], readable_roots: Iterable[str], now: float) -> Work:
    """Due replicas in order: verifications left over first (the copy is done; only the
    check is missing), then copies, each run's newest first, runs that have waited
    longest first. A copy needs its root readable; a verification does not."""
    readable = set(readable_roots)
    verify = [r for r in replicas if r.status is Status.REPLICATED]
    copy = [r for r in replicas if r.status is Status.PENDING and r.root in readable]
    waiting = [r for r in (*verify, *copy) if r.next_attempt_at > now]
    verify = sorted((r for r in verify if r.next_attempt_at <= now),
                    key=lambda r: (r.discovered_at, r.run, r.step))
    by_run: dict[tuple[str, str], list[Replica]] = defaultdict(list)
    for replica in copy:
        if replica.next_attempt_at <= now:
            by_run[(replica.root, replica.run)].append(replica)
    ranked = [(rank, r.discovered_at, r.run, -r.step, r)
              for rows in by_run.values()
              for rank, r in enumerate(sorted(rows, key=lambda r: -r.step))]
    ordered = [entry[-1] for entry in sorted(ranked, key=lambda e: e[:4])]
    next_due = min((r.next_attempt_at for r in waiting), default=None)
    return Work(tuple(verify + ordered), next_due)


def retry_delay_s(failures: int, base_s: float, max_s: float) -> float:
    """Exponential backoff: base after the first failure, doubling, at most max_s."""
    if failures < 1:
        return 0.0
    return min(max_s, base_s * 2.0 ** min(failures - 1, 60))


def lowest_steps(scans: Sequence[RootScan]) -> list[tuple[str, str, int]]:
    """(root, run, lowest step present) for each run the scans found: the planner needs
    the state's rows from there up, not a run's whole history."""
    lowest: dict[tuple[str, str], int] = {}
    for scan in scans:
        for f in scan.found:
            key = (f.root, f.run)
            lowest[key] = min(lowest.get(key, f.step), f.step)
    return [(root, run, step) for (root, run), step in sorted(lowest.items())]
