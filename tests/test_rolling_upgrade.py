"""A rolling upgrade of the replicated federation daemon: its two replicas restarted one at a
time, the follower first, while a job that failed over holds its lease. Each restart is a
replica's process stopped (it resigns the leader key on its way out, as on SIGTERM) and
started afresh on the state in etcd, with nothing of its own in memory; the new leader
settles the layout's version. Throughout, the job's lease keeps being granted, its
generation, incarnations and fences stay as they were, and no round submits it again.

In the first test both the replicas before and after run this release's code, in this
process (the clusters are tests/kit/federation.py's FakeSlurm), and the trainer's
renewals go on throughout. In the second (slow) the replicas are `slurm-geo-federation`
processes of the last release (slurm-geo 0.1, its code from git at a4963d1) upgraded to
this one's, the follower first: the lead moves once, to the upgraded replica, which writes
the layout version, and the job's generation, incarnations, lease, fence, secret and key
token are as 0.1 left them. That the databases 0.1 wrote open is tests/test_upgrade.py's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_geo.ckpt import Repository
from slurm_geo.ckpt.repo.fence import read_fence
from slurm_geo.federation.act.fencing import known_fence
from slurm_geo.federation.model import JobStatus
from slurm_geo.federation.state.etcd.version import LAYOUT_VERSION, read_version
from tests.etcd_server import EtcdMember, fresh_prefix
from tests.helpers import eventually
from tests.kit.clock import ManualClock
from tests.kit.federation import KEY, OPTIONS, RUN
from tests.replica_site import SITES, ReplicatedSite, free_port, process_config, says


@pytest.fixture
def site(etcd: EtcdMember, tmp_path: Path) -> Iterator[ReplicatedSite]:
    replicated = ReplicatedSite(tmp_path, clock=ManualClock(time.time()),
                                etcd_url=etcd.client_url, prefix=fresh_prefix())
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


@pytest.mark.root(reason="runs as other users or in namespaces (failed as nobody)")
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


# --- from the last release's code to this one's, replica by replica -------------------------

RELEASE_COMMIT = "a4963d1"  # slurm-geo 0.1, as tests/data/release-0.1 was made
ROOT = Path(__file__).resolve().parent.parent
NAME, SECRET, TOKEN = "onprem-5", "5e" * 32, "key-token-of-onprem-5"


@pytest.fixture(scope="module")
def release_code(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """slurm_geo as commit a4963d1 had it, from git (never installed)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", RELEASE_COMMIT, "slurm_geo"],
                             capture_output=True, check=False)
    if archive.returncode != 0:
        pytest.skip(f"this checkout lacks commit {RELEASE_COMMIT} (a shallow clone?)")
    root = tmp_path_factory.mktemp("release-0.1")
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive.stdout, check=True)
    return root


def seed(endpoint: str, prefix: str) -> None:
    """A job that failed over to rented (generation 1, Slurm job 77), training under its
    lease, written as a person's command writes (no leader: no layout version either)."""
    from slurm_geo.ckpt.format.keys import KeyFile
    from slurm_geo.federation.model import Lease, LogicalJob, Replica, token_digest
    from slurm_geo.federation.state.etcd.kv import EtcdKV
    from slurm_geo.federation.state.etcd.layout import Layout
    from slurm_geo.federation.state.etcd.leadership import Bystander
    from slurm_geo.federation.state.etcd.state import EtcdFederationState

    layout = Layout(prefix)
    state = EtcdFederationState(EtcdKV([endpoint], KeyFile(KEY)), layout,
                                Bystander(layout, Replica("seed", "home", "http://x:1")))
    now = time.time()
    state.add_job(LogicalJob(logical_job=NAME, run=RUN, home="onprem", script="#!/bin/bash\n",
                             spec={}, directives={}, generation=0, cluster="onprem", job_id=5,
                             resume_step=None, status=JobStatus.RUNNING, created_at=now,
                             updated_at=now))
    state.begin_generation(NAME, 0, "rented", 40, now)
    state.identities.put_secret(NAME, 1, SECRET)
    state.submitted(NAME, 1, 77, token_digest(TOKEN), now)
    state.put_lease(Lease(NAME, 1, "rented", 77, 0, now, 40, False), True)
    state.close()


