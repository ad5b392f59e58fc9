"""Why an incarnation ended is an IncarnationEnd, not free text: its values are the strings
release 0.1 stored (so either release reads the other's records), on both backends."""

from __future__ import annotations

import pytest

from slurm_geo.federation.model import IncarnationEnd
from slurm_geo.federation.state.sqlite import FederationState
from slurm_geo.slurm.models import JobState
from tests.kit.builders import NOW, logical_job
from tests.kit.state import path_fixture, sqlite_state_fixture, state_fixture  # noqa: F401

# What 0.1 wrote: Slurm's final state lowercased (federation/core.py), "cancelled" (a
# cancel), "ended" and "cancelled: fenced" (a move's fence, a cancel of one already over).
RELEASE_0_1 = {"completed", "failed", "cancelled", "timeout", "node_fail", "preempted",
               "boot_fail", "deadline", "out_of_memory", "revoked", "special_exit", "unknown",
               "ended", "cancelled: fenced"}


def test_the_values_are_the_strings_the_release_stored():
    assert {end.value for end in IncarnationEnd} == RELEASE_0_1


@pytest.mark.parametrize("state", [*(s for s in JobState if s.is_terminal()), JobState.UNKNOWN],
                         ids=lambda s: s.value)
def test_every_final_slurm_state_is_a_member(state):
    end = IncarnationEnd.from_slurm(state)
    assert end in list(IncarnationEnd) and end.value == state.value.lower()


@pytest.mark.parametrize("stored", ["moved: outage", "a newer release's reason"])
def test_a_reason_this_release_does_not_know_reads_as_itself(stored):
    end = IncarnationEnd.read(stored)
    assert end is not None and end.name == "OTHER" and end.value == stored and end == stored
    assert end not in list(IncarnationEnd) and isinstance(end, IncarnationEnd)
    assert IncarnationEnd.read(None) is None


@pytest.mark.parametrize("end", [IncarnationEnd.FENCED, IncarnationEnd.TIMEOUT,
                                 IncarnationEnd.CANCELLED], ids=lambda e: e.name)
def test_both_backends_store_the_value_and_read_the_member(state, end):  # noqa: F811
    job = logical_job()
    assert state.add_job(job)
    state.end_incarnation(job.logical_job, 0, end, NOW)
    [read] = state.incarnations(job.logical_job)
    assert read.end_reason is end and read.ended_at == NOW


def test_sqlite_keeps_the_string_in_its_column(sqlite_state: FederationState):  # noqa: F811
    job = logical_job()
    assert sqlite_state.add_job(job)
    sqlite_state.end_incarnation(job.logical_job, 0, IncarnationEnd.FENCED, NOW)
    stored = sqlite_state.db.execute("SELECT end_reason FROM incarnations").fetchone()[0]
    assert type(stored) is str and stored == "cancelled: fenced"
