"""The SlurmClient contract: what slurm_geo.slurm.client promises, asked of every client.

One set of tests, run on FakeSlurm always (seconds, no sandbox) and on the two real
backends against the sandbox: the CLI backend on onprem, the slurmrestd backend on rented
(marked `sandbox` and `slow`). The real backends are the truth: where the fake answers
otherwise, the fake is what is wrong.

The fake schedules nothing on its own, so each client comes with a `Driver` saying how a
test gets a job running or finished: on the fake the test moves it (`start`, `finish`), on
a real cluster it waits for the scheduler and the job's script.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from slurm_geo.sandbox import remote_site
from slurm_geo.sandbox.users import ALICE
from slurm_geo.slurm import (
    AccountingRecord,
    JobInfo,
    JobNotFound,
    JobSpec,
    JobState,
    SlurmClient,
    SlurmError,
    SlurmRejected,
    connect,
)
from slurm_geo.slurm.fake import FakeSlurm
from slurm_geo.slurm.rest_backend import REQUEUE_SINCE, RestSlurmClient, api_at_least
from tests.helpers import eventually

UNKNOWN_JOB = 987654  # no cluster of the sandbox gets this far in a test run
LONG = "#!/bin/bash\nsleep 300\n"  # runs until the test ends it
SHORT = "#!/bin/bash\nsleep 1\n"


@dataclass
class Driver:
    """A client under contract, and how a test moves its jobs along."""

    client: SlurmClient
    user: str  # the user name the cluster runs alice's jobs as
    working_dir: Path
    can_requeue: bool = True  # slurmrestd before v0.0.45 has no requeue operation
    keeps_scripts: bool = True  # slurmrestd returns no batch script nor environment
    fake: FakeSlurm | None = None
    submitted: list[int] = field(default_factory=list)

    def submit(self, script: str = LONG, **fields) -> int:
        spec = JobSpec(script=script, owner=ALICE.owner, working_dir=self.working_dir,
                       time_limit_minutes=10, **fields)
        job_id = self.client.submit(spec)
        self.submitted.append(job_id)
        return job_id

    def running(self, job_id: int) -> JobInfo:
        """The job once it runs: the fake starts it, a real cluster's scheduler does."""
        if self.fake is not None:
            self.fake.start(job_id)
        return self.wait(job_id, lambda j: j.state is JobState.RUNNING)

    def completed(self, job_id: int) -> JobInfo:
        """The job once its script has ended well (started and finished, on the fake)."""
        if self.fake is not None:
            if self.fake.job(job_id).state is JobState.PENDING:
                self.fake.start(job_id)
            self.fake.finish(job_id)
        return self.wait(job_id, lambda j: j.state is JobState.COMPLETED)

    def wait(self, job_id: int, accept: Callable[[JobInfo], bool]) -> JobInfo:
        return eventually(lambda: self.client.job(job_id), accept, timeout_s=90)

    def records(self, job_id: int, count: int) -> list[AccountingRecord]:
        """Accounting's `count` settled incarnations of the job (slurmdbd writes late)."""
        return eventually(lambda: self.client.accounting([job_id]),
                          lambda rs: len(rs) == count and all(r.settled for r in rs),
                          timeout_s=90)

    def cancel_all(self) -> None:
        for job_id in self.submitted:
            try:
                self.client.cancel(job_id)
            except SlurmError:
                pass


def _fake(_request) -> Driver:
    fake = FakeSlurm("onprem", user="fake-user")
    return Driver(fake, ALICE.name, Path("/tmp"), fake=fake)


@pytest.fixture(scope="module")
def sandbox_up(sandbox):
    """The sandbox, brought up once for this module: a previous module may have stopped a
    daemon, and no test here stops one."""
    sandbox.up(progress=lambda _msg: None)
    return sandbox


def _real(request, cluster: str) -> Driver:
    sandbox = request.getfixturevalue("sandbox_up")
    site = request.getfixturevalue("site")
    shared_dir = request.getfixturevalue("shared_dir")
    layout = sandbox.layout
    client = connect(site.cluster(cluster))
    working_dir = shared_dir
    user = ALICE.name
    if cluster == layout.rented.name and remote_site.is_provider(layout):
        # The provider's machine has none of home's files, and accounts of its own.
        working_dir = remote_site.work_dir(ALICE.name)
        user = remote_site.account_for(ALICE.name).name
    rest = isinstance(client, RestSlurmClient)
    return Driver(client, user, working_dir, keeps_scripts=not rest,
                  can_requeue=not rest or api_at_least(client.api_version, REQUEUE_SINCE))


