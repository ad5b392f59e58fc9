"""The replication lifecycle and the planner: pure decisions, table-driven."""

from __future__ import annotations

import pytest

from slurm_geo.ckpt.stores.pacing import TokenBucket
from slurm_geo.policy.retention import RetentionPolicy
from slurm_geo.sync.planner import lowest_steps, next_work, reconcile, retry_delay_s
from slurm_geo.sync.scanner import Found, RootScan
from slurm_geo.sync.state import (
    LIFECYCLE,
    TRANSITIONS,
    IllegalTransition,
    Status,
)
from tests.kit.clock import ManualClock
from tests.kit.sync import S, replica

ALLOWED = {
    (S.PENDING, S.UPLOADING), (S.PENDING, S.SKIPPED),
    (S.UPLOADING, S.REPLICATED), (S.UPLOADING, S.PENDING), (S.UPLOADING, S.FAILED),
    (S.UPLOADING, S.CORRUPTED),  # a pack fails its hash at the source: nothing sent
    (S.REPLICATED, S.VERIFIED), (S.REPLICATED, S.CORRUPTED), (S.REPLICATED, S.FAILED),
    (S.FAILED, S.PENDING), (S.CORRUPTED, S.PENDING), (S.SKIPPED, S.PENDING),
    (S.VERIFIED, S.CORRUPTED),  # the scrub, re-reading it, found damage
}


@pytest.mark.parametrize("current", list(Status))
@pytest.mark.parametrize("wanted", list(Status))
def test_only_the_drawn_transitions_are_allowed(current, wanted):
    if (current, wanted) in ALLOWED:
        LIFECYCLE.check(1, current, wanted)
    else:
        with pytest.raises(IllegalTransition, match=f"{current.value} -> {wanted.value}"):
            LIFECYCLE.check(1, current, wanted)


def test_the_table_and_the_diagram_agree():
    assert {(a, b) for a, targets in TRANSITIONS.items() for b in targets} == ALLOWED


@pytest.mark.parametrize("status, terminal", [
    (S.PENDING, False), (S.UPLOADING, False), (S.REPLICATED, False), (S.VERIFIED, True),
    (S.CORRUPTED, True), (S.FAILED, True), (S.SKIPPED, True),
])
def test_terminal_statuses_need_an_admin_or_nothing(status, terminal):
    assert status.is_terminal() is terminal


def test_only_damage_leads_out_of_verified_and_nothing_but_verification_leads_in():
    assert TRANSITIONS[S.VERIFIED] == frozenset({S.CORRUPTED})
    assert [a for a, targets in TRANSITIONS.items() if S.VERIFIED in targets] == [S.REPLICATED]


# --- planner ------------------------------------------------------------------------------


def scan(*steps, run="r", root="pfs", promoted=()):
    return RootScan(root, tuple(Found(root, run, s, s in promoted) for s in steps))


def new_steps(changes, status):
    return [n.step for n in changes.new if n.status is status]


@pytest.mark.parametrize("every, present, expected_pending, expected_skipped", [
    (1, [100, 200, 300], [100, 200, 300], []),
    (2, [100, 200, 300, 400], [100, 300, 400], [200]),   # every 2nd, and the newest
    (3, [100, 200, 300, 400, 500], [100, 400, 500], [200, 300]),
])
def test_first_sight_follows_tier_2(every, present, expected_pending, expected_skipped):
    changes = reconcile([scan(*present)], [], {}, RetentionPolicy(replicate_every=every))
    assert new_steps(changes, S.PENDING) == expected_pending
    assert new_steps(changes, S.SKIPPED) == expected_skipped
    assert [n.sequence for n in changes.new] == list(range(len(present)))


def test_sequences_continue_from_the_state_so_local_pruning_never_shifts_them():
    rows = [replica(300, S.VERIFIED, sequence=2)]
    changes = reconcile([scan(300, 400, 500)], rows, {("pfs", "r"): 2},
                        RetentionPolicy(replicate_every=2))
    assert [(n.step, n.sequence, n.status) for n in changes.new] == [
        (400, 3, S.SKIPPED), (500, 4, S.PENDING)]


