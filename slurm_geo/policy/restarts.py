"""Which requeues count toward [policy] max_restarts, and how a held job says why.

A job that saves its state on Slurm's warning signal (its time limit, or preemption with
`PreemptParameters=send_user_signal`) and asks to be queued again does what it should:
that requeue is *planned* and never counts. Every other one does (a node failure, a crash
under `RequeueExit`, an `scontrol requeue` without the mark): a job queued again more than
max_restarts times that way is held, however many planned requeues it also had.

The job marks a planned requeue in its Slurm comment, the one field a job may set on
itself that EpilogSlurmctld is told (SLURM_JOB_COMMENT): `geo:planned-requeue=N`, N the
incarnation that asked (SLURM_RESTART_COUNT), so that an earlier incarnation's mark never
covers a later one. The hold note goes at the front of the comment too, where `squeue -O
JobID,Reason,Comment` shows it; whatever the user wrote stays after both.
"""

from __future__ import annotations

import re

PLANNED_TAG = "geo:planned-requeue="
HELD_NOTE = "geo: held: "
_SEPARATOR = " | "
_LEADING_TAG = re.compile(re.escape(PLANNED_TAG) + r"([0-9]{1,6})(?: |$)")


def planned_restart(comment: str) -> int | None:
    """The incarnation whose requeue the comment marks as planned, if any."""
    found = _LEADING_TAG.match(_without_held_note(comment))
    return int(found[1]) if found else None


def user_comment(comment: str) -> str:
    """The comment without slurm-geo's hold note and planned-requeue mark."""
    rest = _without_held_note(comment)
    found = _LEADING_TAG.match(rest)
    return rest[found.end():] if found else rest


def with_planned_mark(comment: str, restart: int) -> str:
    """The comment a job sets before it asks to be requeued from incarnation `restart`."""
    rest = user_comment(comment)
    return f"{PLANNED_TAG}{restart}" + (f" {rest}" if rest else "")


def cap_reached(unplanned_requeues: int, max_restarts: int) -> bool:
    """Whether a job queued again unplanned this many times has used up its restarts."""
    return unplanned_requeues > max_restarts


def hold_reason(unplanned_requeues: int, max_restarts: int) -> str:
    return (f"requeued {unplanned_requeues} times without planning it (node failures, "
            f"crashes; max_restarts = {max_restarts})")


def held_comment(comment: str, unplanned_requeues: int, max_restarts: int) -> str:
    """The comment of a job held at its cap: why, what to do, then the user's own."""
    note = (f"{HELD_NOTE}{hold_reason(unplanned_requeues, max_restarts)}; fix the job, then "
            "ask an admin to release it")
    rest = user_comment(comment)
    return note + (_SEPARATOR + rest if rest else "")


def _without_held_note(comment: str) -> str:
    if not comment.startswith(HELD_NOTE):
        return comment
    _, separator, rest = comment.partition(_SEPARATOR)
    return rest if separator else ""
