"""The in-memory Slurm fake keeps the real backends' contract (see test_slurm_backends.py)."""

from __future__ import annotations

import threading
from datetime import UTC, datetime

import pytest

from slurm_geo.slurm.client import SlurmClient
from slurm_geo.slurm.errors import ControllerUnreachable, JobNotFound, SlurmRejected
from slurm_geo.slurm.fake import FakeSlurm
from slurm_geo.slurm.models import JobSpec, JobState, NodeInfo, Owner
from tests.kit.clock import ManualClock

T0 = 1_700_000_000.0
HOSTILE_SCRIPT = "#!/bin/bash\necho \"it's\"; echo foo'; rm -rf /'\n"


def at(seconds: float) -> datetime:
    return datetime.fromtimestamp(T0 + seconds, UTC)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(T0)


@pytest.fixture
def fake(clock: ManualClock) -> FakeSlurm:
    return FakeSlurm("onprem", clock=clock)


def spec(**fields) -> JobSpec:
    return JobSpec(script=fields.pop("script", "#!/bin/bash\ntrue\n"), **fields)


def test_implements_every_abstract_method_of_the_interface():
    assert not FakeSlurm.__abstractmethods__
    client: SlurmClient = FakeSlurm("c")
    assert client.cluster == "c" and client.timeout_s == 1.0


def test_submit_gives_increasing_ids_and_records_the_spec(fake, clock):
    first = spec(environment={"GEO_TOKEN": "a b 'c'"}, name="it's \"a\" job")
    clock.now += 5
    ids = [fake.submit(first), fake.submit(spec())]

    assert ids == [1, 2]
    assert fake.submitted == [(1, first), (2, spec())]
    info = fake.job(1)
    assert (info.state, info.name, info.cluster, info.held) == (
        JobState.PENDING, "it's \"a\" job", "onprem", False)
    # A pending job's start time is the controller's estimate: "now" on an idle cluster.
    assert info.submit_time == at(5) and info.start_time == at(5)
    assert [j.job_id for j in fake.jobs()] == [1, 2]


def test_a_job_submitted_held_is_held():
    fake = FakeSlurm("c")
    job_id = fake.submit(spec(hold=True))
    assert fake.job(job_id).held and fake.job(job_id).reason == "JobHeldUser"


def test_start_and_finish_move_a_job_and_stamp_times(fake, clock):
    job_id = fake.submit(spec(nodes=2, time_limit_minutes=7, partition="gpu"))
    clock.now += 10
    fake.start(job_id)
    running = fake.job(job_id)
    clock.now += 30
    fake.finish(job_id)
    done = fake.job(job_id)

    assert (running.state, running.start_time, running.nodes) == (
        JobState.RUNNING, at(10), "onprem-n1,onprem-n2")
    assert (running.partition, running.time_limit_minutes) == ("gpu", 7)
    assert (done.state, done.end_time, done.exit_code) == (JobState.COMPLETED, at(40), 0)


@pytest.mark.parametrize("state, exit_code, expected_code", [
    (JobState.COMPLETED, None, 0),
    (JobState.FAILED, None, 1),
    (JobState.NODE_FAIL, None, 1),
    (JobState.FAILED, 42, 42),
    (JobState.TIMEOUT, 0, 0),
])
def test_finish_sets_the_state_and_exit_code(fake, state, exit_code, expected_code):
    job_id = fake.submit(spec())
    fake.start(job_id)
    fake.finish(job_id, state, exit_code=exit_code)
    assert (fake.job(job_id).state, fake.job(job_id).exit_code) == (state, expected_code)


@pytest.mark.parametrize("prepare, control", [
    (lambda f, j: f.hold(j), lambda f, j: f.start(j)),  # held jobs do not start
    (lambda f, j: f.start(j), lambda f, j: f.start(j)),
    (lambda f, j: f.cancel(j), lambda f, j: f.finish(j)),
    (lambda f, j: None, lambda f, j: f.finish(j, JobState.RUNNING)),
    (lambda f, j: None, lambda f, j: f.forget(j)),  # slurmctld keeps live jobs
])
def test_test_controls_refuse_what_slurm_could_not_do(fake, prepare, control):
    job_id = fake.submit(spec())
    prepare(fake, job_id)
    with pytest.raises(ValueError):
        control(fake, job_id)


