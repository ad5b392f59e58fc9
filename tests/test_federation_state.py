"""The federation state against a real SQLite file and a real etcd: the lifecycle's
transitions table and the compare-and-set writes on both backends (the `state` fixture);
on SQLite, the schema (version 5, private file) and the migrations from versions 1 to 4.
What only etcd has (leadership, sealing, a member lost) is in test_federation_etcd.py."""

from __future__ import annotations

import itertools
import os
import sqlite3
import stat
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from slurm_geo.federation.model import (
    TRANSITIONS,
    ClusterStatus,
    FederationStateError,
    Health,
    IllegalTransition,
    JobStatus,
    Lease,
    LeftHome,
    LogicalJob,
    StaleJob,
    UnknownLogicalJob,
    token_digest,
)
from slurm_geo.federation.state.sqlite import SCHEMA_VERSION, FederationState
from slurm_geo.slurm.models import Owner
from tests.kit.builders import CLOUD, EDGE, HOME, NAME, NOW
from tests.kit.builders import logical_job as job
from tests.kit.state import (  # noqa: F401 - the fixtures path, sqlite_state and state
    State,
    dump,
    path_fixture,
    sqlite_state_fixture,
    state_fixture,
)

TTL_S = 30.0


def lease(generation: int = 0, *, renewed_at: float = NOW - 5, released: bool = False,
          cluster: str = HOME, job_id: int = 7) -> Lease:
    return Lease(NAME, generation, cluster, job_id, 0, renewed_at, 100, released)


def owner(state: State, token: str) -> tuple[str, int] | None:
    found = state.identities.token_owner(token)
    return None if found is None else (found.logical_job, found.generation)


def added(state: State, **overrides: Any) -> LogicalJob:
    j = job(**overrides)
    assert state.add_job(j)
    return j


# --- the lifecycle: every (from, to) pair ------------------------------------------------------

PAIRS = list(itertools.product(JobStatus, JobStatus))
ALLOWED = [(a, b) for a, b in PAIRS if b in TRANSITIONS[a]]
REFUSED = [(a, b) for a, b in PAIRS if b not in TRANSITIONS[a]]


def pair_id(pair: tuple[JobStatus, JobStatus]) -> str:
    return f"{pair[0].value}->{pair[1].value}"


def test_the_table_names_every_status_and_final_ones_lead_only_to_a_resubmission() -> None:
    assert set(TRANSITIONS) == set(JobStatus)
    assert len(ALLOWED) == 7 and len(PAIRS) == 25
    assert all(not TRANSITIONS[s] for s in (JobStatus.COMPLETED, JobStatus.CANCELLED))
    assert TRANSITIONS[JobStatus.FAILED] == {JobStatus.MOVING}
    assert all(a not in TRANSITIONS[a] for a in JobStatus)


@pytest.mark.parametrize("pair", ALLOWED, ids=pair_id)
def test_an_allowed_transition_is_written_and_clears_a_planned_move(
        state: State, pair: tuple[JobStatus, JobStatus]) -> None:
    current, wanted = pair
    added(state, status=current)
    if current in (JobStatus.RUNNING, JobStatus.MOVING):
        state.plan_move(NAME, 0, CLOUD, 100, NOW - 10)
    state.await_approval(NAME, EDGE, NOW - 10)
    moved = state.move_status(NAME, current, wanted, NOW)
    assert moved.status is wanted and state.job(NAME).status is wanted
    assert (moved.move_to, moved.move_after_step, moved.awaiting_approval) == (None, None, None)
    assert moved.updated_at == NOW
    assert (moved.generation, moved.cluster, moved.job_id) == (0, HOME, 7)


@pytest.mark.parametrize("pair", REFUSED, ids=pair_id)
def test_a_refused_transition_raises_and_writes_nothing(
        state: State, pair: tuple[JobStatus, JobStatus]) -> None:
    current, wanted = pair
    added(state, status=current)
    before = dump(state)
    with pytest.raises(IllegalTransition) as raised:
        state.move_status(NAME, current, wanted, NOW)
    assert (raised.value.current, raised.value.wanted) == (current, wanted)
    assert f"{current.value} -> {wanted.value}" in str(raised.value)
    assert dump(state) == before


@pytest.mark.parametrize(("pair", "actual"), [
    pytest.param(pair, actual, id=f"{pair_id(pair)} on a {actual.value} job")
    for pair in ALLOWED for actual in JobStatus if actual is not pair[0]])
def test_a_transition_from_a_status_the_job_is_not_in_is_stale(
        state: State, pair: tuple[JobStatus, JobStatus], actual: JobStatus) -> None:
    added(state, status=actual)
    before = dump(state)
    with pytest.raises(StaleJob, match=f"no longer {pair[0].value}"):
        state.move_status(NAME, pair[0], pair[1], NOW)
    assert dump(state) == before