def etcd_view(endpoint: str, prefix: str) -> dict[str, Any]:
    from tests.etcd_server import open_replica

    reader = open_replica([endpoint], prefix, "reader", master_key=KEY)  # never campaigns
    try:
        job, lease = reader.job(NAME), reader.lease(NAME)
        assert lease is not None
        owner = reader.identities.token_owner(TOKEN)
        return {"job": (job.generation, job.cluster, job.job_id, job.resume_step, job.status),
                "incarnations": [(i.generation, i.cluster, i.job_id, i.resume_step)
                                 for i in reader.incarnations(NAME)],
                "lease": (lease.generation, lease.cluster, lease.job_id, lease.released),
                "fence": known_fence(job), "secret": reader.identities.secret(NAME, 1),
                "token": None if owner is None else (owner.logical_job, owner.generation),
                "version": read_version(reader.kv, reader.layout)}
    finally:
        reader.close()


@pytest.mark.slow
def test_replicas_of_the_last_release_upgraded_one_at_a_time_keep_the_job(
        release_code: Path, etcd: EtcdMember, tmp_path: Path):
    assert not (release_code / "slurm_geo/federation/etcd/version.py").exists()  # 0.1's
    key = tmp_path / "master.key"
    key.write_bytes(KEY)
    key.chmod(0o600)
    prefix, ports = fresh_prefix(), {name: free_port() for name in SITES}
    seed(etcd.client_url, prefix)
    before = etcd_view(etcd.client_url, prefix)
    assert before["version"] is None and before["job"][:2] == (1, "rented")
    processes: dict[str, subprocess.Popen[bytes]] = {}

    def start(name: str, code: Path) -> None:
        # 0.1's daemon is slurm_geo.federation.entry; this one's, federation/daemon/entry
        entry = "slurm_geo.federation.entry" \
            if (code / "slurm_geo/federation/entry.py").exists() \
            else "slurm_geo.federation.daemon.entry"
        env = {**os.environ, "PYTHONPATH": str(code)}
        env.pop("NOTIFY_SOCKET", None)
        with open(tmp_path / f"{name}.log", "ab") as log:
            processes[name] = subprocess.Popen(
                [sys.executable, "-m", entry, "--config",
                 # a lease of an hour: no move is decided while replicas restart
                 str(process_config(tmp_path, etcd.client_url, prefix, ports, name,
                                    lease_ttl_s=3600))],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)

    def leading(among: tuple[str, ...] = SITES) -> str:
        answers = eventually(lambda: {n: says(ports[n]) for n in among},
                             lambda a: all(a.values()) and any(v["leading"] for v in a.values()),
                             timeout_s=30, interval_s=0.1)
        return next(n for n, said in answers.items() if said["leading"])

    try:
        for name in SITES:
            start(name, release_code)
        first = leading()
        assert etcd_view(etcd.client_url, prefix) == before  # 0.1 writes no version
        follower = next(n for n in SITES if n != first)
        leaders = []
        for name in (follower, first):
            os.kill(processes[name].pid, signal.SIGTERM)
            assert processes[name].wait(30) == 0
            if name == first:  # as docs/install.md says: the upgraded one leads before
                assert leading(among=(follower,)) == follower  # the last one is restarted
            start(name, ROOT)
            leaders.append(leading())
        assert leaders == [first, follower]  # the lead moved once, to the upgraded replica
        after = eventually(lambda: etcd_view(etcd.client_url, prefix),
                           lambda v: v["version"] is not None, timeout_s=10, interval_s=0.2)
        assert after == {**before, "version": LAYOUT_VERSION}
        for name in SITES:
            assert "Traceback" not in (tmp_path / f"{name}.log").read_text()
    finally:
        for process in processes.values():
            if process.poll() is None:
                os.kill(process.pid, signal.SIGKILL)
                process.wait(10)
