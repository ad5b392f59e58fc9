"""The lease rule, table-driven: who may train, who waits, who is fenced."""

from __future__ import annotations

import pytest

from slurm_geo.federation.decide.leases import Verdict, decide
from slurm_geo.federation.model import JobStatus
from slurm_geo.lease.protocol import Action
from tests.kit.leases import NOW, TTL, ask, job, lease

CASES = [
    ("unknown home job registers", None, None, ask(0, "onprem", 1), Verdict.REGISTER, None),
    ("unknown job elsewhere is fenced", None, None, ask(1, "rented", 9), Verdict.FENCED,
     "no logical job"),
    ("current generation is granted", job(), lease(), ask(), Verdict.GRANT, None),
    ("first lease of a generation", job(), None, ask(), Verdict.GRANT, None),
    ("older generation is fenced", job(), lease(), ask(0, "onprem", 1), Verdict.FENCED,
     "generation 0 is stale"),
    ("newer generation than known is fenced", job(), lease(), ask(2), Verdict.FENCED,
     "generation 2 is stale"),
    ("right generation, wrong cluster", job(), lease(), ask(1, "onprem"), Verdict.FENCED,
     "runs on rented"),
    ("right generation, another Slurm job", job(), lease(), ask(1, "rented", 8),
     Verdict.FENCED, "is Slurm job 7, not 8"),
    ("moving: wait", job(status=JobStatus.MOVING, job_id=None), None, ask(),
     Verdict.WAIT, "still recording"),
    ("submitted but job id not yet recorded: wait", job(job_id=None), None, ask(),
     Verdict.WAIT, None),
    ("completed job fences everyone", job(status=JobStatus.COMPLETED), lease(), ask(),
     Verdict.FENCED, "completed"),
    ("requeued incarnation waits for a live older lease", job(), lease(restart=0), ask(restart=1),
     Verdict.WAIT, "may still be training"),
    ("requeued incarnation takes an expired lease", job(), lease(restart=0, renewed=NOW - 11),
     ask(restart=1), Verdict.GRANT, None),
    ("requeued incarnation takes a released lease", job(), lease(restart=0, released=True),
     ask(restart=1), Verdict.GRANT, None),
    ("older restart is fenced", job(), lease(restart=2), ask(restart=1), Verdict.FENCED,
     "restart 1 is older"),
]


@pytest.mark.parametrize("name, current, held, request_, verdict, reason", CASES,
                         ids=[c[0] for c in CASES])
def test_decide(name, current, held, request_, verdict, reason):
    answer = decide(current, held, request_, "onprem", NOW, TTL)
    assert answer.verdict is verdict
    if reason:
        assert reason in answer.reason


def test_a_planned_move_releases_at_the_next_checkpoint_not_before():
    moving = job(move_to="onprem", move_after=40)
    assert decide(moving, lease(), ask(last_step=40), "onprem", NOW, TTL).action is Action.TRAIN
    answer = decide(moving, lease(), ask(last_step=80), "onprem", NOW, TTL)
    assert (answer.verdict, answer.action) == (Verdict.GRANT, Action.RELEASE)


def test_a_release_request_is_acknowledged_as_release():
    answer = decide(job(), lease(), ask(release=True), "onprem", NOW, TTL)
    assert (answer.verdict, answer.action) == (Verdict.GRANT, Action.RELEASE)


@pytest.mark.parametrize("renewed, released, expired", [
    (NOW - 10.0, False, False), (NOW - 10.01, False, True), (NOW, True, True)])
def test_lease_expiry(renewed, released, expired):
    assert lease(renewed=renewed, released=released).expired(NOW, TTL) is expired
