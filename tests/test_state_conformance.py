"""One table of what federation.state.interface promises (`State`, its `IdentityStore`,
the `Audit` log), run on both backends: SQLite always, etcd on a real member (the session's
`etcd` fixture, tests/etcd_server.py), as the leading replica.

Each behaviour names the interface members it exercises; a test checks that together they
name every member, and that each backend class has every member with the interface's
parameters (mypy checks the types: federation.state.open). One script run on both must
read back the same, audit hashes included. Every transition pair, two writers racing, and
what only one backend has (SQLite's schema and migrations, etcd's leadership, sealing and
a member lost) are in test_federation_state.py and test_federation_etcd*.py."""

from __future__ import annotations

import inspect
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from slurm_geo.ckpt.format.keys import KeyFile
from slurm_geo.federation.model import (
    ClusterStatus,
    Health,
    IllegalTransition,
    Incarnation,
    IncarnationEnd,
    JobStatus,
    Lease,
    LeftHome,
    LogicalJob,
    RunOwner,
    StaleJob,
    UnknownLogicalJob,
    token_digest,
)
from slurm_geo.federation.state.audit import GENESIS, AuditLog
from slurm_geo.federation.state.etcd.audit import EtcdAuditLog
from slurm_geo.federation.state.etcd.identities import EtcdIdentities
from slurm_geo.federation.state.etcd.kv import EtcdKV, EtcdTLS
from slurm_geo.federation.state.etcd.state import EtcdFederationState
from slurm_geo.federation.state.identities import Identities, TokenOwner
from slurm_geo.federation.state.interface import Audit, IdentityStore, State
from slurm_geo.federation.state.sqlite import FederationState
from slurm_geo.slurm.models import Owner
from tests.etcd_server import MASTER_KEY, EtcdMember, fresh_prefix, open_replica

NOW = 1_800_000_000.0
NAME = "onprem-7"
HOME, CLOUD, EDGE = "onprem", "cloud", "edge"
ADA = Owner("ada", 4242, 4242)
BOB = Owner("bob", 4343, 4343)


def a_job(name: str = NAME, **overrides: Any) -> LogicalJob:
    base = LogicalJob(logical_job=name, run="run-7", home=HOME,
                      script="#!/bin/bash\necho 'hi'; echo \"$x\"\n", spec={"nodes": 2},
                      directives={"--geo-failover": "auto"}, generation=0, cluster=HOME,
                      job_id=7, resume_step=None, status=JobStatus.RUNNING,
                      created_at=NOW - 3600, updated_at=NOW - 3600)
    return replace(base, **overrides)


def a_lease(generation: int = 0, *, name: str = NAME, renewed_at: float = NOW - 5,
            released: bool = False, cluster: str = HOME, job_id: int = 7) -> Lease:
    return Lease(logical_job=name, generation=generation, cluster=cluster, job_id=job_id,
                 restart=0, renewed_at=renewed_at, last_step=100, released=released)


# --- the two backends -----------------------------------------------------------------------

@dataclass
class Backend:
    name: str
    state: State
    audit: Audit


def clock() -> float:
    return NOW


@pytest.fixture
def sqlite_backend(tmp_path: Path) -> Iterator[Backend]:
    state = FederationState(tmp_path / "federation" / "state.db")
    with AuditLog(tmp_path / "federation" / "audit.db", clock=clock) as audit:
        yield Backend("sqlite", state, audit)
    state.close()


@pytest.fixture
def etcd_backend(etcd: EtcdMember) -> Iterator[Backend]:
    prefix = fresh_prefix()
    state = open_replica([etcd.client_url], prefix, "onprem-a")
    assert state.leadership.campaign()
    kv = EtcdKV([etcd.client_url], KeyFile(MASTER_KEY), tls=EtcdTLS())
    with EtcdAuditLog(kv, state.layout, state.leadership, clock=clock) as audit:
        yield Backend("etcd", state, audit)
        state.leadership.resign()
    state.close()


