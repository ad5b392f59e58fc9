"""The rented provider's stock Slurm 26.05, live: its own machine, reached through slurmrestd.

Brings up a provider site (sandbox.provider: Debian sid's Slurm from the image of
sandbox.rootfs, in mount and UTS namespaces of its own) in a temporary directory, and
drives it through the REST backend as the daemon would: negotiation, ping, nodes, a job of
alice's submitted as her provider account geo-alice, read, held, released, requeued
(v0.0.45's endpoint) and cancelled. The job sees the provider's disk, never home's.

Needs root and Debian's registry (mmdebstrap builds the image once per machine, about
30 s): skipped only when the registry cannot be reached, saying so. Its own ports, free
ones found from 24570; nothing of a sandbox is used or touched.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_geo.sandbox import provider, rootfs
from slurm_geo.sandbox.provider import ProviderSite
from slurm_geo.slurm.errors import JobNotFound
from slurm_geo.slurm.models import JobSpec, JobState, Owner
from slurm_geo.slurm.rest_backend import RestLogin, RestSlurmClient
from tests.provider_sites import free_base, running

pytestmark = [pytest.mark.slow,
              pytest.mark.root(reason="namespaces and mounts need root")]

ALICE = Owner("alice", 2001, 2001)
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProviderSite]:
    root = Path(os.environ.get("SLURM_GEO_PROVIDER_TEST_DIR")
                or tmp_path_factory.mktemp("provider"))
    with running(ProviderSite(root, free_base(24570, 5), cluster="provider"),
                 watched=root) as site:
        yield site


@pytest.fixture(scope="module")
def rest(site: ProviderSite) -> RestSlurmClient:
    alice = RestLogin("geo-alice", site.token_file("geo-alice"))
    return RestSlurmClient(site.cluster, site.rest_url, alice.user, alice.token_file, 10.0,
                           {"alice": alice})


def wait_for(rest: RestSlurmClient, job_id: int, states: set[JobState],
             timeout_s: float = 60) -> JobState:
    deadline = time.monotonic() + timeout_s
    state = JobState.UNKNOWN
    while time.monotonic() < deadline:
        state = rest.job(job_id).state
        if state in states:
            return state
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} stayed {state}, not in {states}")


def test_the_provider_runs_slurm_26_05(site):
    assert rootfs.read_stamp(site.image)["slurm_version"].startswith("26.05")
    version = provider.exec_in(site, ["slurmctld", "-V"]).stdout
    assert rootfs.slurm_version(version).startswith("26.05")
    conf = (site.dirs.etc / "slurm.conf").read_text()
    assert "PlugStack" not in conf and "slurm_geo" not in conf and "Prolog" not in conf


def test_rest_negotiates_v0_0_45_and_sees_the_cluster(rest):
    assert rest.api_version == "0.0.45"
    assert rest.ping() >= 0
    (node,) = rest.nodes()
    assert node.name == "provider-n1" and node.available


def test_alices_job_runs_as_her_provider_account_on_the_providers_disk(site, rest):
    script = ("#!/bin/bash\n"
              "id -un; id -u; hostname; ls /home\n"
              f"test -e {REPO} && echo SEES-CHECKOUT\n"
              "test -e /home/alice && echo SEES-HOME-ALICE\n"
              f"test -e {rootfs.IMAGE_DIR} && echo SEES-IMAGE-PATH\n"
              "ls -A /home/geo-alice | grep -v '^job.out$' || true\n"
              "python3 -c 'import sys; print(\"python\", sys.version_info[0])'\n")
    job_id = rest.submit(JobSpec(script=script, name="where", owner=ALICE,
                                 working_dir=Path("/home/geo-alice"),
                                 output="/home/geo-alice/job.out", time_limit_minutes=2))
    assert wait_for(rest, job_id, {JobState.COMPLETED, JobState.FAILED}) is JobState.COMPLETED
    info = rest.job(job_id)
    assert (info.user, info.uid) == ("geo-alice", 3101)
    out = (site.dirs.home / "geo-alice" / "job.out").read_text().split()
    assert out[:4] == ["geo-alice", "3101", "provider", "geo-alice"]
    assert out[4] == "geo-bob" and out[5:] == ["python", "3"], out
    for leak in ("SEES-CHECKOUT", "SEES-HOME-ALICE", "SEES-IMAGE-PATH"):
        assert leak not in out


def test_hold_release_requeue_and_cancel_through_rest(rest):
    job_id = rest.submit(JobSpec(script="#!/bin/bash\nsleep 300\n", name="long",
                                 owner=ALICE, working_dir=Path("/tmp"), hold=True,
                                 requeue=True, signal="B:USR1@30", time_limit_minutes=10))
    held = rest.job(job_id)
    assert held.state is JobState.PENDING and held.reason == "JobHeldUser"
    rest.release(job_id)
    wait_for(rest, job_id, {JobState.RUNNING})
    rest.requeue(job_id)  # v0.0.45's GET /job/{id}/requeue
    requeued = rest.job(job_id)
    assert requeued.restart_count == 1 and requeued.state is not JobState.RUNNING
    rest.cancel(job_id)
    assert wait_for(rest, job_id, {JobState.CANCELLED}) is JobState.CANCELLED
    with pytest.raises(JobNotFound):
        rest.cancel(987654)
    with pytest.raises(JobNotFound):
        rest.requeue(987654)
