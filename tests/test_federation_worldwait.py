"""A move decided while the job's cluster answers waits for the job's world at its target
(issue 31 item 4; federation.worldwait), and a trainer asked to move keeps training
meanwhile (federation.leases). Pure, table-driven."""

from __future__ import annotations

import pytest

from slurm_geo.federation.leases import Action, Verdict, decide
from slurm_geo.federation.planner import WorldStaging, stage_s
from slurm_geo.federation.worldwait import world_wait
from tests.test_federation_leases import NOW, TTL, ask, job, lease

GB = 10**9
RATES = {("pfs", "offsite"): 25e6}  # bytes/s: 200 Mbit/s


def predict(source: str, destination: str, n: int) -> float | None:
    rate = RATES.get((source, destination))
    return None if rate is None else n / rate + 0.5


@pytest.mark.parametrize("world, target, store, waits", [
    # No world declared, or complete at the target (its record is there): no wait.
    (None, "rented", "offsite", ""),
    (WorldStaging("pfs", GB, {"offsite": GB}), "rented", "offsite", ""),
    # Going home, where the world is read from: never a wait.
    (WorldStaging("pfs", GB), "onprem", "pfs", ""),
    # Staged at home only: all of it to copy, each byte put and read back (2 x 40 s).
    (WorldStaging("pfs", GB), "rented", "offsite",
     "staging the world to rented: 1000 MB left, ~80 s"),
    (WorldStaging("pfs", GB, {"offsite": GB // 2}), "rented", "offsite",
     "staging the world to rented: 500 MB left, ~40 s"),
    # A link never measured: the time is unknown, the wait is not.
    (WorldStaging("pfs", GB), "spare", "spare-s3",
     "staging the world to spare: 1000 MB left, time unknown"),
    # Not even staged at home yet (the job has not run there): it waits for that.
    (WorldStaging("pfs"), "rented", "offsite",
     "are not staged in home's store pfs yet (its job stages them at home as it runs)"),
])
def test_a_move_waits_until_the_world_is_complete_at_its_target(world, target, store,
                                                                 waits):
    why = world_wait(world, target, store, predict)
    assert (why == "") is (waits == ""), why
    assert waits in why


@pytest.mark.parametrize("world, store, seconds", [
    (WorldStaging("pfs", GB, {"offsite": GB}), "offsite", 0.0),
    (WorldStaging("pfs", GB), "offsite", 80.5),
    (WorldStaging("pfs", GB), "pfs", 0.0),
    (WorldStaging("pfs"), "offsite", None),
    (WorldStaging("pfs", GB), "spare-s3", None),
])
def test_staging_time_counts_the_copy_and_its_read_back(world, store, seconds):
    assert stage_s(world, store, predict) == seconds


@pytest.mark.parametrize("waits, step, action, reason", [
    ("", 80, Action.RELEASE, "moving to rented from checkpoint 80"),
    # The daemon has not looked at the target yet (the move was just planned): train on.
    (None, 80, Action.TRAIN, "waits for the daemon to look for the job's world there"),
    ("staging the world to rented: 1000 MB left, ~80 s", 80, Action.TRAIN,
     "the move to rented waits: staging the world to rented"),
    ("staging the world to rented: 1000 MB left, ~80 s", 40, Action.TRAIN, "lease renewed"),
])
def test_a_trainer_asked_to_move_trains_on_while_its_world_stages(waits, step, action,
                                                                  reason):
    moving = job(cluster="onprem", move_to="rented", move_after=40)
    answer = decide(moving, lease(), ask(cluster="onprem", last_step=step),
                    "onprem", NOW, TTL, waits)
    assert (answer.verdict, answer.action) == (Verdict.GRANT, action)
    assert reason in answer.reason