@pytest.fixture(params=["sqlite", "etcd"])
def backend(request: pytest.FixtureRequest) -> Backend:
    found: Backend = request.getfixturevalue(f"{request.param}_backend")
    return found


# --- the table: each behaviour names the members it exercises -------------------------------

Check = Callable[[Backend], None]


@dataclass(frozen=True)
class Behaviour:
    name: str
    members: tuple[str, ...]  # "State.add_job", "IdentityStore.secret", "Audit.append"
    check: Check


BEHAVIOURS: list[Behaviour] = []
# Exercised by every behaviour's fixture, not by a row: opening and closing.
BY_THE_FIXTURES = ("State.close", "Audit.close", "Audit.__enter__", "Audit.__exit__")


def behaviour(*members: str) -> Callable[[Check], Check]:
    def register(check: Check) -> Check:
        BEHAVIOURS.append(Behaviour(check.__name__, members, check))
        return check
    return register


@behaviour("State.add_job", "State.job")
def a_job_is_registered_once_and_read_back_whole(b: Backend) -> None:
    job = a_job(owner=ADA, owner_env={"LANG": "C.UTF-8"}, generation=2, resume_step=40,
                status=JobStatus.MOVING, job_id=None)
    assert b.state.add_job(job) is True
    assert b.state.job(NAME) == job
    assert b.state.add_job(replace(job, run="another")) is False
    assert b.state.job(NAME) == job
    with pytest.raises(UnknownLogicalJob):
        b.state.job("nobody-1")


@behaviour("State.jobs", "State.find_by_run")
def jobs_are_listed_oldest_first_and_by_run(b: Backend) -> None:
    late = a_job("onprem-3", run="r1", status=JobStatus.MOVING, created_at=NOW - 10)
    early = a_job("onprem-1", run="r1", created_at=NOW - 30)
    done = a_job("onprem-2", run="r2", status=JobStatus.COMPLETED, created_at=NOW - 20)
    for job in (late, early, done):
        b.state.add_job(job)
    assert b.state.jobs() == [early, done, late]
    assert b.state.jobs(active_only=True) == [early, late]
    assert b.state.find_by_run("r1") == [early, late]
    assert b.state.find_by_run("r9") == []


@behaviour("State.begin_generation", "State.submitted", "State.incarnations",
           "State.find_job", "State.find_by_job_id")
def a_move_makes_the_next_incarnation_and_slurm_ids_find_the_job(b: Backend) -> None:
    job = a_job()
    b.state.add_job(job)
    moving = b.state.begin_generation(NAME, 0, CLOUD, 100, NOW, left_home=LeftHome.OUTAGE,
                                      recovery=True)
    assert (moving.generation, moving.cluster, moving.job_id, moving.status) == \
        (1, CLOUD, None, JobStatus.MOVING)
    assert (moving.resume_step, moving.left_home, moving.recoveries) == \
        (100, LeftHome.OUTAGE, 1)
    running = b.state.submitted(NAME, 1, 7, token_digest("t-1"), NOW + 1)
    assert (running.status, running.job_id, running.updated_at) == \
        (JobStatus.RUNNING, 7, NOW + 1)
    assert b.state.incarnations(NAME) == [
        Incarnation(NAME, 0, HOME, 7, None, job.created_at, None, None, None),
        Incarnation(NAME, 1, CLOUD, 7, 100, NOW, None, None, None)]
    assert b.state.find_job(HOME, 7) == running
    assert b.state.find_job(CLOUD, 7) == running
    assert b.state.find_job(EDGE, 7) is None
    assert b.state.find_by_job_id(7) == [(CLOUD, running), (HOME, running)]
    assert b.state.find_by_job_id(8) == []
    assert b.state.incarnations("nobody-1") == []


