"""Why a job is still pending, and whether moving it to another cluster would help. Pure.

A queue move (docs/federation.md, "Leaving a hopeless queue") is for a job that waits
because home is busy: other jobs come first (`Priority`) or the nodes it needs are in
use (`Resources`). Many pending jobs wait for something else, which no other cluster
cures and which is their owner's or the site's choice:

- `BeginTime`: `sbatch --begin=now+2hours` asked to start later; Slurm's start estimate
  is that time, which read as a queue wait would send the job to a rented cluster to run
  at once, at rented prices;
- `Dependency`: `--dependency` waits for other jobs of the user's, which live here;
- `JobHeldUser`, `JobHeldAdmin`: `scontrol hold` (or `sbatch --hold`) by the owner or an
  admin; a move would release what a person held;
- `Reservation`: the job asked for a reservation (`--reservation`), which is here;
- account and QOS limits (`Assoc*`, `QOS*`): the site's limits on the user; moving
  would step around them.

So the decision is table-driven and closed: Slurm's reason words listed in
`MOVABLE_REASONS` allow a queue move; every other reason, including one this table does
not know (a newer Slurm's), keeps the job where it is, and says why. The reason is
squeue's `%r` / `state_reason` (squeue(1), "JOB REASON CODES"); only its first word
counts ("ReqNodeNotAvail, UnavailableNodes:n1" is `ReqNodeNotAvail`).
"""

from __future__ import annotations

import re

# The job waits for home's nodes or its turn on them: another cluster may start it sooner.
# "None": Slurm has not evaluated the job yet (a start estimate follows, or not).
MOVABLE_REASONS: dict[str, str] = {
    "None": "not yet evaluated by the scheduler",
    "Priority": "jobs of higher priority come first",
    "Resources": "the nodes it needs are in use",
    "ReqNodeNotAvail": "the nodes it needs are down, drained or reserved",
    "NodeDown": "a node it needs is down",
}

# Reasons a queue move must never be taken for, with what the daemon says (the first words
# of a wait step's reason: "stays queued: ...").
STAYS_REASONS: dict[str, str] = {
    "BeginTime": "it asked to start later (--begin); the wait is its owner's choice",
    "Dependency": "it waits for other jobs (--dependency), which run here",
    "DependencyNeverSatisfied": "its dependency can never be satisfied; its owner must "
                                "mend or cancel it",
    "JobHeldUser": "its owner holds it (scontrol hold / sbatch --hold)",
    "JobHeldAdmin": "an admin holds it (scontrol hold)",
    "Reservation": "it waits for its reservation (--reservation), which is here",
    "ReservationDeleted": "its reservation was deleted; its owner must mend or cancel it",
    "PartitionDown": "an admin set its partition down",
    "PartitionInactive": "an admin set its partition inactive",
    "BadConstraints": "its constraints can never be met; its owner must mend it",
    "InvalidAccount": "its account is not valid here",
    "InvalidQOS": "its QOS is not valid here",
}

# Families of reasons: the site's limits on an account or QOS (AssocGrpCPULimit,
# QOSMaxWallDurationPerJobLimit, ...), and the like.
_STAYS_PREFIXES: tuple[tuple[str, str], ...] = (
    ("Assoc", "a limit of its account holds it back; a move would step around the site's "
              "limit"),
    ("QOS", "a limit of its QOS holds it back; a move would step around the site's limit"),
)


def reason_word(reason: str) -> str:
    """The reason code of Slurm's pending reason text: its first word."""
    words = re.split(r"[\s,:(]+", reason.strip(), maxsplit=1)
    return words[0] if words and words[0] else "None"


def queue_move_blocker(reason: str) -> str | None:
    """None when a job pending for `reason` may leave a hopeless queue; else why it stays
    (one clause, for the daemon's wait reason and the audit)."""
    word = reason_word(reason)
    if word in MOVABLE_REASONS:
        return None
    if word in STAYS_REASONS:
        return STAYS_REASONS[word]
    for prefix, why in _STAYS_PREFIXES:
        if word.startswith(prefix):
            return f"{why} ({word})"
    return (f"it is pending for Slurm's reason {word}, which a move to another cluster "
            "does not cure")
