"""Which incarnations a window holds, and which part of a period `billing check` compares.
Table-driven, without Slurm (the sandbox's test_billing_held.py runs the same against
slurmdbd).

Issue 29: a job requeued three times and held at max_restarts had its third incarnation
unbilled (slurmctld clears the eligible time of a record held at once after its requeue, and
a plain sacct window selects by eligible time), and `billing check` said "agrees" because it
compared a window that ended before the job.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from slurm_geo.billing import check
from slurm_geo.billing.periods import Period, iso
from slurm_geo.billing.service import CheckResult
from slurm_geo.billing.sources import Outcome, SourceRun
from slurm_geo.exitcodes import ExitCode
from slurm_geo.slurm.cli_backend import PARSABLE_DELIMITER, CliSlurmClient, window_queries
from slurm_geo.slurm.parse import PARSABLE_FIELDS
from slurm_geo.slurm.windows import ENDED_STATES, one_per_incarnation

T0 = 1_795_000_000
HOUR = 3600
PERIOD = Period("2026-11", T0, T0 + 10 * HOUR)


def stamp(seconds: int) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S")


def line(submit: int, state: str, start: int | None, end: int | None, elapsed: int) -> str:
    """A `sacct --parsable2` line of job 7 (times in UTC, as the test's client reads them)."""
    fields = {"JobIDRaw": "7", "Cluster": "onprem", "User": "alice", "Account": "users",
              "Partition": "batch", "State": state, "Submit": stamp(submit),
              "Start": stamp(start) if start else "Unknown",
              "End": stamp(end) if end else "Unknown", "ElapsedRaw": str(elapsed),
              "AllocTRES": "billing=1,cpu=1,node=1", "ExitCode": "0:0", "NodeList": "n1",
              "AdminComment": "", "Comment": "", "JobName": "sbatch"}
    return PARSABLE_DELIMITER.join(fields[name] for name in PARSABLE_FIELDS)


# The reported job: requeued three times (1 + 2 + 2 CPU-seconds), then held. The third
# incarnation's record lost its eligible time: only the query by state returns it.
FIRST = line(T0, "REQUEUED", T0, T0 + 1, 1)
SECOND = line(T0 + 1, "REQUEUED", T0 + 10, T0 + 12, 2)
THIRD = line(T0 + 13, "REQUEUED", T0 + 20, T0 + 22, 2)
HELD = line(T0 + 23, "PENDING", None, None, 0)


class CannedSacct(CliSlurmClient):
    """sacct's answers for the plain window and for the window by state; no Slurm."""

    def __init__(self, plain: list[str], by_state: list[str]):
        super().__init__("onprem", Path("/nonexistent/slurm.conf"), timeout_s=1)
        self.answers = {False: plain, True: by_state}
        self.asked: list[list[str]] = []

    def _run(self, argv, action, *args, **kwargs):  # type: ignore[override]
        self.asked.append(argv)
        by_state = any(arg.startswith("--state=") for arg in argv)
        return "\n".join(self.answers[by_state]) + "\n"


def window() -> tuple[datetime, datetime]:
    return (datetime.fromtimestamp(PERIOD.start, UTC), datetime.fromtimestamp(PERIOD.end, UTC))


@pytest.mark.parametrize("plain, by_state, expected_elapsed", [
    # the reported case: the held job's third incarnation only in the query by state
    ([FIRST, SECOND, HELD], [FIRST, SECOND, THIRD], [1, 2, 0, 2]),
    # nothing hidden: each incarnation once, though both queries return it
    ([FIRST, SECOND, THIRD, HELD], [FIRST, SECOND, THIRD], [1, 2, 2, 0]),
    # held after its first requeue (max_restarts = 0): only the pending record is plain
    ([HELD], [FIRST], [0, 1]),
    # a line that cannot be read is reported once, not once per query
    ([FIRST, "garbage"], [FIRST, "garbage"], [1]),
])
def test_every_incarnation_of_the_window_once(monkeypatch, plain, by_state, expected_elapsed):
    monkeypatch.setenv("TZ", "UTC")
    client = CannedSacct(plain, by_state)
    found = list(client.accounting_rows(*window()))
    records = [r for r in found if hasattr(r, "elapsed_s")]
    assert [r.elapsed_s for r in records] == expected_elapsed
    assert len({(r.job_id, r.submit_time) for r in records}) == len(records)
    assert len(found) - len(records) == sum("garbage" in text for text in plain[:2])
    assert len(client.asked) == 2


def test_the_second_query_asks_for_what_ended_in_the_window():
    plain, by_state = window_queries(["sacct", "--parsable2"], *window())
    assert not any(arg.startswith("--state") for arg in plain)
    assert f"--state={','.join(ENDED_STATES)}" in by_state
    assert "RQ" in ENDED_STATES  # a requeued incarnation's record ends REQUEUED
    assert [a for a in plain if a.startswith("--")] == \
        [a for a in by_state if a.startswith("--") and not a.startswith("--state")]


def test_one_record_per_incarnation_keeps_the_first():
    client = CannedSacct([], [])
    records = list(client.accounting_rows(*window())) + list(
        CannedSacct([FIRST, SECOND], []).accounting_rows(*window()))
    assert one_per_incarnation(records * 2) == records


def test_incarnations_come_in_submission_order_whatever_order_the_queries_found_them():
    # The held incarnation's record comes only from the query by state, after its successor
    # from the plain window (tests/test_home_slurm_2411.py saw it so).
    seen = list(CannedSacct([THIRD, HELD, FIRST], []).accounting_rows(*window()))
    assert [r.submit_time for r in one_per_incarnation(seen + seen[:1])] == \
        sorted(r.submit_time for r in seen)


# --- where billing check compares ----------------------------------------------------------

SETTLE = 300


@pytest.mark.parametrize("covered, ingested, now, compared, uncompared", [
    # ingested until now at T0+5h: compared up to 5 minutes before, the rest named
    (T0 + 5 * HOUR - SETTLE, T0 + 5 * HOUR, T0 + 6 * HOUR,
     (T0, T0 + 5 * HOUR - SETTLE),
     (T0 + 5 * HOUR - SETTLE, T0 + 5 * HOUR, T0 + 5 * HOUR + SETTLE)),
    # an --until backfill: taken at its word, nothing left over
    (T0 + 5 * HOUR, T0 + 5 * HOUR, T0 + 6 * HOUR, (T0, T0 + 5 * HOUR), None),
    # ingested past the period's end: only the period's part is named
    (T0 + 10 * HOUR - 60, T0 + 11 * HOUR, T0 + 11 * HOUR,
     (T0, T0 + 10 * HOUR - 60),
     (T0 + 10 * HOUR - 60, T0 + 10 * HOUR, T0 + 10 * HOUR + SETTLE)),
    # the period began in the last minutes of the ingest: nothing to compare, all named
    (T0 - 60, T0 + 200, T0 + 400, None, (T0, T0 + 200, T0 + 200 + SETTLE)),
    # never ingested: compared up to now (everything Slurm has shows as missing)
    (None, None, T0 + HOUR, (T0, T0 + HOUR - SETTLE), None),
    # a database of before `ingested:` was recorded: as before
    (T0 + HOUR, None, T0 + 2 * HOUR, (T0, T0 + HOUR), None),
    # ingested before the period began
    (T0 - HOUR, T0 - HOUR + SETTLE, T0, None, None),
])
def test_the_part_compared_and_the_part_named(covered, ingested, now, compared, uncompared):
    found = check.windows(PERIOD, covered, ingested, now, SETTLE)
    assert (None if found.compared is None else (found.compared.start, found.compared.end)) \
        == compared
    assert found.uncompared == uncompared


def result(strict: bool, uncompared: bool, differs: bool = False,
           failed: bool = False) -> CheckResult:
    out = CheckResult(PERIOD, strict=strict)
    out.sources.append(SourceRun("accounting:onprem", Outcome.FAILED if failed else Outcome.READ,
                                 "x", ExitCode.BILLING_SOURCE if failed else 0))
    if uncompared:
        out.uncompared["accounting:onprem"] = (T0, T0 + 60, T0 + 360)
    if differs:
        out.differences.append(check.Difference("accounting:onprem", "incarnation", None,
                                                [2, 0], "missing"))
    return out


@pytest.mark.parametrize("strict, uncompared, differs, failed, code", [
    (False, False, False, False, 0),
    (False, True, False, False, 0),          # named, not a failure unless asked
    (True, True, False, False, ExitCode.BILLING_UNCOMPARED),
    (True, False, False, False, 0),
    (True, True, True, False, ExitCode.BILLING_DIFFERS),   # a difference wins
    (True, True, False, True, ExitCode.BILLING_SOURCE),    # so does a source not read
])
def test_strict_fails_on_what_could_not_be_compared(strict, uncompared, differs, failed, code):
    found = result(strict, uncompared, differs, failed)
    assert found.exit_code == code
    named = found.not_compared
    assert len(named) == int(uncompared)
    if uncompared:
        assert named[0][1] == (f"accounting:onprem 2026-11: {iso(T0)} .. {iso(T0 + 60)} is "
                               "billed but not compared yet (the source may still be "
                               "recording it); run `slurm-geo billing ingest` after "
                               f"{iso(T0 + 360)}, then check again")
        assert found.as_dict()["sources"][0]["not_compared"]["ingest_after"] == iso(T0 + 360)
