"""Legs whose cluster was lost while they ran: billed to the last moment they were known
running, flagged estimated. Pure.

When a cluster dies, Slurm's record of a job on it says nothing true about its end: it
stays RUNNING while the controller is gone, and when the controller comes back the job
ends at whatever time that happens (the federation daemon cancelling the stale
incarnation, or the node timing out), minutes or days after the job stopped. The federation
daemon's audit log has the better figure: each `outage` entry names the cluster's last
answered probe (`last_ok`), the last moment anything on it was known to run.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from slurm_geo.federation.state.audit import Entry


@dataclass(frozen=True)
class Outage:
    cluster: str
    declared_at: float   # when the daemon declared it out
    last_ok: float       # its last answered probe before that


def outages_of(entries: Iterable[Entry]) -> list[Outage]:
    """The `outage` entries of a federation audit log; one without `last_ok` (the cluster
    never answered since the daemon started) names no moment, so it is left out."""
    found = []
    for entry in entries:
        last_ok, cluster = entry.detail.get("last_ok"), entry.detail.get("cluster")
        if entry.kind == "outage" and cluster and last_ok is not None:
            found.append(Outage(str(cluster), entry.unix_time, float(last_ok)))
    return sorted(found, key=lambda outage: outage.declared_at)


def cut_short(cluster: str, start: int | None, end: int | None,
              outages: Sequence[Outage]) -> Outage | None:
    """The outage that ended this incarnation: the first of its cluster declared while it
    ran (after its start, before Slurm's end or with none), after whose last answer Slurm
    still counts it running. None: Slurm's record stands."""
    if start is None:
        return None
    for outage in outages:
        if outage.cluster != cluster or outage.declared_at <= start:
            continue
        if end is None or end > outage.last_ok:
            return outage
    return None


def start_known(cluster: str, start: int | None, trained_since: float | None,
                outages: Sequence[Outage]) -> int | None:
    """Slurm's start of a leg; or, when Slurm has it starting only after an outage of its
    cluster during which the daemon had already seen it training (its first lease), that
    first lease. The controller and slurmdbd died before the start was stored, and the
    controller, back, recorded the job starting when it was cancelled: start = end, 0 s
    (seen in the sandbox's drill, killed 10 s after the start)."""
    if trained_since is None or start is None:
        return start
    for outage in outages:
        if outage.cluster == cluster and trained_since < outage.declared_at < start:
            return int(trained_since)
    return start


def estimate_flag(outage: Outage) -> str:
    return (f"estimated: {outage.cluster} was lost (last answer "
            f"{datetime.fromtimestamp(outage.last_ok, UTC).isoformat(timespec='seconds')}); "
            "billed to then, the last moment it was known running")
