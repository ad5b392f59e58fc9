"""slurm_geo.lifecycle: the table of allowed transitions, checked on every change, shared by
checkpoint-sync's replicas, the federation's logical jobs and the registry's incarnations."""

from __future__ import annotations

import itertools
from enum import Enum

import pytest

from slurm_geo.federation import model
from slurm_geo.lifecycle import Lifecycle
from slurm_geo.registry import db as registry
from slurm_geo.sync import state as sync


class Light(Enum):
    RED = "red"
    GREEN = "green"
    AMBER = "amber"


class Refused(Exception):
    def __init__(self, key: str, current: Light, wanted: Light):
        super().__init__(f"{key}: {current.value} -> {wanted.value}")


TABLE = {Light.RED: {Light.GREEN}, Light.GREEN: {Light.AMBER}, Light.AMBER: {Light.RED}}
LIGHTS = Lifecycle(Light, TABLE, Refused)


@pytest.mark.parametrize(("current", "wanted"), list(itertools.product(Light, Light)))
def test_check_allows_the_table_and_refuses_the_rest_by_name(current, wanted):
    assert LIGHTS.allows(current, wanted) is (wanted in TABLE[current])
    if wanted in TABLE[current]:
        LIGHTS.check("corner", current, wanted)
    else:
        with pytest.raises(Refused, match=f"^corner: {current.value} -> {wanted.value}$"):
            LIGHTS.check("corner", current, wanted)


def test_a_table_must_name_every_state_a_final_one_too():
    with pytest.raises(ValueError, match="Light lifecycle names no transitions out of AMBER"):
        Lifecycle(Light, {Light.RED: {Light.GREEN}, Light.GREEN: set()}, Refused)
    assert Lifecycle(Light, {**TABLE, Light.AMBER: ()}, Refused).allowed[Light.AMBER] == set()


def test_the_table_is_read_only_and_its_targets_frozen():
    with pytest.raises(TypeError):
        LIGHTS.allowed[Light.RED] = frozenset()  # type: ignore[index]
    assert all(isinstance(targets, frozenset) for targets in LIGHTS.allowed.values())


@pytest.mark.parametrize(("lifecycle", "table"), [
    (sync.LIFECYCLE, sync.TRANSITIONS),
    (model.LIFECYCLE, model.TRANSITIONS),
    (registry.LIFECYCLE, None),
], ids=["sync", "federation", "registry"])
def test_the_three_lifecycles_are_this_one(lifecycle, table):
    assert isinstance(lifecycle, Lifecycle)
    if table is not None:
        assert dict(lifecycle.allowed) == table


def test_each_keeps_its_own_error():
    with pytest.raises(sync.IllegalTransition, match="replica 3: verified -> pending is not"):
        sync.LIFECYCLE.check(3, sync.Status.VERIFIED, sync.Status.PENDING)
    with pytest.raises(model.IllegalTransition, match="logical job j: completed -> running"):
        model.LIFECYCLE.check("j", model.JobStatus.COMPLETED, model.JobStatus.RUNNING)
    ended = registry.Incarnation("onprem", 7, 1, registry.IncarnationState.ENDED, "n1", 0.0,
                                 1.0, "0:0")
    with pytest.raises(registry.IllegalTransition,
                       match="job onprem:7 incarnation 1: cannot go from ended to requeued"):
        registry.LIFECYCLE.check(ended, ended.state, registry.IncarnationState.REQUEUED)