@behaviour("State.begin_generation")
def begin_generation_is_a_compare_and_set(b: Backend) -> None:
    b.state.add_job(a_job())
    b.state.put_lease(a_lease(renewed_at=NOW - 5), True)
    before = b.state.job(NAME)
    with pytest.raises(StaleJob):
        b.state.begin_generation(NAME, 1, CLOUD, None, NOW)
    with pytest.raises(StaleJob):
        b.state.begin_generation(NAME, 0, CLOUD, None, NOW, live_lease_ttl_s=30)
    with pytest.raises(UnknownLogicalJob):
        b.state.begin_generation("nobody-1", 0, CLOUD, None, NOW)
    assert b.state.job(NAME) == before
    moved = b.state.begin_generation(NAME, 0, HOME, 5, NOW, live_lease_ttl_s=1)
    assert (moved.generation, moved.left_home, moved.recoveries) == (1, None, 0)
    b.state.move_status(NAME, JobStatus.MOVING, JobStatus.CANCELLED, NOW)
    with pytest.raises(IllegalTransition):
        b.state.begin_generation(NAME, 1, CLOUD, None, NOW)


@behaviour("State.submitted")
def submitted_holds_only_for_the_moving_generation(b: Backend) -> None:
    b.state.add_job(a_job())
    with pytest.raises(StaleJob):
        b.state.submitted(NAME, 0, 8, token_digest("t-0"), NOW)
    b.state.begin_generation(NAME, 0, CLOUD, None, NOW)
    with pytest.raises(StaleJob):
        b.state.submitted(NAME, 2, 8, token_digest("t-2"), NOW)
    b.state.submitted(NAME, 1, 8, token_digest("t-1"), NOW)
    with pytest.raises(StaleJob):
        b.state.submitted(NAME, 1, 9, token_digest("t-1b"), NOW)
    assert b.state.job(NAME).job_id == 8
    assert b.state.identities.token_owner("t-1b") is None


@behaviour("State.name_run")
def name_run_fills_only_an_empty_run(b: Backend) -> None:
    b.state.add_job(a_job(run=""))
    assert b.state.name_run(NAME, "run-a", NOW).run == "run-a"
    assert b.state.name_run(NAME, "run-b", NOW + 1).run == "run-a"
    assert b.state.job(NAME).updated_at == NOW
    with pytest.raises(UnknownLogicalJob):
        b.state.name_run("nobody-1", "run-c", NOW)


@behaviour("State.move_status")
def move_status_is_a_compare_and_set_on_the_lifecycle(b: Backend) -> None:
    b.state.add_job(a_job())
    b.state.plan_move(NAME, 0, CLOUD, 50, NOW - 2)
    b.state.await_approval(NAME, EDGE, NOW - 1)
    done = b.state.move_status(NAME, JobStatus.RUNNING, JobStatus.COMPLETED, NOW)
    assert (done.status, done.move_to, done.move_after_step, done.awaiting_approval,
            done.updated_at) == (JobStatus.COMPLETED, None, None, None, NOW)
    with pytest.raises(StaleJob):
        b.state.move_status(NAME, JobStatus.RUNNING, JobStatus.CANCELLED, NOW + 1)
    with pytest.raises(IllegalTransition):
        b.state.move_status(NAME, JobStatus.COMPLETED, JobStatus.RUNNING, NOW + 1)
    with pytest.raises(UnknownLogicalJob):
        b.state.move_status("nobody-1", JobStatus.RUNNING, JobStatus.COMPLETED, NOW)
    assert b.state.job(NAME) == done


@behaviour("State.plan_move", "State.await_approval")
def a_move_waits_for_approval_then_is_planned_at_its_generation(b: Backend) -> None:
    b.state.add_job(a_job())
    b.state.await_approval(NAME, CLOUD, NOW)
    assert b.state.job(NAME).awaiting_approval == CLOUD
    planned = b.state.plan_move(NAME, 0, CLOUD, 500, NOW + 1)
    assert (planned.move_to, planned.move_after_step, planned.awaiting_approval,
            planned.updated_at) == (CLOUD, 500, None, NOW + 1)
    with pytest.raises(StaleJob):
        b.state.plan_move(NAME, 1, EDGE, None, NOW + 2)
    with pytest.raises(StaleJob):
        b.state.plan_move("nobody-1", 0, EDGE, None, NOW + 2)
    b.state.move_status(NAME, JobStatus.RUNNING, JobStatus.FAILED, NOW + 3)
    with pytest.raises(StaleJob):
        b.state.plan_move(NAME, 0, EDGE, None, NOW + 4)
    b.state.await_approval(NAME, None, NOW + 5)
    assert b.state.job(NAME).awaiting_approval is None


