"""Planned requeues and the hold note, in the job's comment (slurm_geo.policy.restarts)."""

from __future__ import annotations

import pytest

from slurm_geo.policy.restarts import (
    cap_reached,
    held_comment,
    planned_restart,
    user_comment,
    with_planned_mark,
)

HELD = ("geo: held: requeued 3 times without planning it (node failures, crashes; "
        "max_restarts = 2); fix the job, then ask an admin to release it")


@pytest.mark.parametrize(("comment", "restart", "user"), [
    ("", None, ""),
    ("sweep 7", None, "sweep 7"),
    ("geo:planned-requeue=0", 0, ""),
    ("geo:planned-requeue=12 sweep 7", 12, "sweep 7"),
    ("sweep geo:planned-requeue=1", None, "sweep geo:planned-requeue=1"),  # the user's text
    ("geo:planned-requeue=1x", None, "geo:planned-requeue=1x"),
    ("geo:planned-requeue=", None, "geo:planned-requeue="),
    (HELD, None, ""),
    (HELD + " | sweep 7", None, "sweep 7"),
    (HELD + " | geo:planned-requeue=4 sweep | 7", 4, "sweep | 7"),
])
def test_reading_a_comment(comment, restart, user):
    assert planned_restart(comment) == restart
    assert user_comment(comment) == user


@pytest.mark.parametrize(("comment", "restart", "marked"), [
    ("", 0, "geo:planned-requeue=0"),
    ("sweep 7", 2, "geo:planned-requeue=2 sweep 7"),
    ("geo:planned-requeue=2 sweep 7", 3, "geo:planned-requeue=3 sweep 7"),  # replaced
    (HELD + " | sweep 7", 5, "geo:planned-requeue=5 sweep 7"),  # released, running again
])
def test_marking_a_planned_requeue(comment, restart, marked):
    assert with_planned_mark(comment, restart) == marked
    assert planned_restart(marked) == restart


@pytest.mark.parametrize(("comment", "held"), [
    ("", HELD),
    ("sweep 7", HELD + " | sweep 7"),
    ("geo:planned-requeue=1 sweep 7", HELD + " | sweep 7"),
    (HELD + " | sweep 7", HELD + " | sweep 7"),  # held again: one note
])
def test_the_hold_note_leads_and_keeps_the_users_comment(comment, held):
    assert held_comment(comment, 3, 2) == held


@pytest.mark.parametrize(("unplanned", "max_restarts", "reached"), [
    (0, 0, False), (1, 0, True), (2, 2, False), (3, 2, True),
])
def test_the_cap_counts_unplanned_requeues(unplanned, max_restarts, reached):
    assert cap_reached(unplanned, max_restarts) is reached
