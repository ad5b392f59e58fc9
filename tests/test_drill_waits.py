"""The drill's waits say what they wait for while they wait (issue 29: `make drill` printed
nothing for minutes), and a wait that runs out names what it waited for."""

from __future__ import annotations

import time

import pytest

from slurm_geo.drills import drill, waits


def test_a_long_wait_says_what_it_waits_for_and_how_far_it_got(monkeypatch):
    monkeypatch.setattr(waits, "WAIT_REPORT_S", 0.3)
    said: list[str] = []
    ready_at = time.time() + 1.0
    found = drill.wait_for(lambda: time.time() > ready_at and "done", time.time() + 10,
                           "2 checkpoints verified off-site", said.append,
                           lambda: "verified off-site: steps 40")
    assert found == "done"
    assert said, "a wait of a second with a report every 0.3 s said nothing"
    assert all(line.startswith("still waiting for 2 checkpoints verified off-site: ")
               and "verified off-site: steps 40" in line and "gives up in" in line
               for line in said)


def test_a_short_wait_says_nothing():
    said: list[str] = []
    assert drill.wait_for(lambda: True, time.time() + 10, "x", said.append) is True
    assert said == []


def test_a_wait_that_runs_out_names_what_it_waited_for():
    with pytest.raises(drill.DrillFailed, match="timed out waiting for the daemon to lead"):
        drill.wait_for(lambda: None, time.time() + 0.3, "the daemon to lead")