@behaviour("State.count_lost_restart", "State.reset_lost_restarts")
def lost_restarts_are_counted_and_reset_only_for_a_failed_job(b: Backend) -> None:
    b.state.add_job(a_job())
    b.state.count_lost_restart(NAME, NOW)
    b.state.count_lost_restart(NAME, NOW + 1)
    assert b.state.job(NAME).lost_restarts == 2
    with pytest.raises(StaleJob):
        b.state.reset_lost_restarts(NAME, NOW + 2)
    assert b.state.job(NAME).lost_restarts == 2
    b.state.move_status(NAME, JobStatus.RUNNING, JobStatus.FAILED, NOW + 3)
    b.state.reset_lost_restarts(NAME, NOW + 4)
    assert b.state.job(NAME).lost_restarts == 0


@behaviour("State.end_incarnation", "IdentityStore.token_owner", "IdentityStore.put_secret",
           "IdentityStore.secret")
def an_ended_incarnation_loses_its_token_and_keeps_its_secret(b: Backend) -> None:
    b.state.add_job(a_job())
    b.state.begin_generation(NAME, 0, CLOUD, None, NOW)
    b.state.identities.put_secret(NAME, 1, "secret-1")
    b.state.submitted(NAME, 1, 8, token_digest("t-1"), NOW)
    assert b.state.identities.token_owner("t-1") == TokenOwner(NAME, 1, None)
    b.state.end_incarnation(NAME, 1, IncarnationEnd.NODE_FAIL, NOW + 1)
    b.state.end_incarnation(NAME, 1, IncarnationEnd.ENDED, NOW + 2)
    assert b.state.incarnations(NAME)[1] == Incarnation(NAME, 1, CLOUD, 8, None, NOW, None,
                                                        NOW + 1, IncarnationEnd.NODE_FAIL)
    assert type(b.state.incarnations(NAME)[1].end_reason) is IncarnationEnd
    assert b.state.identities.token_owner("t-1") is None
    assert b.state.identities.secret(NAME, 1) == "secret-1"
    assert b.state.identities.secret(NAME, 2) is None


@behaviour("State.begin_generation", "IdentityStore.token_owner")
def a_new_generation_forgets_every_token_of_the_job(b: Backend) -> None:
    b.state.add_job(a_job())
    b.state.begin_generation(NAME, 0, CLOUD, None, NOW)
    b.state.submitted(NAME, 1, 8, token_digest("t-1"), NOW)
    b.state.begin_generation(NAME, 1, EDGE, None, NOW + 1)
    assert b.state.identities.token_owner("t-1") is None


@behaviour("IdentityStore.use_token")
def a_token_releases_the_key_once_per_restart(b: Backend) -> None:
    b.state.add_job(a_job())
    b.state.begin_generation(NAME, 0, CLOUD, None, NOW)
    b.state.submitted(NAME, 1, 8, token_digest("t-1"), NOW)
    assert b.state.identities.use_token("t-1", 0) is True
    assert b.state.identities.use_token("t-1", 0) is False
    assert b.state.identities.use_token("t-1", 1) is True
    assert b.state.identities.token_owner("t-1") == TokenOwner(NAME, 1, 1)
    assert b.state.identities.use_token("t-unknown", 0) is False


@behaviour("State.identities", "IdentityStore.claim_owner",
           "IdentityStore.learn_environment")
def an_owner_and_their_environment_are_learnt_once(b: Backend) -> None:
    b.state.add_job(a_job())
    b.state.identities.learn_environment(NAME, {"LANG": "C"})
    b.state.identities.learn_environment(NAME, {"LANG": "de_DE"})
    b.state.identities.claim_owner(NAME, ADA, {"LANG": "C.UTF-8"})
    b.state.identities.claim_owner(NAME, BOB, {"LANG": "fr_FR"})
    job = b.state.job(NAME)
    assert (job.owner, job.owner_env) == (ADA, {"LANG": "C.UTF-8"})
    assert isinstance(b.state.identities, (Identities, EtcdIdentities))


