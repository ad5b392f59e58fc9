"""A rolling upgrade of the replicated federation daemon: its two replicas restarted one at a
time, the follower first, while a job that failed over holds its lease. Each restart is a
replica's process stopped (it resigns the leader key on its way out, as on SIGTERM) and
started afresh on the state in etcd, with nothing of its own in memory; the new leader
settles the layout's version. Throughout, the job's lease keeps being granted, its
generation, incarnations and fences stay as they were, and no round submits it again.

Both the replicas before and after run this release's code, in this process (the
clusters are tests/test_federation_daemon.py's FakeSlurm); that the state the last
release wrote opens with this code is tests/test_upgrade.py's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_geo.ckpt import Repository
from slurm_geo.ckpt.fence import read_fence
from slurm_geo.federation.etcd.version import LAYOUT_VERSION, read_version
from slurm_geo.federation.fencing import known_fence
from slurm_geo.federation.model import JobStatus
from tests.etcd_server import EtcdMember, fresh_prefix
from tests.replica_site import SITES, ReplicatedSite
from tests.test_federation_daemon import KEY, OPTIONS, RUN, Clock


@pytest.fixture
def site(etcd: EtcdMember, tmp_path: Path) -> Iterator[ReplicatedSite]:
    replicated = ReplicatedSite(tmp_path, clock=Clock(time.time()), etcd_url=etcd.client_url,
                                prefix=fresh_prefix())
    yield replicated
    replicated.close()


def leader(site: ReplicatedSite, starting: str | None = None) -> str:
    """Each replica campaigns, as its loop would, the one `starting` up last (the other's
    loop ran all along); the one that leads."""
    for name in sorted(site.daemons, key=lambda n: n == starting):
        site.daemons[name].leadership.campaign()
    (leading,) = [name for name, d in site.daemons.items() if d.leadership.is_leader()]
    return leading


def restart(site: ReplicatedSite, name: str) -> None:
    site.daemons[name].close()  # resigns, stops serving, closes its state
    site.daemons[name] = site._start(name)


def what_must_not_change(site: ReplicatedSite) -> dict[str, Any]:
    job = site.job()
    assert hasattr(job, "logical_job")
    lease = site.state.lease(job.logical_job)
    return {
        "job": (job.generation, job.cluster, job.job_id, job.resume_step, job.status),
        "incarnations": [(i.generation, i.cluster, i.job_id, i.resume_step)
                         for i in site.state.incarnations(job.logical_job)],
        "lease": None if lease is None else (lease.generation, lease.cluster, lease.job_id,
                                             lease.released),
        "fence": known_fence(job),
        "stored fences": {name: read_fence(Repository(store, KEY, OPTIONS), RUN)
                          for name, store in site.stores.items()},
        "submitted": ([i for i, _ in site.onprem.submitted],
                      [i for i, _ in site.rented.submitted]),
    }


def test_restarting_the_replicas_one_at_a_time_keeps_the_jobs_lease_and_fences(site):
    assert leader(site) == "home-a"
    site.use("home-a")
    _, away_id = site.moved_away()  # onprem lost: the job runs on rented at generation 1
    site.rented.start(away_id)
    assert site.lease("rented", away_id, generation=1, last_step=40)["verdict"] == "grant"
    before = what_must_not_change(site)
    assert before["job"] == (1, "rented", away_id, 40, JobStatus.RUNNING)
    assert before["fence"] is not None and before["fence"].generation == 1
    assert before["stored fences"]["away"] == before["fence"]

    leaders, step = [], 40
    for name in ("control-b", "home-a"):  # the follower first, then the leader
        restart(site, name)
        leaders.append(leader(site, starting=name))
        site.use(leaders[-1])
        step += 10
        reply = site.lease("rented", away_id, generation=1, last_step=step)
        assert (reply["verdict"], reply["action"]) == ("grant", "train"), reply
        site.tick()  # a round of each replica: only the leader's decides
        assert what_must_not_change(site) == before
        assert site.state.lease(site.job().logical_job).last_step == step

    # the lead moved once, when its holder was restarted; never to nobody for long
    assert leaders == ["home-a", "control-b"]
    assert set(site.daemons) == set(SITES)
    assert read_version(site.state.kv, site.state.layout) == LAYOUT_VERSION