REAL = [pytest.mark.sandbox, pytest.mark.slow]
BACKENDS: dict[str, Callable[[pytest.FixtureRequest], Driver]] = {
    "fake": _fake,
    "cli": lambda request: _real(request, "onprem"),
    "rest": lambda request: _real(request, "rented"),
}


@pytest.fixture(params=[pytest.param("fake"), pytest.param("cli", marks=REAL),
                        pytest.param("rest", marks=REAL)])
def slurm(request) -> Iterator[Driver]:
    driver = BACKENDS[request.param](request)
    yield driver
    driver.cancel_all()


# --- submit, job, jobs ---------------------------------------------------------------------

def test_a_submitted_job_is_its_owners_and_listed_with_its_fields(slurm):
    job_id = slurm.submit(name="contract-submit", hold=True)

    info = slurm.client.job(job_id)

    assert (info.cluster, info.job_id, info.name) == (slurm.client.cluster, job_id,
                                                      "contract-submit")
    assert info.user == slurm.user
    assert info.state is JobState.PENDING and info.held
    assert info.restart_count == 0
    assert info.time_limit_minutes == 10
    assert info.submit_time is not None and info.end_time is None
    assert job_id in {j.job_id for j in slurm.client.jobs()}


def test_job_ids_are_distinct_and_increasing(slurm):
    first = slurm.submit(hold=True)
    second = slurm.submit(hold=True)
    assert second > first


def test_the_batch_script_is_the_one_submitted_or_refused(slurm):
    script = "#!/bin/bash\n# contract: the script comes back as it went\nsleep 300\n"
    job_id = slurm.submit(script, hold=True)
    if not slurm.keeps_scripts:
        with pytest.raises(SlurmRejected, match="batch script"):
            slurm.client.batch_script(job_id)
        return
    assert slurm.client.batch_script(job_id) == script


def test_a_job_runs_and_completes_with_exit_code_zero(slurm):
    job_id = slurm.submit(SHORT)

    info = slurm.completed(job_id)

    assert info.exit_code == 0
    assert info.start_time is not None and info.end_time is not None
    assert info.start_time <= info.end_time


# --- hold and release ----------------------------------------------------------------------

def test_a_job_submitted_held_is_released_and_runs(slurm):
    job_id = slurm.submit(hold=True)
    assert slurm.client.job(job_id).held

    slurm.client.release(job_id)

    assert not slurm.client.job(job_id).held
    assert slurm.running(job_id).state is JobState.RUNNING


def test_a_held_job_is_held_again_with_a_comment(slurm):
    job_id = slurm.submit(hold=True)

    slurm.client.hold(job_id, comment="contract: held for a reason")

    info = slurm.client.job(job_id)
    assert info.held and info.state is JobState.PENDING


def test_hold_and_release_of_a_running_job_let_it_run(slurm):
    job_id = slurm.submit()
    slurm.running(job_id)

    slurm.client.hold(job_id)
    held = slurm.client.job(job_id)
    slurm.client.release(job_id)

    assert held.state is JobState.RUNNING and not held.held
    assert slurm.client.job(job_id).state is JobState.RUNNING


@pytest.mark.parametrize("action", ["hold", "release"])
def test_hold_and_release_refuse_a_finished_job(slurm, action):
    job_id = slurm.submit(SHORT)
    slurm.completed(job_id)

    with pytest.raises(SlurmRejected, match="already finished"):
        getattr(slurm.client, action)(job_id)

    assert slurm.client.job(job_id).state is JobState.COMPLETED


# --- cancel --------------------------------------------------------------------------------

def test_cancel_ends_a_pending_job(slurm):
    job_id = slurm.submit(hold=True)

    slurm.client.cancel(job_id)

    assert slurm.wait(job_id, lambda j: j.state.is_terminal()).state is JobState.CANCELLED


def test_cancel_ends_a_running_job(slurm):
    job_id = slurm.submit()
    slurm.running(job_id)

    slurm.client.cancel(job_id)

    assert slurm.wait(job_id, lambda j: j.state.is_terminal()).state is JobState.CANCELLED


def test_cancelling_a_finished_job_changes_nothing(slurm):
    job_id = slurm.submit(SHORT)
    slurm.completed(job_id)

    slurm.client.cancel(job_id)

    assert slurm.client.job(job_id).state is JobState.COMPLETED


# --- requeue -------------------------------------------------------------------------------