def test_an_unknown_job_is_named(state: State) -> None:
    with pytest.raises(UnknownLogicalJob, match="nobody"):
        state.move_status("nobody", JobStatus.RUNNING, JobStatus.FAILED, NOW)
    with pytest.raises(UnknownLogicalJob, match="nobody"):
        state.job("nobody")


def test_of_two_writers_that_saw_the_same_generation_exactly_one_moves_it(
        path: Path) -> None:
    """Eight connections to one file race to begin generation 1: the compare-and-set lets
    one win; the others are told the job is stale."""
    first = FederationState(path)
    first.add_job(job())
    first.close()
    writers = [FederationState(path) for _ in range(8)]
    outcomes: list[str] = []
    start = threading.Barrier(len(writers))

    def race(writer: FederationState, cluster: str) -> None:
        start.wait()
        try:
            writer.begin_generation(NAME, 0, cluster, None, NOW)
            outcomes.append(cluster)
        except StaleJob:
            outcomes.append("stale")

    threads = [threading.Thread(target=race, args=(w, f"c{i}")) for i, w in enumerate(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for w in writers:
        w.close()
    winners = [o for o in outcomes if o != "stale"]
    assert len(winners) == 1 and outcomes.count("stale") == 7
    state = FederationState(path)
    try:
        assert (state.job(NAME).generation, state.job(NAME).cluster) == (1, winners[0])
        assert [i.generation for i in state.incarnations(NAME)] == [0, 1]
    finally:
        state.close()


def test_a_cancel_after_the_daemon_moved_the_job_on_is_stale(state: State) -> None:
    """Two writers saw RUNNING; the daemon's move wins, the person's cancel is refused."""
    added(state)
    state.move_status(NAME, JobStatus.RUNNING, JobStatus.MOVING, NOW)
    with pytest.raises(StaleJob):
        state.move_status(NAME, JobStatus.RUNNING, JobStatus.CANCELLED, NOW + 1)
    assert state.job(NAME).status is JobStatus.MOVING


# --- begin_generation ------------------------------------------------------------------------

def test_begin_generation_makes_the_next_generation_current_and_moving(
        state: State) -> None:
    added(state)
    state.plan_move(NAME, 0, CLOUD, 100, NOW - 20)
    state.await_approval(NAME, CLOUD, NOW - 10)
    moved = state.begin_generation(NAME, 0, CLOUD, 100, NOW, left_home=LeftHome.OUTAGE)
    assert (moved.generation, moved.cluster, moved.job_id, moved.resume_step,
            moved.status) == (1, CLOUD, None, 100, JobStatus.MOVING)
    assert (moved.move_to, moved.move_after_step, moved.awaiting_approval) == (None, None, None)
    assert (moved.left_home, moved.recoveries, moved.updated_at) == (LeftHome.OUTAGE, 0, NOW)
    assert [(i.generation, i.cluster, i.job_id, i.resume_step, i.submitted_at, i.training_at,
             i.ended_at) for i in state.incarnations(NAME)] == [
        (0, HOME, 7, None, NOW - 3600, None, None), (1, CLOUD, None, 100, NOW, None, None)]


def test_begin_generation_deletes_every_token_of_the_job(state: State) -> None:
    added(state)
    state.begin_generation(NAME, 0, CLOUD, 100, NOW)
    state.submitted(NAME, 1, 70, token_digest("secret-1"), NOW)
    assert owner(state, "secret-1") == (NAME, 1)
    state.begin_generation(NAME, 1, HOME, 200, NOW + 1)
    assert owner(state, "secret-1") is None


@pytest.mark.parametrize(("previous", "to", "given", "after"), [
    pytest.param(None, CLOUD, LeftHome.OUTAGE, LeftHome.OUTAGE, id="away for an outage"),
    pytest.param(None, CLOUD, LeftHome.QUEUE, LeftHome.QUEUE, id="away for a queue"),
    pytest.param(None, CLOUD, None, None, id="away for no reason given"),
    pytest.param(LeftHome.QUEUE, EDGE, None, LeftHome.QUEUE,
                 id="on to another cluster keeps why it left home"),
    pytest.param(LeftHome.QUEUE, EDGE, LeftHome.OUTAGE, LeftHome.OUTAGE,
                 id="on to another cluster for an outage says so"),
    pytest.param(LeftHome.OUTAGE, HOME, None, None, id="home again clears it"),
    pytest.param(LeftHome.OUTAGE, HOME, LeftHome.OUTAGE, None,
                 id="home again clears it even when a reason is given"),
])
def test_begin_generation_records_why_the_job_is_away_from_home(
        state: State, previous: LeftHome | None, to: str, given: LeftHome | None,
        after: LeftHome | None) -> None:
    added(state)
    if previous is not None:
        state.begin_generation(NAME, 0, CLOUD, None, NOW - 10, left_home=previous)
        state.submitted(NAME, 1, 70, token_digest("t"), NOW - 9)
    generation = state.job(NAME).generation
    moved = state.begin_generation(NAME, generation, to, None, NOW, left_home=given)
    assert moved.left_home is after


def test_begin_generation_counts_recoveries_only_when_told(state: State) -> None:
    added(state)
    first = state.begin_generation(NAME, 0, CLOUD, None, NOW, recovery=True)
    state.submitted(NAME, 1, 70, token_digest("a"), NOW)
    second = state.begin_generation(NAME, 1, EDGE, None, NOW, recovery=False)
    state.submitted(NAME, 2, 71, token_digest("b"), NOW)
    third = state.begin_generation(NAME, 2, HOME, None, NOW, recovery=True)
    assert (first.recoveries, second.recoveries, third.recoveries) == (1, 1, 2)
    assert third.lost_restarts == 0


def test_begin_generation_at_a_generation_that_is_gone_is_stale(
        state: State) -> None:
    added(state)
    before = dump(state)
    with pytest.raises(StaleJob, match="no longer at generation 3"):
        state.begin_generation(NAME, 3, CLOUD, None, NOW)
    assert dump(state) == before


@pytest.mark.parametrize("held", [
    pytest.param(lease(renewed_at=NOW - 5), id="renewed 5 s ago"),
    pytest.param(lease(renewed_at=NOW - TTL_S), id="renewed exactly one TTL ago"),
])
def test_begin_generation_under_a_live_lease_is_stale_and_writes_nothing(
        state: State, held: Lease) -> None:
    added(state)
    state.put_lease(held, True)
    before = dump(state)
    with pytest.raises(StaleJob, match="without a live lease"):
        state.begin_generation(NAME, 0, CLOUD, 100, NOW, live_lease_ttl_s=TTL_S)
    assert dump(state) == before


@pytest.mark.parametrize("held", [
    pytest.param(None, id="no lease"),
    pytest.param(lease(renewed_at=NOW - TTL_S - 1), id="a lease run out"),
    pytest.param(lease(renewed_at=NOW - 1, released=True), id="a released lease"),
])
def test_begin_generation_without_a_live_lease_goes_ahead(
        state: State, held: Lease | None) -> None:
    added(state)
    if held is not None:
        state.put_lease(held, True)
    moved = state.begin_generation(NAME, 0, CLOUD, 100, NOW, live_lease_ttl_s=TTL_S)
    assert (moved.generation, moved.status) == (1, JobStatus.MOVING)


def test_a_live_lease_of_an_older_generation_does_not_stop_a_move(
        state: State) -> None:
    added(state)
    state.begin_generation(NAME, 0, CLOUD, None, NOW - 10)
    state.submitted(NAME, 1, 70, token_digest("t"), NOW - 9)
    state.put_lease(lease(0, renewed_at=NOW - 1), True)  # generation 0's, still renewed
    moved = state.begin_generation(NAME, 1, HOME, None, NOW, live_lease_ttl_s=TTL_S)
    assert moved.generation == 2


def test_without_a_ttl_a_live_lease_is_the_callers_business(state: State) -> None:
    added(state)
    state.put_lease(lease(renewed_at=NOW - 1), True)
    assert state.begin_generation(NAME, 0, CLOUD, None, NOW).generation == 1


def test_begin_generation_resubmits_a_failed_job(state: State) -> None:
    added(state, status=JobStatus.FAILED)
    assert state.begin_generation(NAME, 0, HOME, 100, NOW).status is JobStatus.MOVING


@pytest.mark.parametrize("status", [JobStatus.MOVING, JobStatus.COMPLETED,
                                    JobStatus.CANCELLED], ids=lambda s: s.value)
def test_begin_generation_from_a_status_that_cannot_move_writes_nothing(
        state: State, status: JobStatus) -> None:
    added(state, status=status)
    before = dump(state)
    with pytest.raises(IllegalTransition):
        state.begin_generation(NAME, 0, CLOUD, None, NOW)
    assert dump(state) == before


def test_begin_generation_of_an_unknown_job(state: State) -> None:
    with pytest.raises(UnknownLogicalJob):
        state.begin_generation("nobody", 0, CLOUD, None, NOW)


# --- submitted, plan_move, add_job, name_run ---------------------------------------------------

def test_submitted_records_the_slurm_job_and_its_token(state: State) -> None:
    added(state)
    state.begin_generation(NAME, 0, CLOUD, 100, NOW - 5)
    running = state.submitted(NAME, 1, 70, token_digest("secret"), NOW)
    assert (running.status, running.job_id, running.updated_at) == (JobStatus.RUNNING, 70, NOW)
    assert state.incarnations(NAME)[-1].job_id == 70
    assert owner(state, "secret") == (NAME, 1)
    assert state.find_job(CLOUD, 70) == running


def test_submitted_after_a_cancel_is_stale_and_writes_nothing(state: State) -> None:
    added(state)
    state.begin_generation(NAME, 0, CLOUD, 100, NOW - 5)
    state.move_status(NAME, JobStatus.MOVING, JobStatus.CANCELLED, NOW - 1)
    before = dump(state)
    with pytest.raises(StaleJob, match="moving at generation 1"):
        state.submitted(NAME, 1, 70, token_digest("secret"), NOW)
    assert dump(state) == before
    assert owner(state, "secret") is None


@pytest.mark.parametrize("generation", [0, 2], ids=["an older generation", "a later one"])
def test_submitted_for_another_generation_is_stale(state: State,
                                                   generation: int) -> None:
    added(state)
    state.begin_generation(NAME, 0, CLOUD, 100, NOW - 5)
    with pytest.raises(StaleJob):
        state.submitted(NAME, generation, 70, token_digest("secret"), NOW)
    assert state.job(NAME).status is JobStatus.MOVING


def test_submitted_twice_is_stale(state: State) -> None:
    added(state)
    state.begin_generation(NAME, 0, CLOUD, 100, NOW - 5)
    state.submitted(NAME, 1, 70, token_digest("first"), NOW - 1)
    with pytest.raises(StaleJob):
        state.submitted(NAME, 1, 71, token_digest("second"), NOW)
    assert state.job(NAME).job_id == 70 and owner(state, "second") is None


@pytest.mark.parametrize("status", [JobStatus.RUNNING, JobStatus.MOVING],
                         ids=lambda s: s.value)
def test_plan_move_at_the_current_generation(state: State,
                                             status: JobStatus) -> None:
    added(state, status=status)
    state.await_approval(NAME, CLOUD, NOW - 1)
    planned = state.plan_move(NAME, 0, CLOUD, 300, NOW)
    assert (planned.move_to, planned.move_after_step, planned.awaiting_approval,
            planned.updated_at) == (CLOUD, 300, None, NOW)


def test_plan_move_at_an_older_generation_is_stale(state: State) -> None:
    added(state)
    state.begin_generation(NAME, 0, CLOUD, None, NOW - 5)
    before = dump(state)
    with pytest.raises(StaleJob, match="active at generation 0"):
        state.plan_move(NAME, 0, HOME, 100, NOW)
    assert dump(state) == before


@pytest.mark.parametrize("status", [JobStatus.COMPLETED, JobStatus.FAILED,
                                    JobStatus.CANCELLED], ids=lambda s: s.value)
def test_plan_move_of_a_final_job_is_stale(state: State, status: JobStatus) -> None:
    added(state, status=status)
    before = dump(state)
    with pytest.raises(StaleJob):
        state.plan_move(NAME, 0, CLOUD, 100, NOW)
    assert dump(state) == before


def test_plan_move_of_an_unknown_job_writes_nothing(state: State) -> None:
    with pytest.raises(FederationStateError):
        state.plan_move("nobody", 0, CLOUD, None, NOW)
    assert state.jobs() == []


def test_add_job_registers_once(state: State) -> None:
    first = job()
    assert state.add_job(first) is True
    assert state.add_job(replace(first, run="another", cluster=CLOUD)) is False
    stored = state.job(NAME)
    assert stored == first
    assert [(i.generation, i.cluster, i.job_id) for i in state.incarnations(NAME)] == [
        (0, HOME, 7)]
    assert state.find_job(HOME, 7) == first and state.find_job(HOME, 8) is None


def test_the_owner_and_their_environment_are_stored_with_the_job(path: Path) -> None:
    owned = job(owner=Owner("alice", 2001, 2100),
                owner_env={"PATH": "/home/alice/bin", "PS1": "'$(x)' \"y\"\n"})
    writer = FederationState(path)
    try:
        writer.add_job(owned)
        assert writer.job(NAME) == owned
        assert writer.find_job(HOME, 7) == owned
    finally:
        writer.close()
    reader = FederationState(path, readonly=True)
    try:
        assert reader.job(NAME).owner == Owner("alice", 2001, 2100)
    finally:
        reader.close()


def test_the_script_and_json_columns_survive_hostile_text(state: State) -> None:
    hostile = job(script="#!/bin/bash\n'; echo foo\n\"$(rm -rf /)\"\n",
                  spec={"name": "a b\n'c'"}, directives={"--geo-clusters": "x,y"})
    state.add_job(hostile)
    assert state.job(NAME) == hostile


def test_name_run_fills_only_an_empty_run(state: State) -> None:
    added(state, run="")
    named = state.name_run(NAME, "run-a", NOW)
    assert (named.run, named.updated_at) == ("run-a", NOW)
    again = state.name_run(NAME, "run-b", NOW + 1)
    assert (again.run, again.updated_at) == ("run-a", NOW)
    assert [j.logical_job for j in state.find_by_run("run-a")] == [NAME]


def test_name_run_never_renames_a_named_run(state: State) -> None:
    added(state)
    assert state.name_run(NAME, "forged", NOW).run == "run-7"


def test_the_daemon_row_holds_its_watermarks(state: State) -> None:
    assert (state.bandwidth_probe_at(), state.sync_transfer_id()) == (0.0, 0)
    state.put_bandwidth_probe_at(99.25)
    state.put_sync_transfer_id(7)
    assert (state.bandwidth_probe_at(), state.sync_transfer_id()) == (99.25, 7)


# --- the schema --------------------------------------------------------------------------------

def user_version(path: Path) -> int:
    db = sqlite3.connect(path)
    try:
        return int(db.execute("PRAGMA user_version").fetchone()[0])
    finally:
        db.close()


def tables(path: Path) -> set[str]:
    db = sqlite3.connect(path)
    try:
        return {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    finally:
        db.close()


def test_a_fresh_database_is_schema_version_5_in_wal_mode(sqlite_state: FederationState,
                                                           path: Path) -> None:
    assert SCHEMA_VERSION == 5
    assert user_version(path) == 5
    assert sqlite_state.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert tables(path) == {"jobs", "incarnations", "leases", "tokens", "health",
                            "bandwidth", "daemon", "incarnation_secrets", "run_owners"}


def test_the_file_and_its_directory_are_private_whatever_the_umask(tmp_path: Path) -> None:
    path = tmp_path / "fresh" / "state.db"
    old = os.umask(0)
    try:
        state = FederationState(path)
        state.add_job(job())  # the WAL and its index exist while it is open
        modes = {p.name: stat.S_IMODE(p.stat().st_mode)
                 for p in path.parent.iterdir()}
        state.close()
    finally:
        os.umask(old)
    assert set(modes) == {"state.db", "state.db-wal", "state.db-shm"}
    assert all(mode == 0o600 for mode in modes.values()), modes
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


def test_an_existing_file_open_to_all_is_made_private(path: Path) -> None:
    path.parent.mkdir(parents=True)
    path.touch()
    path.chmod(0o666)
    FederationState(path).close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_reopening_keeps_everything(path: Path) -> None:
    first = FederationState(path)
    first.add_job(job())
    first.put_lease(lease(), True)
    first.put_health(Health(HOME, ClusterStatus.UP, 0, NOW - 60, NOW - 1, None))
    first.put_bandwidth_snapshot([{"source": "pfs", "mbps": 200}])
    first.close()
    again = FederationState(path)
    try:
        assert again.job(NAME) == job()
        assert again.lease(NAME) == lease()
        assert again.health()[HOME].status is ClusterStatus.UP
        assert again.bandwidth_snapshot() == [{"source": "pfs", "mbps": 200}]
        assert user_version(path) == 5
    finally:
        again.close()


def test_a_newer_schema_is_refused(path: Path) -> None:
    FederationState(path).close()
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version = 6")
    db.close()
    with pytest.raises(FederationStateError, match="newer than this slurm-geo"):
        FederationState(path)
    with pytest.raises(FederationStateError, match="schema version 6"):
        FederationState(path, readonly=True)
    assert user_version(path) == 6


# --- migration from version 1 ------------------------------------------------------------------

# Version 1's schema, verbatim from `git show 13825e1:slurm_geo/federation/state.py` (the
# last version-1 commit of that file): per-job facts and daemon watermarks in `meta`.
V1_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    logical_job TEXT PRIMARY KEY,
    run TEXT NOT NULL,
    home TEXT NOT NULL,
    script TEXT NOT NULL,
    spec TEXT NOT NULL,            -- JSON: what a resubmission needs besides the script
    directives TEXT NOT NULL,      -- JSON: the --geo-* options
    generation INTEGER NOT NULL,
    cluster TEXT NOT NULL,         -- where the current generation runs
    job_id INTEGER,                -- its Slurm job id there; NULL while moving
    resume_step INTEGER,
    status TEXT NOT NULL,
    move_to TEXT,                  -- a planned move waiting for the next checkpoint
    move_after_step INTEGER,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS incarnations (
    logical_job TEXT NOT NULL,
    generation INTEGER NOT NULL,
    cluster TEXT NOT NULL,
    job_id INTEGER,
    resume_step INTEGER,
    submitted_at REAL NOT NULL,
    training_at REAL,              -- first lease granted: training started
    ended_at REAL,
    end_reason TEXT,
    PRIMARY KEY (logical_job, generation)
);
CREATE TABLE IF NOT EXISTS leases (
    logical_job TEXT PRIMARY KEY,
    generation INTEGER NOT NULL,
    cluster TEXT NOT NULL,
    job_id INTEGER NOT NULL,
    restart INTEGER NOT NULL,
    renewed_at REAL NOT NULL,
    last_step INTEGER,
    released INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS tokens (
    token_sha256 TEXT PRIMARY KEY,
    logical_job TEXT NOT NULL,
    generation INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS health (
    cluster TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    failures INTEGER NOT NULL,
    since REAL NOT NULL,
    last_ok REAL,
    last_error TEXT
);
CREATE TABLE IF NOT EXISTS bandwidth (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    snapshot TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""

V1_JOB = (NAME, "run-7", HOME, "#!/bin/bash\n", '{"nodes": 2}', '{"--geo-failover": "auto"}',
          1, CLOUD, 70, 100, "running", HOME, 100, NOW - 3600, NOW - 60)
V1_QUIET_JOB = ("onprem-8", "run-8", HOME, "#!/bin/bash\n", "{}", "{}", 0, HOME, 8, None,
                "completed", None, None, NOW - 7200, NOW - 7000)
V1_META = [(f"left_home:{NAME}", "queue"), (f"lost_restarts:{NAME}", "2"),
           ("bandwidth_probe_at", "123.5"), ("sync_transfer_id", "42"),
           ("left_home:onprem-8", "bogus"), ("left_home:onprem-9", "outage")]
# Version 1 never cleared left_home when a job came home: onprem-9 is home again.
V1_HOME_AGAIN = ("onprem-9", "run-9", HOME, "#!/bin/bash\n", "{}", "{}", 2, HOME, 9, 50,
                 "running", None, None, NOW - 7200, NOW - 60)


def make_v1(path: Path, user_version: int = 0) -> None:
    """A database as version 1 left it (it never set user_version: 0), by hand."""
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.executescript(V1_SCHEMA)
    db.execute("INSERT INTO jobs VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", V1_JOB)
    db.execute("INSERT INTO jobs VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", V1_QUIET_JOB)
    db.execute("INSERT INTO jobs VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", V1_HOME_AGAIN)
    db.execute("INSERT INTO incarnations VALUES (?,?,?,?,?,?,?,?,?)",
               (NAME, 1, CLOUD, 70, 100, NOW - 600, NOW - 590, None, None))
    db.execute("INSERT INTO leases VALUES (?,?,?,?,?,?,?,?)",
               (NAME, 1, CLOUD, 70, 0, NOW - 5, 150, 0))
    db.execute("INSERT INTO tokens VALUES (?,?,?)", (token_digest("v1-token"), NAME, 1))
    db.executemany("INSERT INTO meta VALUES (?, ?)", V1_META)
    if user_version:
        db.execute(f"PRAGMA user_version = {user_version}")
    db.close()


@pytest.mark.parametrize("version", [0, 1], ids=["user_version 0, as version 1 left it",
                                                 "user_version 1"])
def test_a_version_1_database_is_migrated_on_open(path: Path, version: int) -> None:
    make_v1(path, version)
    state = FederationState(path)
    try:
        migrated = state.job(NAME)
        assert (migrated.left_home, migrated.lost_restarts, migrated.recoveries,
                migrated.awaiting_approval) == (LeftHome.QUEUE, 2, 0, None)
        assert (migrated.generation, migrated.cluster, migrated.job_id, migrated.resume_step,
                migrated.status, migrated.move_to, migrated.move_after_step,
                migrated.spec) == (1, CLOUD, 70, 100, JobStatus.RUNNING, HOME, 100,
                                   {"nodes": 2})
        quiet = state.job("onprem-8")
        assert (quiet.left_home, quiet.lost_restarts, quiet.status) == (
            None, 0, JobStatus.COMPLETED)
        assert state.job("onprem-9").left_home is None  # home again: nothing stale kept
        assert (state.bandwidth_probe_at(), state.sync_transfer_id()) == (123.5, 42)
        assert state.lease(NAME) == Lease(NAME, 1, CLOUD, 70, 0, NOW - 5, 150, False)
        assert owner(state, "v1-token") == (NAME, 1)
        assert [i.training_at for i in state.incarnations(NAME)] == [NOW - 590]
        assert "meta" not in tables(path)
        assert "daemon" in tables(path)
        assert (migrated.owner, migrated.owner_env) == (None, {})  # never recorded
        assert user_version(path) == 5
    finally:
        state.close()


def test_a_migrated_database_opens_again_unchanged_and_takes_writes(path: Path) -> None:
    make_v1(path)
    FederationState(path).close()
    state = FederationState(path)
    try:
        assert state.job(NAME).lost_restarts == 2
        state.count_lost_restart(NAME, NOW)
        moved = state.begin_generation(NAME, 1, EDGE, 150, NOW, live_lease_ttl_s=None)
        assert (moved.generation, moved.left_home, moved.lost_restarts) == (
            2, LeftHome.QUEUE, 3)
    finally:
        state.close()


# --- readonly ----------------------------------------------------------------------------------

def test_readonly_open_of_a_missing_file_names_it_and_creates_nothing(path: Path) -> None:
    with pytest.raises(FederationStateError) as raised:
        FederationState(path, readonly=True)
    assert str(path) in str(raised.value)
    assert "[federation] state" in str(raised.value)
    assert not path.parent.exists()


def test_readonly_reads_what_the_daemon_wrote(path: Path) -> None:
    writer = FederationState(path)
    writer.add_job(job())
    writer.put_lease(lease(), True)
    writer.put_sync_transfer_id(9)
    writer.close()
    reader = FederationState(path, readonly=True)
    try:
        assert reader.job(NAME) == job()
        assert [j.logical_job for j in reader.jobs(active_only=True)] == [NAME]
        assert reader.lease(NAME) == lease()
        assert reader.sync_transfer_id() == 9
        assert reader.health() == {}
    finally:
        reader.close()


def test_readonly_reads_beside_a_daemon_that_keeps_writing(path: Path) -> None:
    writer = FederationState(path)
    try:
        writer.add_job(job())
        reader = FederationState(path, readonly=True)
        try:
            writer.move_status(NAME, JobStatus.RUNNING, JobStatus.COMPLETED, NOW)
            assert reader.job(NAME).status is JobStatus.COMPLETED
            assert reader.jobs(active_only=True) == []
        finally:
            reader.close()
    finally:
        writer.close()


@pytest.mark.parametrize("version", [0, 1], ids=["user_version 0", "user_version 1"])
def test_readonly_open_of_a_version_1_file_says_to_start_the_daemon(path: Path,
                                                                    version: int) -> None:
    make_v1(path, version)
    with pytest.raises(FederationStateError, match="start the federation daemon") as raised:
        FederationState(path, readonly=True)
    assert str(path) in str(raised.value)
    assert f"schema version {version}" in str(raised.value)
    assert user_version(path) == version and "meta" in tables(path)  # nothing migrated


# --- migration from version 2 ------------------------------------------------------------------

# Version 2's schema, verbatim from the last version-2 commit of slurm_geo/federation/state.py
# (f460e68): no owners, no incarnation secrets, tokens reusable.
V2_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    logical_job TEXT PRIMARY KEY,
    run TEXT NOT NULL,
    home TEXT NOT NULL,
    script TEXT NOT NULL,
    spec TEXT NOT NULL,            -- JSON: what a resubmission needs besides the script
    directives TEXT NOT NULL,      -- JSON: the --geo-* options
    generation INTEGER NOT NULL,
    cluster TEXT NOT NULL,         -- where the current generation runs
    job_id INTEGER,                -- its Slurm job id there; NULL while moving
    resume_step INTEGER,
    status TEXT NOT NULL,
    move_to TEXT,                  -- a planned move waiting for the next checkpoint
    move_after_step INTEGER,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    left_home TEXT,                -- outage | queue: why it runs away from home
    lost_restarts INTEGER NOT NULL DEFAULT 0,
    recoveries INTEGER NOT NULL DEFAULT 0,
    awaiting_approval TEXT         -- the target of a move waiting for `slurm-geo approve`
);
CREATE TABLE IF NOT EXISTS incarnations (
    logical_job TEXT NOT NULL,
    generation INTEGER NOT NULL,
    cluster TEXT NOT NULL,
    job_id INTEGER,
    resume_step INTEGER,
    submitted_at REAL NOT NULL,
    training_at REAL,              -- first lease granted: training started
    ended_at REAL,
    end_reason TEXT,
    PRIMARY KEY (logical_job, generation)
);
CREATE TABLE IF NOT EXISTS leases (
    logical_job TEXT PRIMARY KEY,
    generation INTEGER NOT NULL,
    cluster TEXT NOT NULL,
    job_id INTEGER NOT NULL,
    restart INTEGER NOT NULL,
    renewed_at REAL NOT NULL,
    last_step INTEGER,
    released INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS tokens (
    token_sha256 TEXT PRIMARY KEY,
    logical_job TEXT NOT NULL,
    generation INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS health (
    cluster TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    failures INTEGER NOT NULL,
    since REAL NOT NULL,
    last_ok REAL,
    last_error TEXT
);
CREATE TABLE IF NOT EXISTS bandwidth (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    snapshot TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS daemon (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    bandwidth_probe_at REAL NOT NULL DEFAULT 0,   -- the last probe transfer between stores
    sync_transfer_id INTEGER NOT NULL DEFAULT 0   -- checkpoint-sync transfers learnt from
);
INSERT OR IGNORE INTO daemon (id) VALUES (1);
"""


def make_v2(path: Path) -> None:
    """A database as version 2 left it: one job away (generation 1) with its key token."""
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path, isolation_level=None)
    db.executescript(V2_SCHEMA)
    db.execute("INSERT INTO jobs VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
               (*V1_JOB, "outage", 1, 2, None))
    db.execute("INSERT INTO incarnations VALUES (?,?,?,?,?,?,?,?,?)",
               (NAME, 1, CLOUD, 70, 100, NOW - 600, NOW - 590, None, None))
    db.execute("INSERT INTO tokens VALUES (?,?,?)", (token_digest("v2-token"), NAME, 1))
    db.execute("PRAGMA user_version = 2")
    db.close()


# What version 3 added to version 2, verbatim from its _V3_OWNER_COLUMNS (7afbfae).
V3_OWNER_COLUMNS = ("owner_user TEXT", "owner_uid INTEGER", "owner_gid INTEGER",
                    "owner_env TEXT NOT NULL DEFAULT '{}'")


def make_v3(path: Path) -> None:
    """A database as version 3 left it: version 2's job, owned by alice, her environment."""
    make_v2(path)
    db = sqlite3.connect(path, isolation_level=None)
    for column in V3_OWNER_COLUMNS:
        db.execute(f"ALTER TABLE jobs ADD COLUMN {column}")
    db.execute("UPDATE jobs SET owner_user = 'alice', owner_uid = 2001, owner_gid = 2100, "
               "owner_env = ? WHERE logical_job = ?", ('{"LANG": "C.UTF-8"}', NAME))
    db.execute("PRAGMA user_version = 3")
    db.close()


def test_a_version_2_database_gains_owners_secrets_and_token_use_its_jobs_owned_by_none(
        path: Path) -> None:
    make_v2(path)
    state = FederationState(path)
    try:
        old = state.job(NAME)
        assert (old.run, old.generation) == ("run-7", 1)
        assert (old.left_home, old.lost_restarts, old.recoveries) == (LeftHome.OUTAGE, 1, 2)
        assert (old.owner, old.owner_env) == (None, {})
        found = state.identities.token_owner("v2-token")
        assert found is not None and found.used_restart is None
        assert state.identities.secret(NAME, 1) is None  # submitted before secrets
        assert "incarnation_secrets" in tables(path) and user_version(path) == 5
        state.add_job(job(logical_job="onprem-11", job_id=11, owner=Owner("bob", 2002, 2002)))
        assert state.job("onprem-11").owner == Owner("bob", 2002, 2002)
    finally:
        state.close()
    FederationState(path).close()  # opens again as it is
    assert user_version(path) == 5


def test_a_job_of_version_2_claims_the_owner_slurm_names_once(path: Path) -> None:
    make_v2(path)
    state = FederationState(path)
    try:
        state.identities.claim_owner(NAME, Owner("alice", 2001, 2100), {"LANG": "C.UTF-8"})
        state.identities.claim_owner(NAME, Owner("bob", 2002, 2002), {})  # a recorded owner stays
        claimed = state.job(NAME)
        assert (claimed.owner, claimed.owner_env) == (Owner("alice", 2001, 2100),
                                                      {"LANG": "C.UTF-8"})
    finally:
        state.close()


def test_a_version_3_database_keeps_its_owners_and_gains_secrets_and_token_use(
        path: Path) -> None:
    make_v3(path)
    state = FederationState(path)
    try:
        owned = state.job(NAME)
        assert (owned.owner, owned.owner_env) == (Owner("alice", 2001, 2100),
                                                  {"LANG": "C.UTF-8"})
        assert user_version(path) == 5 and "incarnation_secrets" in tables(path)
        assert state.identities.secret(NAME, 1) is None
        assert state.identities.use_token("v2-token", 0)  # unused until now: once
        assert not state.identities.use_token("v2-token", 0)
    finally:
        state.close()


def test_a_version_4_database_gains_run_owners_and_keeps_its_jobs(path: Path) -> None:
    """Version 5: the runs an admin gave to an owner (federation.runowners)."""
    from slurm_geo.federation.model import RunOwner

    state = FederationState(path)
    state.add_job(job())
    state.close()
    db = sqlite3.connect(path)
    db.execute("DROP TABLE run_owners")
    db.execute("PRAGMA user_version = 4")
    db.commit()
    db.close()
    with pytest.raises(FederationStateError, match="schema version 4"):
        FederationState(path, readonly=True)  # a command waits for the daemon's migration
    state = FederationState(path)
    try:
        assert user_version(path) == 5 and "run_owners" in tables(path)
        assert state.job(NAME) == job() and state.identities.run_owner("r") is None
        state.identities.assign_run(RunOwner("r", Owner("bob", 2002, 2002), "root", NOW))
        assert state.identities.run_owner("r") is not None
    finally:
        state.close()


def test_a_token_releases_the_key_once_per_restart_of_its_incarnation(
        state: State) -> None:
    added(state)
    state.begin_generation(NAME, 0, CLOUD, 100, NOW)
    state.submitted(NAME, 1, 70, token_digest("tok"), NOW)
    assert state.identities.use_token("tok", 0)
    assert not state.identities.use_token("tok", 0)  # the second use
    assert state.identities.use_token("tok", 1)       # requeued: the next restart, once
    assert not state.identities.use_token("tok", 0)
    assert not state.identities.use_token("guess", 5)


def test_an_ended_incarnation_loses_its_token_and_keeps_its_secret(
        state: State) -> None:
    added(state, owner=Owner("alice", 2001, 2100))
    assert state.job(NAME).owner == Owner("alice", 2001, 2100)
    state.begin_generation(NAME, 0, CLOUD, 100, NOW)
    state.identities.put_secret(NAME, 1, "ab" * 32)
    state.submitted(NAME, 1, 70, token_digest("tok"), NOW)
    assert state.identities.secret(NAME, 1) == "ab" * 32
    state.end_incarnation(NAME, 1, "cancelled", NOW + 1)
    assert owner(state, "tok") is None
    assert state.identities.secret(NAME, 1) == "ab" * 32  # so it is told it is fenced