@behaviour("IdentityStore.run_owner", "IdentityStore.assign_run")
def a_run_given_to_an_owner_is_read_back_and_given_again(b: Backend) -> None:
    assert b.state.identities.run_owner("run-7") is None
    b.state.identities.assign_run(RunOwner("run-7", ADA, "root", NOW))
    assert b.state.identities.run_owner("run-7") == RunOwner("run-7", ADA, "root", NOW)
    b.state.identities.assign_run(RunOwner("run-7", BOB, "admin", NOW + 1))
    assert b.state.identities.run_owner("run-7") == RunOwner("run-7", BOB, "admin", NOW + 1)


@behaviour("State.lease", "State.put_lease", "State.release_lease", "State.refresh_leases")
def leases_are_kept_released_and_refreshed(b: Backend) -> None:
    b.state.add_job(a_job())
    b.state.add_job(a_job("onprem-8", job_id=8))
    assert b.state.lease(NAME) is None
    first = a_lease(renewed_at=NOW)
    b.state.put_lease(first, True)
    b.state.put_lease(replace(first, renewed_at=NOW + 10, last_step=200), True)
    assert b.state.lease(NAME) == replace(first, renewed_at=NOW + 10, last_step=200)
    assert b.state.incarnations(NAME)[0].training_at == NOW
    b.state.put_lease(a_lease(name="onprem-8", job_id=8, renewed_at=NOW), False)
    assert b.state.incarnations("onprem-8")[0].training_at is None
    b.state.release_lease(NAME)
    b.state.release_lease("nobody-1")
    b.state.refresh_leases(NOW + 100)
    assert b.state.lease(NAME) == replace(first, renewed_at=NOW + 10, last_step=200,
                                          released=True)
    assert b.state.lease("onprem-8") == a_lease(name="onprem-8", job_id=8,
                                                renewed_at=NOW + 100)
    assert b.state.lease("nobody-1") is None


@behaviour("State.health", "State.put_health")
def each_clusters_health_is_kept_the_last_one_written(b: Backend) -> None:
    assert b.state.health() == {}
    down = Health(CLOUD, ClusterStatus.OUT, 3, NOW - 60, NOW - 90, "timed out")
    b.state.put_health(Health(HOME, ClusterStatus.UP, 0, NOW - 600, NOW, None))
    b.state.put_health(down)
    b.state.put_health(Health(HOME, ClusterStatus.OUT, 1, NOW, NOW - 5, "refused"))
    assert b.state.health() == {
        HOME: Health(HOME, ClusterStatus.OUT, 1, NOW, NOW - 5, "refused"), CLOUD: down}


@behaviour("State.bandwidth_snapshot", "State.put_bandwidth_snapshot",
           "State.bandwidth_probe_at", "State.put_bandwidth_probe_at",
           "State.sync_transfer_id", "State.put_sync_transfer_id")
def the_daemons_own_records_start_empty_and_keep_the_last_written(b: Backend) -> None:
    assert (b.state.bandwidth_snapshot(), b.state.bandwidth_probe_at(),
            b.state.sync_transfer_id()) == ([], 0.0, 0)
    rows = [{"source": HOME, "target": CLOUD, "mb_s": 12.5, "samples": [1, 2]}]
    b.state.put_bandwidth_snapshot(rows)
    b.state.put_bandwidth_probe_at(NOW - 1.5)
    b.state.put_sync_transfer_id(41)
    b.state.put_sync_transfer_id(42)
    assert (b.state.bandwidth_snapshot(), b.state.bandwidth_probe_at(),
            b.state.sync_transfer_id()) == (rows, NOW - 1.5, 42)


@behaviour("State.confirm_leading")
def the_writer_leads(b: Backend) -> None:
    b.state.confirm_leading()


