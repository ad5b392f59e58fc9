"""A dead controller (or slurmrestd) gives one typed error within the timeout, never a hang."""

from __future__ import annotations

import dataclasses
import time

import pytest

from slurm_geo.sandbox.users import ALICE
from slurm_geo.slurm import ControllerUnreachable, JobSpec, connect
from tests.helpers import stop_daemon

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

TIMEOUT_S = 3.0
# Scheduling slack on a loaded 2-core machine; the bound itself is the client's timeout.
MARGIN_S = 2.0

OPERATIONS = {
    "ping": lambda c: c.ping(),
    "jobs": lambda c: c.jobs(),
    "job": lambda c: c.job(1),
    "nodes": lambda c: c.nodes(),
    "submit": lambda c: c.submit(JobSpec(script="#!/bin/bash\ntrue\n", owner=ALICE.owner)),
    "cancel": lambda c: c.cancel(1),
    "expected_start": lambda c: c.expected_start(JobSpec(script="#!/bin/bash\ntrue\n")),
}


@pytest.fixture
def restore(sandbox):
    yield
    sandbox.up(progress=lambda _msg: None)


def client_for(site, name):
    return connect(dataclasses.replace(site.cluster(name), timeout_s=TIMEOUT_S))


def assert_unreachable_in_time(client, operation):
    began = time.monotonic()
    with pytest.raises(ControllerUnreachable) as caught:
        operation(client)
    elapsed = time.monotonic() - began
    assert caught.value.cluster == client.cluster
    assert elapsed <= TIMEOUT_S + MARGIN_S, f"took {elapsed:.1f} s"


@pytest.mark.parametrize("cluster_name", ["onprem", "rented"])
def test_stopped_slurmctld_gives_controller_unreachable(site, sandbox, restore, cluster_name):
    client = client_for(site, cluster_name)
    client.ping()  # warm: the REST client discovers its API version while all is well

    stop_daemon(sandbox, f"{cluster_name}-slurmctld")

    for name, operation in OPERATIONS.items():
        try:
            assert_unreachable_in_time(client, operation)
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from None


def test_stopped_slurmrestd_gives_controller_unreachable_at_once(site, sandbox, restore):
    client = client_for(site, "rented")
    stop_daemon(sandbox, "rented-slurmrestd")

    for operation in (OPERATIONS["ping"], OPERATIONS["submit"]):
        assert_unreachable_in_time(client, operation)


def test_controller_back_after_outage_answers_again(site, sandbox):
    sandbox.processes.stop("onprem-slurmctld")
    sandbox.up(progress=lambda _msg: None)

    assert client_for(site, "onprem").ping() >= 0