@pytest.mark.parametrize("started", [False, True])
def test_cancel_ends_a_live_job(fake, clock, started):
    job_id = fake.submit(spec())
    if started:
        fake.start(job_id)
    clock.now += 3
    fake.cancel(job_id)
    info = fake.job(job_id)
    assert (info.state, info.end_time) == (JobState.CANCELLED, at(3))


def test_cancelling_a_finished_job_changes_nothing(fake, clock):
    job_id = fake.submit(spec())
    fake.start(job_id)
    fake.finish(job_id, JobState.FAILED)
    before = fake.job(job_id)
    clock.now += 60
    fake.cancel(job_id)
    assert fake.job(job_id) == before


def test_requeue_keeps_the_id_and_starts_a_new_incarnation(fake, clock):
    job_id = fake.submit(spec(requeue=True, cpus_per_task=2))
    fake.start(job_id)
    clock.now += 20
    fake.requeue(job_id)
    pending = fake.job(job_id)
    clock.now += 5
    fake.start(job_id)
    clock.now += 10
    fake.finish(job_id)

    assert (pending.state, pending.restart_count, pending.start_time) == (
        JobState.PENDING, 1, pending.submit_time)
    assert pending.submit_time == at(20)
    first, second = fake.accounting([job_id])
    assert (first.state, first.elapsed_s, first.end_time) == (JobState.REQUEUED, 20, at(20))
    assert (second.state, second.elapsed_s, second.start_time) == (JobState.COMPLETED, 10, at(25))
    assert first.allocated_tres == {"cpu": 2, "node": 1}
    assert fake.job(job_id).restart_count == 1


def test_requeue_of_a_finished_job_keeps_its_final_state_in_accounting(fake):
    job_id = fake.submit(spec())
    fake.start(job_id)
    fake.finish(job_id, JobState.FAILED)
    fake.requeue(job_id)
    assert [r.state for r in fake.accounting([job_id])] == [JobState.FAILED, JobState.PENDING]


@pytest.mark.parametrize("job_spec, start, match", [
    (spec(), False, "pending"),
    (spec(requeue=False), True, "disabled"),
])
def test_requeue_is_refused_where_slurm_refuses(fake, job_spec, start, match):
    job_id = fake.submit(job_spec)
    if start:
        fake.start(job_id)
    with pytest.raises(SlurmRejected, match=match):
        fake.requeue(job_id)


def test_hold_and_release_a_pending_job(fake):
    job_id = fake.submit(spec())
    fake.hold(job_id)
    assert fake.job(job_id).held
    fake.hold(job_id)  # again: still held, no error
    fake.release(job_id)
    assert not fake.job(job_id).held
    fake.start(job_id)
    assert fake.job(job_id).state is JobState.RUNNING


def test_hold_and_release_of_a_running_job_only_mark_it(fake):
    # As both real backends do (tests/test_slurm_contract.py): it runs on.
    job_id = fake.submit(spec())
    fake.start(job_id)
    fake.hold(job_id)
    assert fake.job(job_id).state is JobState.RUNNING and not fake.job(job_id).held
    fake.release(job_id)
    assert fake.job(job_id).state is JobState.RUNNING


@pytest.mark.parametrize("action", ["hold", "release"])
def test_hold_and_release_refuse_a_finished_job(fake, action):
    job_id = fake.submit(spec())
    fake.start(job_id)
    fake.finish(job_id)
    with pytest.raises(SlurmRejected, match="already finished"):
        getattr(fake, action)(job_id)


def test_batch_script_is_the_submitted_one(fake):
    job_id = fake.submit(spec(script=HOSTILE_SCRIPT))
    assert fake.batch_script(job_id) == HOSTILE_SCRIPT


