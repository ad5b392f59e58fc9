"""A move decided while the job's cluster answers waits for the job's world at its target
(issue 31 item 4; federation.worldwait), and a trainer asked to move keeps training
meanwhile (federation.leases). Pure, table-driven."""

from __future__ import annotations

import pytest

from slurm_geo.federation.decide.leases import Action, Verdict, decide
from slurm_geo.federation.decide.planner import (
    WORLD_GIVE_WAY_S,
    Cadence,
    WorldStaging,
    checkpoint_every_s,
    stage_s,
    with_checkpoints,
)
from slurm_geo.federation.decide.worldwait import world_wait
from tests.kit.leases import NOW, TTL, ask, job, lease

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


@pytest.mark.parametrize("cadence, seconds", [
    # Checkpoints of unknown cadence: the link's time alone, as before.
    (Cadence(), 80.5),
    # One every 5 s, 17 KB each (bench/world_move.py): each takes the link ~0.5 s
    # (this link's fixed 0.5 s) and costs the pass its give-way.
    (Cadence(5.0, 17_000, "pfs"), 80.5 / (1 - (0.5 + 17_000 / 25e6 + WORLD_GIVE_WAY_S) / 5)),
    # Big checkpoints every 60 s: 1 GB, 40.5 s of link each; the world has what is left.
    (Cadence(60.0, GB, "pfs"), 80.5 / (1 - (40.5 + WORLD_GIVE_WAY_S) / 60)),
    # Checkpoints already at the target's store cross nothing but still cut the pass.
    (Cadence(5.0, GB, "offsite"), 80.5 / (1 - WORLD_GIVE_WAY_S / 5)),
    # Checkpoints that would take the whole link: the world keeps a tenth of it.
    (Cadence(30.0, GB, "pfs"), 80.5 * 10),
])
def test_staging_shares_the_link_with_the_job_s_own_checkpoints(cadence, seconds):
    assert stage_s(WorldStaging("pfs", GB), "offsite", predict, cadence) == \
        pytest.approx(seconds)


@pytest.mark.parametrize("link_s, every_s, checkpoint_s, seconds", [
    (100.0, 5.0, 0.0, 100.0 / (1 - WORLD_GIVE_WAY_S / 5.0)),
    (100.0, 10.0, 4.65, 200.0),  # half the link: twice the time
    (100.0, 0.0, 1.0, 100.0),    # no cadence
    (0.0, 5.0, 1.0, 0.0),
])
def test_with_checkpoints(link_s, every_s, checkpoint_s, seconds):
    assert with_checkpoints(link_s, every_s, checkpoint_s) == \
        pytest.approx(seconds, rel=1e-2 if every_s == 10.0 else 1e-9)


@pytest.mark.parametrize("created, declared_s, every", [
    ([], None, None),
    ([100.0], None, None),
    ([100.0, 100.0], None, None),
    ([100.0, 105.0, 111.0, 115.0, 120.0], None, 5.0),
    ([120.0, 100.0, 110.0], None, 10.0),  # any order
    # Too few to tell: what the job declared (--geo-ckpt-interval 30 -> 1800 s).
    ([], 1800.0, 1800.0),
    ([100.0], 1800.0, 1800.0),
    ([100.0, 105.0], 1800.0, 5.0),  # what it does beats what it said
])
def test_checkpoint_cadence_from_the_newest_checkpoints_times(created, declared_s, every):
    assert checkpoint_every_s(created, declared_s) == every


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
