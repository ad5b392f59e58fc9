"""A leg whose cluster was lost while it ran is billed to the last moment the federation
daemon knew its cluster alive, flagged estimated (pure rules, then the incarnation row)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from slurm_geo.billing.db import JOB_COLUMNS
from slurm_geo.billing.ingest import incarnation_row
from slurm_geo.billing.lineage import LegOwner
from slurm_geo.billing.outages import Outage, cut_short, outages_of, start_known
from slurm_geo.federation.state.audit import Entry
from slurm_geo.slurm.models import AccountingRecord, JobState

T0 = int(datetime(2026, 11, 10, 8, 0, tzinfo=UTC).timestamp())
LOST = Outage("onprem", declared_at=T0 + 41, last_ok=T0 + 38)


@pytest.mark.parametrize("cluster, start, end, outages, expected", [
    ("onprem", T0, T0 + 600, [LOST], LOST),       # Slurm closed it at the cancel, later
    ("onprem", T0, None, [LOST], LOST),           # the controller never came back
    ("onprem", T0, T0 + 30, [LOST], None),        # it ended before the last answer
    ("onprem", T0 + 50, T0 + 90, [LOST], None),   # it started after the outage
    ("rented", T0, T0 + 600, [LOST], None),       # another cluster's outage
    ("onprem", None, None, [LOST], None),         # it never started
    ("onprem", T0, T0 + 600, [], None),           # no outage known
    ("onprem", T0, None, [Outage("onprem", T0 - 5, T0 - 9), LOST], LOST),  # an older one
], ids=["closed late", "never closed", "ended before", "started after", "other cluster",
        "never started", "no outage", "the one while it ran"])
def test_which_outage_cut_an_incarnation_short(cluster, start, end, outages, expected):
    assert cut_short(cluster, start, end, outages) == expected


@pytest.mark.parametrize("start, trained_since, expected", [
    (T0 + 600, T0 + 4, T0 + 4),   # Slurm lost the start: it says it began at the cancel
    (T0, T0 + 4, T0),             # Slurm has the start: it stands
    (T0 + 50, T0 + 45, T0 + 50),  # it first trained after the outage: Slurm's stands
    (T0 + 600, None, T0 + 600),   # the daemon never saw it train
    (None, T0 + 4, None),         # Slurm has no start at all: nothing to correct
], ids=["recorded at the cancel", "recorded", "trained after", "never trained", "no start"])
def test_a_start_slurm_recorded_only_after_the_loss_is_the_first_lease(start, trained_since,
                                                                       expected):
    assert start_known("onprem", start, trained_since, [LOST]) == expected
    assert start_known("rented", start, trained_since, [LOST]) == start  # not its outage


def entry(kind: str, unix_time: float, **detail) -> Entry:
    stamp = datetime.fromtimestamp(unix_time, UTC).isoformat()
    return Entry(1, stamp, kind, None, "", "", detail, "", "")


def test_outages_come_from_the_audit_logs_outage_entries():
    entries = [entry("outage", T0 + 41, cluster="onprem", last_ok=T0 + 38, failures=3),
               entry("recovered", T0 + 90, cluster="onprem"),
               entry("outage", T0 + 5, cluster="rented", last_ok=None)]  # never answered
    assert outages_of(entries) == [Outage("onprem", T0 + 41, T0 + 38)]


def killed_leg(**over) -> AccountingRecord:
    base = dict(cluster="onprem", job_id=50, name="geo-drill", user="alice", account="users",
                partition="batch", state=JobState.CANCELLED,
                submit_time=datetime.fromtimestamp(T0 - 1, UTC),
                start_time=datetime.fromtimestamp(T0, UTC),
                end_time=datetime.fromtimestamp(T0 + 600, UTC), elapsed_s=600,
                allocated_tres={"cpu": 1}, exit_code=0, nodes="onprem-n1",
                admin_comment="geo:cost_center=ml-research")
    return AccountingRecord(**{**base, **over})


LEGS = {("onprem", 50): LegOwner("onprem-50", "ml-research")}


@pytest.mark.parametrize("over, lineage, expected", [
    ({}, LEGS, {"end_ts": T0 + 38, "elapsed_s": 38, "estimated": True}),
    ({"end_time": None, "elapsed_s": 0}, LEGS,
     {"end_ts": T0 + 38, "elapsed_s": 38, "estimated": True}),
    ({}, {}, {"end_ts": T0 + 600, "elapsed_s": 600, "estimated": False}),  # no geo job
    ({"end_time": datetime.fromtimestamp(T0 + 20, UTC), "elapsed_s": 20}, LEGS,
     {"end_ts": T0 + 20, "elapsed_s": 20, "estimated": False}),
    # killed 10 s after it started, before slurmdbd stored the start: Slurm has the job
    # starting and ending at the cancel, 0 s; the daemon's first lease says when it ran
    ({"start_time": datetime.fromtimestamp(T0 + 600, UTC), "elapsed_s": 0},
     {("onprem", 50): LegOwner("onprem-50", "ml-research", trained_since=T0 + 4)},
     {"end_ts": T0 + 38, "elapsed_s": 34, "estimated": True}),
], ids=["closed at the cancel", "never closed", "not a leg of a logical job",
        "ended before the loss", "start lost with the controller"])
def test_a_leg_cut_short_by_its_clusters_loss_is_billed_to_its_last_answer(over, lineage,
                                                                          expected):
    row = dict(zip(JOB_COLUMNS, incarnation_row(killed_leg(**over), lineage, T0 + 900,
                                                [LOST]), strict=True))
    assert (row["end_ts"], row["elapsed_s"]) == (expected["end_ts"], expected["elapsed_s"])
    assert ("estimated: onprem was lost" in row["flags"]) is expected["estimated"]
    assert "running" not in row["flags"].split("; ")