@behaviour("Audit.append", "Audit.head", "Audit.entries")
def the_audit_log_is_one_chain_read_back_in_order(b: Backend) -> None:
    assert b.audit.head() == (0, GENESIS)
    assert b.audit.entries() == []
    first = b.audit.append("submit", NAME, "registered", "a geo job", cluster=HOME)
    moved = b.audit.append("move", None, "moved", "home lost", to=CLOUD, bytes=[1, 2])
    other = b.audit.append("submit", "onprem-8", "registered", "a geo job")
    assert (first.seq, moved.seq, other.seq) == (1, 2, 3)
    assert (first.prev_hash, moved.prev_hash, other.prev_hash) == \
        (GENESIS, first.hash, moved.hash)
    assert moved.detail == {"to": CLOUD, "bytes": [1, 2]}
    assert b.audit.head() == (3, other.hash)
    assert b.audit.entries() == [first, moved, other]
    assert b.audit.entries(logical_job=NAME) == [first]
    assert b.audit.entries(kind="submit") == [first, other]
    assert b.audit.entries(since_seq=1) == [moved, other]
    assert b.audit.entries(logical_job="onprem-8", kind="move") == []


@behaviour("Audit.append", "Audit.head")
def an_entry_that_is_not_json_or_has_no_kind_is_refused_and_not_written(b: Backend) -> None:
    with pytest.raises(ValueError):
        b.audit.append("", NAME, "what", "why")
    with pytest.raises(ValueError):
        b.audit.append("move", NAME, "what", "why", mb_s=float("nan"))
    with pytest.raises(TypeError):
        b.audit.append("move", NAME, "what", "why", when=object())
    assert b.audit.head() == (0, GENESIS)


@behaviour("Audit.verify")
def verify_checks_the_chain_and_a_head_kept_elsewhere(b: Backend) -> None:
    assert b.audit.verify().ok and b.audit.verify().entries == 0
    b.audit.append("submit", NAME, "registered", "a geo job")
    kept = b.audit.append("move", NAME, "moved", "home lost")
    report = b.audit.verify(expected_head=b.audit.head())
    assert (report.ok, report.entries, report.head) == (True, 2, (2, kept.hash))
    cut = b.audit.verify(expected_head=(3, "f" * 64))
    assert not cut.ok and cut.problem


@pytest.mark.parametrize("row", BEHAVIOURS, ids=lambda row: row.name)
def test_the_interface_behaves_alike_on_each_backend(backend: Backend, row: Behaviour
                                                     ) -> None:
    row.check(backend)


# --- the table covers the interface, and each backend has all of it ---------------------------

PROTOCOLS: dict[str, tuple[type, tuple[type, ...]]] = {
    "State": (State, (FederationState, EtcdFederationState)),
    "IdentityStore": (IdentityStore, (Identities, EtcdIdentities)),
    "Audit": (Audit, (AuditLog, EtcdAuditLog)),
}


def members(protocol: type) -> dict[str, Any]:
    """The methods and properties `protocol` itself declares."""
    found = {}
    for name, value in vars(protocol).items():
        function = value.fget if isinstance(value, property) else value
        if inspect.isfunction(function) and \
                function.__qualname__.startswith(f"{protocol.__name__}."):
            found[name] = value
    return found


def test_the_table_exercises_every_member_of_the_interface() -> None:
    declared = {f"{name}.{member}" for name, (protocol, _) in PROTOCOLS.items()
                for member in members(protocol)}
    named = {member for row in BEHAVIOURS for member in row.members}
    assert named <= declared, "a row names what the interface does not declare"
    assert declared - named == set(BY_THE_FIXTURES)


def parameters(function: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default)
            for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize("name", PROTOCOLS)
def test_each_backend_has_every_member_with_the_interfaces_parameters(name: str) -> None:
    protocol, backends = PROTOCOLS[name]
    for cls in backends:
        for member, declared in members(protocol).items():
            if isinstance(declared, property):  # an attribute set in __init__
                continue
            assert parameters(getattr(cls, member)) == parameters(declared), \
                f"{cls.__name__}.{member}"


