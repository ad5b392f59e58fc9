"""Who ended a job Slurm reports CANCELLED, and what the daemon makes of it. Pure.

A job's owner may use her Slurm as she always did: her `scancel` of her own geo job is a
cancel. The daemon must not take it for a lost job (a job killed under its trainer,
which it restarts from the newest checkpoint): the logical job ends `cancelled`, audited
as a `cancel` by her, as `slurm-geo cancel` would have.

slurmctld's job record does not say who cancelled a job; accounting does: sacct prints
`CANCELLED by 2001` (the requester's uid), slurmdbd's JSON names them
(`kill_request_user`). The daemon asks accounting for a CANCELLED incarnation
(slurm_geo.slurm.client.cancel_requester) and decides here:

| Slurm says                             | the daemon                                     |
|----------------------------------------|------------------------------------------------|
| CANCELLED by the job's owner           | cancelled: ends `cancelled`, never restarted   |
| CANCELLED by anyone else (root, the    | lost: restarted from its newest checkpoint     |
|   SlurmUser, an operator, the daemon)  |   while `max_restarts` allows                  |
| CANCELLED, accounting names nobody yet | waits up to ACCOUNTING_GRACE_S after the end,  |
|                                        |   then lost                                    |
| NODE_FAIL, PREEMPTED, BOOT_FAIL, ...   | lost (no person asked for it)                  |

Why anyone but the owner counts as lost: root and the SlurmUser cancel jobs for the
system (a node taken out for maintenance, a reservation's end, `kill_invalid_depend`, a
site script); the daemon cannot tell those from an admin who means the job to end, and a
restart bounded by `max_restarts` loses less than a training run ended by mistake. An
admin who means it uses `slurm-geo cancel JOB`, which ends the logical job and is audited
with their name. The daemon's own cancels (fencing an older incarnation, leaving a
queue) are of incarnations it has already moved on from, never the current one.
"""

from __future__ import annotations

from enum import Enum

from slurm_geo.slurm.models import JobInfo, JobState

# slurmdbd records a job's end seconds after slurmctld; past this the daemon stops waiting
# for accounting to name who cancelled a job, and recovers it as lost.
ACCOUNTING_GRACE_S = 120.0


class Canceller(Enum):
    NOT_CANCELLED = "not-cancelled"  # another end: completed, failed, node failure, ...
    OWNER = "owner"                  # the job's owner: a cancel
    OTHER = "other"                  # root, the SlurmUser, an operator: lost
    UNKNOWN = "unknown"              # accounting has not named anyone (yet)


def canceller(info: JobInfo) -> Canceller:
    """Who ended the incarnation `info` describes, as far as the daemon cares."""
    if info.state is not JobState.CANCELLED:
        return Canceller.NOT_CANCELLED
    who = info.cancelled_by
    if not who:
        return Canceller.UNKNOWN
    owner = {info.user} | ({str(info.uid)} if info.uid is not None else set())
    owner.discard("")
    if who in owner and who not in ("0", "root"):
        return Canceller.OWNER
    if who.isdigit() and info.uid is None:
        return Canceller.UNKNOWN  # a uid, and the record has no uid to compare it with
    return Canceller.OTHER


def accounting_overdue(info: JobInfo, now: float) -> bool:
    """Accounting has had long enough to name who cancelled the job (an unknown end time
    counts as long enough: the daemon then does what it did before it asked)."""
    return info.end_time is None or now - info.end_time.timestamp() >= ACCOUNTING_GRACE_S


def cancelled_by_text(info: JobInfo) -> str:
    """"alice (uid 2001)" for the record's owner."""
    uid = "" if info.uid is None else f" (uid {info.uid})"
    return f"{info.user or info.cancelled_by}{uid}"