@pytest.mark.parametrize("call", [
    lambda f: f.job(99), lambda f: f.cancel(99), lambda f: f.requeue(99),
    lambda f: f.batch_script(99), lambda f: f.hold(99), lambda f: f.release(99),
    lambda f: f.start(99), lambda f: f.finish(99), lambda f: f.forget(99),
])
def test_unknown_job_raises_job_not_found(fake, call):
    fake.submit(spec())
    with pytest.raises(JobNotFound) as caught:
        call(fake)
    assert (caught.value.cluster, caught.value.job_id) == ("onprem", 99)


def test_a_forgotten_job_is_answered_from_accounting(fake, clock):
    job_id = fake.submit(spec(requeue=True))
    fake.start(job_id)
    # Without time passing the two incarnations share a submit time, and job_from_records
    # (as the real backends use it) would pick the first.
    clock.now += 1
    fake.requeue(job_id)
    fake.start(job_id)
    clock.now += 8
    fake.finish(job_id)
    fake.forget(job_id)

    info = fake.job(job_id)
    assert (info.state, info.restart_count, info.end_time) == (JobState.COMPLETED, 1, at(9))
    assert fake.jobs() == []
    for call in (fake.cancel, fake.batch_script, fake.requeue):
        with pytest.raises(JobNotFound):
            call(job_id)
    assert len(fake.accounting([job_id])) == 2


def test_ping_and_nodes_report_a_healthy_cluster():
    fake = FakeSlurm("rented")
    assert fake.ping() >= 0
    nodes = fake.nodes()
    assert [n.name for n in nodes] == ["rented-n1", "rented-n2"]
    assert all(n.available and n.cpus == 2 for n in nodes)


def test_nodes_are_configurable():
    drained = NodeInfo("x1", "idle", ("DRAIN",), "maintenance", 8, ("batch",))
    fake = FakeSlurm("c", nodes=[drained])
    assert fake.nodes() == [drained]
    fake.set_nodes([])
    assert fake.nodes() == []


@pytest.mark.parametrize("setting, expected", [
    ("default", at(100)),  # an idle cluster: now
    (300, at(400)),
    (2.5, at(102.5)),
    (at(7), at(7)),
    (None, None),
])
def test_expected_start(fake, clock, setting, expected):
    if setting != "default":
        fake.set_expected_start(setting)
    clock.now += 100
    assert fake.expected_start(spec()) == expected
    assert fake.jobs() == []  # asking queues nothing


@pytest.fixture
def history(fake, clock):
    """Job 1 ran [10, 20); job 2 pending since 30; job 3 running since 50; now is 60."""
    for job_id in (1, 2, 3):
        clock.now = T0 + (job_id - 1) * 20 + 10
        fake.submit(spec())
    clock.now = T0 + 10
    fake.start(1)
    clock.now = T0 + 20
    fake.finish(1)
    clock.now = T0 + 50
    fake.start(3)
    clock.now = T0 + 60
    return fake


@pytest.mark.parametrize("start, end, expected", [
    (0, 5, []),
    (0, 15, [1]),
    (20, 25, [1]),  # ended at the window's start: overlaps, as in client.overlaps
    (21, 29, []),
    (21, 31, [2]),
    (0, 100, [1, 2, 3]),
    (55, 100, [2, 3]),
])
def test_accounting_by_window(history, start, end, expected):
    records = history.accounting(start=at(start), end=at(end))
    assert [r.job_id for r in records] == expected


def test_accounting_by_job_ids(history):
    assert [r.job_id for r in history.accounting([3, 1, 77])] == [3, 1]
    running = history.accounting([3])[0]
    assert (running.state, running.elapsed_s, running.end_time) == (JobState.RUNNING, 10, None)
    assert history.accounting([2])[0].allocated_tres == {}


def test_accounting_needs_ids_or_a_window(fake):
    with pytest.raises(ValueError):
        fake.accounting(start=at(0))