def test_a_pending_newest_that_a_newer_checkpoint_supersedes_is_skipped():
    rows = [replica(200, S.PENDING, sequence=1)]   # was the newest; 1 is not a multiple of 2
    changes = reconcile([scan(100, 200, 300)], rows + [replica(100, S.VERIFIED, sequence=0)],
                        {("pfs", "r"): 1}, RetentionPolicy(replicate_every=2))
    assert [r.step for r in changes.skip] == [200]
    assert new_steps(changes, S.PENDING) == [300]


def test_a_pending_checkpoint_gone_from_the_root_is_skipped_and_back_if_promoted():
    gone = reconcile([scan(300)], [replica(200, S.PENDING, sequence=1)], {("pfs", "r"): 1},
                     RetentionPolicy())
    assert [r.step for r in gone.skip] == [200]
    promoted = reconcile([scan(200, 300, promoted={200})], [replica(200, S.SKIPPED)],
                         {("pfs", "r"): 2}, RetentionPolicy(replicate_every=5))
    assert [r.step for r in promoted.unskip] == [200]


def test_uploading_replicated_and_settled_replicas_are_left_alone():
    rows = [replica(100, S.UPLOADING), replica(200, S.REPLICATED), replica(300, S.FAILED),
            replica(400, S.CORRUPTED)]
    assert not reconcile([scan(500)], rows, {("pfs", "r"): 3}, RetentionPolicy()).skip


def test_a_root_that_could_not_be_scanned_changes_nothing():
    failed = RootScan("pfs", error="not mounted")
    assert not reconcile([failed], [replica(100, S.PENDING)], {}, RetentionPolicy())


def test_next_work_verifies_first_then_each_runs_newest_longest_waiting_first():
    rows = [
        replica(100, S.PENDING, id=1, run="a", discovered_at=10),
        replica(200, S.PENDING, id=2, run="a", discovered_at=20),
        replica(100, S.PENDING, id=3, run="b", discovered_at=5),
        replica(300, S.REPLICATED, id=4, run="c", discovered_at=30),
        replica(400, S.PENDING, id=5, run="c", discovered_at=1, next_attempt_at=99),
        replica(500, S.UPLOADING, id=6, run="d"),
        replica(600, S.FAILED, id=7, run="d"),
    ]
    work = next_work(rows, ["pfs"], now=50)
    assert [r.id for r in work.due] == [4, 3, 2, 1]
    assert work.next_due == 99


def test_copies_wait_for_an_unreadable_root_but_verifications_do_not():
    rows = [replica(100, S.PENDING, id=1), replica(200, S.REPLICATED, id=2)]
    assert [r.id for r in next_work(rows, [], now=0).due] == [2]


@pytest.mark.parametrize("failures, expected", [
    (0, 0), (1, 30), (2, 60), (3, 120), (5, 480), (6, 900), (200, 900)])
def test_backoff_doubles_up_to_the_cap(failures, expected):
    assert retry_delay_s(failures, 30, 900) == expected


def test_lowest_steps_bound_what_the_planner_reads():
    scans = [scan(300, 100, 200, run="a"), scan(50, run="b", root="other")]
    assert lowest_steps(scans) == [("other", "b", 50), ("pfs", "a", 100)]


# --- bandwidth ------------------------------------------------------------------------------

@pytest.mark.parametrize("rate, sizes, expected_sleep", [
    (0, [10**9], 0.0),                       # no cap
    (1e6, [500_000, 500_000], 0.0),          # within the one-second burst
    (1e6, [1_000_000, 3_000_000], 3.0),      # the debt is repaid before going on
    (2e6, [8_000_000], 3.0),
])
def test_token_bucket_holds_the_average_rate(rate, sizes, expected_sleep):
    time = ManualClock(0.0)
    bucket = TokenBucket(rate, time)
    for size in sizes:
        bucket.take(size, time.sleep)
    assert sum(time.slept) == pytest.approx(expected_sleep)
