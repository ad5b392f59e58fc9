"""The user's Slurm stays the user's (issue 29, item 4): pure tables, no I/O.

- which pending reasons may leave a "hopeless queue" (federation/pending.py);
- who cancelled a job, read from accounting (sacct's "CANCELLED by UID", slurmdbd's
  kill_request_user) and what the daemon makes of it (federation/cancels.py).

The reconciler's rows for the same cases are in tests/test_federation_reconcile.py
(CANCELS, and the BeginTime / Dependency / hold / reservation rows of QUEUE).
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from slurm_geo.federation.decide.cancels import Canceller, accounting_overdue, canceller
from slurm_geo.federation.decide.pending import (
    MOVABLE_REASONS,
    STAYS_REASONS,
    queue_move_blocker,
    reason_word,
)
from slurm_geo.slurm import parse
from slurm_geo.slurm.client import cancel_requester, job_from_records
from slurm_geo.slurm.models import AccountingRecord, JobInfo, JobState

T0 = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize(("reason", "moves", "says"), [
    ("Priority", True, ""),
    ("Resources", True, ""),
    ("None", True, ""),
    ("", True, ""),
    ("ReqNodeNotAvail, UnavailableNodes:onprem-n1", True, ""),
    ("BeginTime", False, "--begin"),
    ("Dependency", False, "--dependency"),
    ("DependencyNeverSatisfied", False, "never be satisfied"),
    ("JobHeldUser", False, "its owner holds it"),
    ("JobHeldAdmin", False, "an admin holds it"),
    ("Reservation", False, "reservation"),
    ("PartitionDown", False, "partition down"),
    ("AssocGrpCPULimit", False, "limit of its account"),
    ("QOSMaxWallDurationPerJobLimit", False, "limit of its QOS"),
    ("SomeReasonOfANewerSlurm", False, "SomeReasonOfANewerSlurm"),
])
def test_only_a_busy_queue_is_hopeless(reason, moves, says):
    blocker = queue_move_blocker(reason)
    assert (blocker is None) == moves, blocker
    if says:
        assert blocker is not None and says in blocker


def test_the_tables_do_not_overlap_and_read_slurm_words():
    assert not set(MOVABLE_REASONS) & set(STAYS_REASONS)
    assert reason_word("ReqNodeNotAvail, UnavailableNodes:n1") == "ReqNodeNotAvail"
    assert reason_word("  ") == "None"


def info(state: JobState, by: str | None, *, user: str = "alice",
         uid: int | None = 2001) -> JobInfo:
    return JobInfo("onprem", 7, "train", state, "None", user, "ml", "batch", "", 0, T0, T0,
                   T0, 60, 0, uid=uid, gid=uid, cancelled_by=by)


@pytest.mark.parametrize(("state", "by", "uid", "expected"), [
    (JobState.CANCELLED, "2001", 2001, Canceller.OWNER),        # sacct: CANCELLED by 2001
    (JobState.CANCELLED, "alice", 2001, Canceller.OWNER),       # slurmdbd JSON: a name
    (JobState.CANCELLED, "alice", None, Canceller.OWNER),       # rebuilt from accounting
    (JobState.CANCELLED, "0", 2001, Canceller.OTHER),           # root
    (JobState.CANCELLED, "root", 2001, Canceller.OTHER),
    (JobState.CANCELLED, "64030", 2001, Canceller.OTHER),       # the SlurmUser
    (JobState.CANCELLED, "slurm-geo", 2001, Canceller.OTHER),   # the daemon's account
    (JobState.CANCELLED, "0", 0, Canceller.OTHER),              # root's own job: no owner
    (JobState.CANCELLED, None, 2001, Canceller.UNKNOWN),        # accounting not there yet
    (JobState.CANCELLED, "2001", None, Canceller.UNKNOWN),      # a uid, no uid to compare
    (JobState.NODE_FAIL, None, 2001, Canceller.NOT_CANCELLED),
    (JobState.PREEMPTED, None, 2001, Canceller.NOT_CANCELLED),
    (JobState.COMPLETED, "2001", 2001, Canceller.NOT_CANCELLED),
])
def test_who_cancelled(state, by, uid, expected):
    assert canceller(info(state, by, uid=uid)) is expected


def test_accounting_gets_a_grace_after_the_end():
    ended = info(JobState.CANCELLED, None)
    assert not accounting_overdue(ended, T0.timestamp() + 119)
    assert accounting_overdue(ended, T0.timestamp() + 120)


@pytest.mark.parametrize(("state", "by"), [
    ("CANCELLED by 2001", "2001"),
    ("CANCELLED by 0", "0"),
    ("CANCELLED", ""),
    ("NODE_FAIL", ""),
    ("COMPLETED", ""),
])
def test_sacct_names_who_cancelled(state, by):
    assert parse.sacct_cancelled_by(state) == by


def record(state: JobState, by: str, submitted: int) -> AccountingRecord:
    at = datetime.fromtimestamp(T0.timestamp() + submitted, tz=UTC)
    return AccountingRecord("onprem", 7, "train", "alice", "ml", "batch", state, at, at, at,
                            1, {}, 0, "", cancelled_by=by)


def test_the_requester_is_the_current_incarnations():
    requeued_then_cancelled = [record(JobState.REQUEUED, "", 0),
                               record(JobState.CANCELLED, "2001", 10)]
    assert cancel_requester(requeued_then_cancelled) == "2001"
    assert job_from_records(requeued_then_cancelled).cancelled_by == "2001"
    cancelled_then_requeued = [record(JobState.CANCELLED, "0", 0),
                               record(JobState.RUNNING, "", 10)]
    assert cancel_requester(cancelled_then_requeued) is None
    assert cancel_requester([]) is None


def test_slurmdbd_json_names_who_cancelled():
    doc = {"jobs": [
        {"job_id": 7, "state": {"current": "CANCELLED", "reason": "None"},
         "kill_request_user": "alice", "time": {}},
        {"job_id": 8, "state": {"current": "COMPLETED"}, "kill_request_user": "alice",
         "time": {}},
        {"job_id": 9, "state": {"current": ["CANCELLED"]}, "time": {}},
    ]}
    assert [r.cancelled_by for r in parse.accounting(doc, "rented")] == ["alice", "", ""]


def test_sacct_parsable_rows_carry_the_requester():
    fields = ["7", "onprem", "alice", "ml", "batch", "CANCELLED by 2001",
              "2026-01-01T00:00:00", "2026-01-01T00:00:01", "2026-01-01T00:00:09", "8",
              "cpu=1", "0:15", "onprem-n1", "", "", "train"]
    (row,) = parse.parsable_accounting(["|".join(fields)], "onprem", tz=UTC)
    assert isinstance(row, AccountingRecord)
    assert (row.state, row.cancelled_by) == (JobState.CANCELLED, "2001")


# --- the whole daemon over FakeSlurm ------------------------------------------------------


@pytest.fixture
def site(tmp_path):
    from tests.kit.federation import Site

    return Site(tmp_path)


def test_an_owners_scancel_ends_the_job_cancelled_never_restarted(site):
    from slurm_geo.federation.model import JobStatus
    from tests.kit.federation import ALICE, TTL

    job_id = site.home_job_training()
    site.onprem.cancel(job_id, by_uid=ALICE.uid)  # alice's own scancel
    site.clock.advance(TTL + 1)
    site.tick(rounds=3)
    job = site.job()
    assert (job.status, job.generation, job.lost_restarts) == (JobStatus.CANCELLED, 0, 0)
    assert [s for s in site.onprem.submitted if s[0] != job_id] == []  # nothing resubmitted
    (cancel,) = [e for e in site.federation.audit.entries() if e.kind == "cancel"]
    assert (cancel.detail["who"], cancel.detail["via"]) == ("alice", "scancel")
    assert "alice (uid 2001) cancelled generation 0" in cancel.why
    assert not [k for k in site.kinds() if k.startswith(("decision: restart", "finished"))]


def test_roots_scancel_is_a_lost_job_restarted(site):
    from tests.kit.federation import TTL

    job_id = site.home_job_training()
    site.onprem.cancel(job_id, by_uid=0)
    site.clock.advance(TTL + 1)
    site.tick(rounds=2)
    job = site.job()
    assert (job.generation, job.lost_restarts) == (1, 1)
    assert not [e for e in site.federation.audit.entries() if e.kind == "cancel"]


# --- a mistyped --geo-* option names the closest directive -------------------------------

@pytest.mark.parametrize(("typed", "meant"), [
    ("geo-failovr", "geo-failover"),
    ("geo-fail-over", "geo-failover"),
    ("geo-FAILOVER", "geo-failover"),
    ("geo-resdency", "geo-residency"),
    ("geo-residence", "geo-residency"),
    ("geo-ckpt-intervall", "geo-ckpt-interval"),
    ("geo-interval", "geo-ckpt-interval"),
    ("geo-ckpt_dir", "geo-ckpt-dir"),
    ("geo-checkpoint-dir", "geo-ckpt-dir"),
    ("geo-cluster", "geo-clusters"),
    ("geo-cost-centre", "geo-cost-center"),
    ("geo-max-costs", "geo-max-cost"),
    ("geo-data-klass", "geo-data-class"),
    ("geo-colour", None),
    ("geo-budget", None),
])
def test_a_typo_names_the_closest_directive(typed, meant):
    from slurm_geo.policy.directives import closest_option

    assert closest_option(typed) == meant


def test_the_typo_message_is_one_line_naming_the_fix():
    from slurm_geo.policy.directives import DirectiveError, parse_arguments

    with pytest.raises(DirectiveError) as raised:
        parse_arguments(["--geo-failovr=auto"])
    assert str(raised.value) == "geo: unknown option --geo-failovr; did you mean --geo-failover?"
    with pytest.raises(DirectiveError) as raised:
        parse_arguments(["--geo-colour=blue"])
    assert str(raised.value).startswith("geo: unknown option --geo-colour (known: --geo-ckpt")
    assert "\n" not in str(raised.value)


def test_the_validator_prints_the_suggestion_and_exits_directive(tmp_path):
    import io

    from slurm_geo.exitcodes import ExitCode
    from slurm_geo.hooks.validator import run

    out = io.StringIO()
    assert run(["--geo-failovr=auto"], out) == ExitCode.DIRECTIVE
    assert out.getvalue() == "geo: unknown option --geo-failovr; did you mean --geo-failover?\n"