def test_record_carries_the_comment_and_partition(fake):
    job_id = fake.submit(spec(comment="geo:logical=onprem-7"))
    [record] = fake.accounting([job_id])
    assert (record.comment, record.partition, record.settled) == (
        "geo:logical=onprem-7", "batch", True)


CLIENT_CALLS = [
    lambda f: f.submit(spec()), lambda f: f.job(1), lambda f: f.jobs(), lambda f: f.cancel(1),
    lambda f: f.requeue(1), lambda f: f.batch_script(1), lambda f: f.batch_environment(1),
    lambda f: f.hold(1),
    lambda f: f.release(1), lambda f: f.ping(), lambda f: f.nodes(),
    lambda f: f.expected_start(spec()), lambda f: f.accounting([1]),
    lambda f: f.accounting(start=at(0), end=at(1)),
]


@pytest.mark.parametrize("call", CLIENT_CALLS)
def test_every_call_fails_while_the_controller_is_down(fake, call):
    fake.submit(spec())
    fake.go_down()
    with pytest.raises(ControllerUnreachable) as caught:
        call(fake)
    assert (caught.value.cluster, caught.value.timeout_s) == ("onprem", 1.0)


def test_jobs_live_on_while_the_controller_is_down(fake):
    job_id = fake.submit(spec())
    fake.go_down()
    fake.start(job_id)  # the test's hand on the cluster, not a client call
    fake.finish(job_id)
    fake.come_back()
    assert fake.job(job_id).state is JobState.COMPLETED
    assert fake.ping() >= 0


def test_a_rejected_submission_takes_no_job_id(fake):
    fake.reject_next_submit("Invalid partition name specified")
    fake.reject_next_submit()
    with pytest.raises(SlurmRejected, match="Invalid partition"):
        fake.submit(spec())
    with pytest.raises(SlurmRejected):
        fake.submit(spec())
    assert fake.submit(spec()) == 1
    assert [job_id for job_id, _ in fake.submitted] == [1]


def test_uses_the_injected_clock_only():
    fake = FakeSlurm("c", clock=lambda: 0.0)
    job_id = fake.submit(spec())
    assert fake.job(job_id).submit_time == datetime(1970, 1, 1, tzinfo=UTC)
    assert fake.expected_start(spec()) == datetime(1970, 1, 1, tzinfo=UTC)


def test_threads_get_distinct_job_ids():
    fake = FakeSlurm("c")

    def submit_many() -> None:
        for _ in range(200):
            fake.submit(spec())

    threads = [threading.Thread(target=submit_many) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(job_id for job_id, _ in fake.submitted) == list(range(1, 801))
    assert len(fake.jobs()) == 800


def test_timeout_is_reported_as_configured():
    fake = FakeSlurm("c", timeout_s=2.5)
    fake.go_down()
    with pytest.raises(ControllerUnreachable, match="2.5 s"):
        fake.ping()
    fake.come_back()
    assert fake.ping() >= 0


def test_a_job_belongs_to_its_specs_owner_and_keeps_its_environment(fake):
    alice = Owner("alice", 2001, 2100)
    owned = fake.submit(spec(owner=alice, environment={"PATH": "/home/alice/bin"}))
    plain = fake.submit(spec())

    assert fake.job(owned).owner == alice
    assert fake.job(plain).owner == Owner("fake-user", 1000, 1000)
    assert fake.accounting([owned])[0].user == "alice"
    assert fake.batch_environment(owned) == {"PATH": "/home/alice/bin"}
    assert fake.batch_environment(plain) == {}
    assert [s.owner for _, s in fake.submitted] == [alice, None]


def test_the_batch_environment_outlives_slurmctlds_memory_of_the_job(fake):
    job_id = fake.submit(spec(environment={"A": "1"}))
    fake.cancel(job_id)
    fake.forget(job_id)
    assert fake.batch_environment(job_id) == {"A": "1"}
    with pytest.raises(JobNotFound):
        fake.batch_environment(99)