# --- one script, both backends: the same reads, the same audit hashes ------------------------

def script(b: Backend) -> dict[str, Any]:
    """A job's life through a move, a loss and a failback, as the daemon writes it; and
    everything the interface reads back afterwards."""
    s = b.state
    s.add_job(a_job(owner=ADA, owner_env={"LANG": "C"}))
    s.add_job(a_job("onprem-9", run="", job_id=9, created_at=NOW - 60))
    s.name_run("onprem-9", "run-9", NOW - 50)
    s.put_lease(a_lease(renewed_at=NOW - 40), True)
    s.put_health(Health(HOME, ClusterStatus.OUT, 3, NOW - 30, NOW - 35, "timed out"))
    s.begin_generation(NAME, 0, CLOUD, 100, NOW - 20, left_home=LeftHome.OUTAGE,
                       recovery=True)
    s.identities.put_secret(NAME, 1, "secret-1")
    s.submitted(NAME, 1, 70, token_digest("t-1"), NOW - 19)
    s.identities.use_token("t-1", 0)
    s.end_incarnation(NAME, 0, IncarnationEnd.FENCED, NOW - 18)
    s.put_lease(a_lease(1, cluster=CLOUD, job_id=70, renewed_at=NOW - 10), True)
    s.plan_move(NAME, 1, HOME, 150, NOW - 5)
    s.count_lost_restart("onprem-9", NOW - 4)
    s.move_status("onprem-9", JobStatus.RUNNING, JobStatus.CANCELLED, NOW - 3)
    s.release_lease(NAME)
    s.identities.assign_run(RunOwner("run-9", ADA, "root", NOW - 2))
    s.put_bandwidth_snapshot([{"source": HOME, "target": CLOUD, "mb_s": 50.0}])
    s.put_bandwidth_probe_at(NOW - 1)
    s.put_sync_transfer_id(7)
    for i, kind in enumerate(("submit", "outage", "move", "plan", "cancel")):
        b.audit.append(kind, NAME if i % 2 else "onprem-9", kind, "the script", step=i)
    return {
        "jobs": s.jobs(), "active": s.jobs(active_only=True),
        "incarnations": {j.logical_job: s.incarnations(j.logical_job) for j in s.jobs()},
        "by_run": s.find_by_run("run-9"), "by_id": s.find_by_job_id(70),
        "found": s.find_job(CLOUD, 70), "lease": s.lease(NAME), "health": s.health(),
        "bandwidth": (s.bandwidth_snapshot(), s.bandwidth_probe_at(), s.sync_transfer_id()),
        "token": s.identities.token_owner("t-1"), "secret": s.identities.secret(NAME, 1),
        "run_owner": s.identities.run_owner("run-9"),
        "audit": (b.audit.entries(), b.audit.head(), b.audit.verify()),
    }


def test_one_script_reads_back_the_same_on_both_backends(sqlite_backend: Backend,
                                                         etcd_backend: Backend) -> None:
    on_sqlite, on_etcd = script(sqlite_backend), script(etcd_backend)
    for what, read in on_sqlite.items():
        assert on_etcd[what] == read, what
    assert on_sqlite["audit"][2].ok and on_sqlite["audit"][1][0] == 5


# --- readers open the state without the daemon ----------------------------------------------

def test_the_opener_and_billings_reader_load_nothing_of_the_federation_above_its_state(
        ) -> None:
    """A reader (billing, a command) opens the state through federation.state.open: in a
    fresh interpreter, importing it loads only federation.model and federation.state."""
    code = ("import sys, slurm_geo.federation.state.open, slurm_geo.billing.records\n"
            "print(*sorted(m for m in sys.modules if m.startswith('slurm_geo.federation.')))")
    loaded = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                            text=True).stdout.split()
    above = [m for m in loaded if not m.startswith(("slurm_geo.federation.state",
                                                    "slurm_geo.federation.model"))]
    assert "slurm_geo.federation.state.open" in loaded and above == []
