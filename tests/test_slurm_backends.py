"""Both Slurm backends against their real cluster: onprem by CLI, rented by slurmrestd."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest

from slurm_geo.sandbox import remote_site
from slurm_geo.sandbox.users import ALICE
from slurm_geo.slurm import JobNotFound, JobSpec, JobState, SlurmRejected
from tests.helpers import eventually
from tests.kit.sandbox import host_path

pytestmark = pytest.mark.sandbox

HOSTILE_NAME = "it's a \"job\"; echo pwned"


def script(body: str) -> str:
    return f"#!/bin/bash\n{body}\n"


def account_of(sandbox, cluster: str) -> tuple[int, str]:
    """alice's uid and user name on `cluster`: the provider's accounts are its own."""
    if cluster == sandbox.layout.rented.name and remote_site.is_provider(sandbox.layout):
        account = remote_site.account_for(ALICE.name)
        return account.uid, account.name
    return ALICE.uid, ALICE.name


def test_submitted_job_runs_as_alice_with_its_environment_and_reports_completion(
        cluster, run_dir, sandbox):
    out = run_dir / "env value.txt"
    spec = JobSpec(script=script(f'echo "$GEO_TEST_VALUE" > "{out}"; id -u > "{out}.uid"'),
                   name=HOSTILE_NAME,
                   working_dir=run_dir, environment={"GEO_TEST_VALUE": "hello 'world'"},
                   time_limit_minutes=5)
    job_id = cluster.submit(spec)

    info = eventually(lambda: cluster.job(job_id), lambda j: j.state.is_terminal())

    assert info.state is JobState.COMPLETED
    assert info.name == HOSTILE_NAME
    assert info.cluster == cluster.cluster
    assert info.exit_code == 0
    assert host_path(sandbox, out).read_text() == "hello 'world'\n"
    uid, user = account_of(sandbox, cluster.cluster)
    assert host_path(sandbox, run_dir / "env value.txt.uid").read_text() == f"{uid}\n"
    assert info.user == user


def test_cancel_ends_a_running_job(cluster, run_dir):
    job_id = cluster.submit(JobSpec(script=script("sleep 300"), working_dir=run_dir,
                                    time_limit_minutes=10))
    eventually(lambda: cluster.job(job_id), lambda j: j.state is JobState.RUNNING)

    cluster.cancel(job_id)

    info = eventually(lambda: cluster.job(job_id), lambda j: j.state.is_terminal())
    assert info.state is JobState.CANCELLED


@pytest.fixture
def occupied(cluster, run_dir):
    """Both nodes of the cluster busy for ten minutes; yields the blocking job ids and
    cancels those still running (a blocker left behind outlived the suite's
    `sandbox down`, whose site removal then refused to go on)."""
    blockers = [cluster.submit(JobSpec(script=script("sleep 600"), working_dir=run_dir,
                                       cpus_per_task=2, time_limit_minutes=10))
                for _ in range(2)]
    for job_id in blockers:
        eventually(lambda j=job_id: cluster.job(j), lambda j: j.state is JobState.RUNNING)
    yield blockers
    for job_id in blockers:
        if not cluster.job(job_id).state.is_terminal():
            cluster.cancel(job_id)


def test_hold_and_release_a_pending_job(cluster, run_dir, occupied):
    job_id = cluster.submit(JobSpec(script=script("true"), working_dir=run_dir,
                                    time_limit_minutes=5))
    assert cluster.job(job_id).state is JobState.PENDING

    cluster.hold(job_id)
    assert cluster.job(job_id).held

    cluster.release(job_id)
    assert not cluster.job(job_id).held
    for blocker in occupied:
        cluster.cancel(blocker)
    eventually(lambda: cluster.job(job_id), lambda j: j.state is JobState.COMPLETED)


def test_job_submitted_held_starts_only_after_release(cluster, run_dir):
    job_id = cluster.submit(JobSpec(script=script("true"), working_dir=run_dir, hold=True,
                                    time_limit_minutes=5))
    assert cluster.job(job_id).held

    cluster.release(job_id)

    eventually(lambda: cluster.job(job_id), lambda j: j.state is JobState.COMPLETED)


def test_expected_start_is_now_on_an_idle_cluster(cluster):
    spec = JobSpec(script=script("true"), time_limit_minutes=5)
    before = datetime.now(UTC)

    start = cluster.expected_start(spec)

    assert start is not None
    assert before - timedelta(seconds=5) <= start <= before + timedelta(seconds=60)


def test_expected_start_does_not_queue_a_job(cluster):
    before = {j.job_id for j in cluster.jobs()}
    cluster.expected_start(JobSpec(script=script("true"), time_limit_minutes=5))
    assert {j.job_id for j in cluster.jobs()} == before


def test_expected_start_waits_for_running_jobs_on_a_full_cluster(cluster, occupied):
    spec = JobSpec(script=script("true"), cpus_per_task=2, time_limit_minutes=5)

    start = cluster.expected_start(spec)

    blockers_end = datetime.now(UTC) + timedelta(minutes=10)
    assert start is not None
    assert blockers_end - timedelta(minutes=2) <= start <= blockers_end + timedelta(minutes=2)


def test_unknown_job_raises_job_not_found(cluster):
    with pytest.raises(JobNotFound) as caught:
        cluster.job(987654)
    assert caught.value.cluster == cluster.cluster
    with pytest.raises(JobNotFound):
        cluster.cancel(987654)


def test_nodes_and_ping_report_a_healthy_cluster(cluster):
    assert cluster.ping() >= 0
    nodes = cluster.nodes()
    assert [n.name for n in nodes] == [f"{cluster.cluster}-n1", f"{cluster.cluster}-n2"]
    assert all(n.available and n.cpus == 2 for n in nodes)


def test_accounting_window_and_job_ids_agree(cluster, run_dir, sandbox):
    before = datetime.now(UTC) - timedelta(seconds=1)
    job_id = cluster.submit(JobSpec(script=script("sleep 2"), working_dir=run_dir,
                                    time_limit_minutes=5))
    eventually(lambda: cluster.job(job_id), lambda j: j.state is JobState.COMPLETED)

    [record] = eventually(lambda: cluster.accounting([job_id]),
                          lambda rs: len(rs) == 1 and rs[0].state is JobState.COMPLETED
                          and rs[0].settled)
    window = cluster.accounting(start=before, end=datetime.now(UTC) + timedelta(seconds=1))
    earlier = cluster.accounting(start=before - timedelta(hours=2),
                                 end=before - timedelta(hours=1))

    # the host's clusters' partition is batch; the provider's machine names its own gpu
    provider = cluster.cluster == "rented" and remote_site.is_provider(sandbox.layout)
    assert record.name == "slurm-geo" and record.partition == ("gpu" if provider else "batch")
    assert record in window
    assert record not in earlier
    assert record.elapsed_s >= 2
    assert record.allocated_tres["cpu"] == 1
    assert record.start_time and record.end_time
    assert (record.end_time - record.start_time).total_seconds() == record.elapsed_s


def test_requeued_job_keeps_its_id_and_accounting_shows_each_incarnation(
        cluster, provider_admin, run_dir, sandbox):
    job_id = cluster.submit(JobSpec(script=script("sleep 300"), working_dir=run_dir,
                                    time_limit_minutes=10, requeue=True))
    eventually(lambda: cluster.job(job_id), lambda j: j.state is JobState.RUNNING)
    time.sleep(2)  # so the first incarnation has run time of its own in accounting

    if cluster.cluster == "rented" and not remote_site.is_provider(sandbox.layout):
        # slurmrestd has no requeue verb: the REST backend says so, and the provider's
        # own Slurm requeues (as on preemption); slurm-geo still sees it all through REST.
        with pytest.raises(SlurmRejected, match="no requeue"):
            cluster.requeue(job_id)
        provider_admin("rented").requeue(job_id)
    else:
        cluster.requeue(job_id)

    eventually(lambda: cluster.job(job_id),
               lambda j: j.restart_count == 1 and j.state is JobState.PENDING)
    records = eventually(lambda: cluster.accounting([job_id]), lambda rs: len(rs) == 2)
    assert [r.job_id for r in records] == [job_id, job_id]
    assert records[0].state is JobState.REQUEUED
    assert records[0].elapsed_s >= 1