def test_a_requeued_job_keeps_its_id_and_accounting_has_each_incarnation(slurm):
    if not slurm.can_requeue:
        pytest.skip("this slurmrestd has no requeue operation (the backend refuses it)")
    job_id = slurm.submit(requeue=True)
    slurm.running(job_id)
    time.sleep(1.5)  # so the first incarnation has run time of its own

    slurm.client.requeue(job_id)

    # Back in the queue under the same id (a real cluster passes COMPLETING on the way).
    info = slurm.wait(job_id, lambda j: j.restart_count == 1 and j.state is JobState.PENDING)
    assert info.job_id == job_id
    first, second = slurm.records(job_id, 2)
    assert (first.job_id, second.job_id) == (job_id, job_id)
    assert first.state is JobState.REQUEUED
    assert first.elapsed_s >= 1


def test_requeue_refuses_a_pending_job(slurm):
    job_id = slurm.submit(hold=True, requeue=True)
    with pytest.raises(SlurmRejected):
        slurm.client.requeue(job_id)
    assert slurm.client.job(job_id).restart_count == 0


# --- unknown job ids -----------------------------------------------------------------------

@pytest.mark.parametrize("action", ["job", "cancel", "hold", "release", "requeue",
                                    "batch_script"])
def test_an_unknown_job_id_is_job_not_found(slurm, action):
    if action == "requeue" and not slurm.can_requeue:
        pytest.skip("this slurmrestd has no requeue operation (the backend refuses it)")
    if action == "batch_script" and not slurm.keeps_scripts:
        pytest.skip("slurmrestd returns no batch script, of any job")
    with pytest.raises(JobNotFound) as caught:
        getattr(slurm.client, action)(UNKNOWN_JOB)
    assert caught.value.cluster == slurm.client.cluster
    assert caught.value.job_id == UNKNOWN_JOB


def test_accounting_knows_nothing_of_an_unknown_job_id(slurm):
    assert slurm.client.accounting([UNKNOWN_JOB]) == []


# --- accounting ----------------------------------------------------------------------------

def test_accounting_by_job_id_by_window_and_row_by_row_agree(slurm):
    before = datetime.now(UTC) - timedelta(seconds=1)
    job_id = slurm.submit(SHORT, name="contract-accounting")
    slurm.completed(job_id)

    [record] = eventually(lambda: slurm.records(job_id, 1),
                          lambda rs: rs[0].state is JobState.COMPLETED, timeout_s=90)
    after = datetime.now(UTC) + timedelta(seconds=1)
    window = slurm.client.accounting(start=before, end=after)
    rows = list(slurm.client.accounting_rows(before, after))
    earlier = slurm.client.accounting(start=before - timedelta(hours=2),
                                      end=before - timedelta(hours=1))

    assert (record.cluster, record.job_id, record.name) == (
        slurm.client.cluster, job_id, "contract-accounting")
    assert record.user == slurm.user
    assert record.exit_code == 0
    assert record.start_time is not None and record.end_time is not None
    assert record in window
    assert record in rows
    assert record not in earlier


def test_accounting_needs_job_ids_or_a_whole_window(slurm):
    # Asked for neither, a client refuses (a caller's mistake) rather than answer for all time.
    with pytest.raises(ValueError):
        slurm.client.accounting()


# --- the cluster ---------------------------------------------------------------------------

def test_ping_nodes_and_expected_start_of_a_healthy_cluster(slurm):
    assert slurm.client.ping() >= 0
    nodes = slurm.client.nodes()
    assert nodes and all(n.cpus > 0 and n.partitions for n in nodes)
    spec = JobSpec(script=SHORT, owner=ALICE.owner, working_dir=slurm.working_dir,
                   time_limit_minutes=5)
    before = {j.job_id for j in slurm.client.jobs()}

    start = slurm.client.expected_start(spec)

    assert start is None or start.tzinfo is not None
    assert {j.job_id for j in slurm.client.jobs()} == before  # nothing was queued


def test_the_batch_environment_is_the_submitted_one_or_refused(slurm):
    """As the interface says: the environment as Slurm keeps it (slurmdbd with
    AccountingStoreFlags=job_env, the CLI's sacct), or SlurmRejected where it keeps none
    (slurmrestd answers no environment)."""
    job_id = slurm.submit(SHORT, environment={"GEO_CONTRACT": "value 'quoted'"})
    slurm.completed(job_id)
    slurm.records(job_id, 1)

    if not slurm.keeps_scripts:
        with pytest.raises(SlurmRejected):
            slurm.client.batch_environment(job_id)
        return
    assert slurm.client.batch_environment(job_id)["GEO_CONTRACT"] == "value 'quoted'"
