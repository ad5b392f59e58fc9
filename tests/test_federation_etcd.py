"""The federation state replicated on etcd, against real etcd members: one leader, whose
deposed self etcd refuses; followers that read everything and write nothing; values no
etcd member can read; a three-member cluster that loses one. The state's interface
itself runs on both backends in test_federation_state.py."""

from __future__ import annotations

import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import etcd3gw
import pytest

from slurm_geo.ckpt.format.keys import KeyFile
from slurm_geo.federation.model import (
    ClusterStatus,
    FederationStateError,
    Health,
    JobStatus,
    Lease,
    NotLeader,
    StaleJob,
    token_digest,
)
from slurm_geo.federation.state.etcd.kv import EtcdKV
from slurm_geo.federation.state.etcd.layout import Layout
from slurm_geo.federation.state.etcd.leadership import Standing, Step, next_step
from slurm_geo.federation.state.etcd.state import EtcdFederationState
from slurm_geo.slurm.models import Owner
from tests.etcd_server import (
    MASTER_KEY,
    EtcdMember,
    data_bytes,
    fresh_prefix,
    open_replica,
)
from tests.helpers import eventually
from tests.kit.builders import CLOUD, HOME, NAME, NOW
from tests.kit.builders import logical_job as job
from tests.kit.clock import ManualClock
from tests.kit.state import dump

TTL_S = 5  # [federation] leader_ttl_s's default
# Leadership changing hands on a real etcd: short, as the sandbox's replicas run it
# (etcd's floor is 1.5 election timeouts, 1.5 s by default).
LIVE_TTL_S = 2


@pytest.fixture
def prefix() -> str:
    return fresh_prefix()


@pytest.fixture
def two(etcd: EtcdMember, prefix: str) -> Iterator[tuple[EtcdFederationState,
                                                         EtcdFederationState]]:
    """Replicas at two trusted sites on one etcd; the first leads."""
    onprem = open_replica([etcd.client_url], prefix, "onprem-a", site="onprem")
    cloud = open_replica([etcd.client_url], prefix, "cloud-b", site="cloud")
    assert onprem.leadership.campaign()
    yield onprem, cloud
    for replica in (onprem, cloud):
        replica.leadership.resign()
        replica.close()


# --- when to campaign, renew, step down: pure ---------------------------------------------

THIRD = TTL_S / 3
LEADING = Standing(leading=True, renewed_at=10.0, tried_at=10.0)


@pytest.mark.parametrize(("standing", "now", "step"), [
    pytest.param(Standing(), 0.0, Step.CAMPAIGN, id="a replica that never tried campaigns"),
    pytest.param(Standing(tried_at=10.0), 10.0 + THIRD - 0.01, Step.WAIT,
                 id="a follower waits a third of the TTL between campaigns"),
    pytest.param(Standing(tried_at=10.0), 10.0 + THIRD, Step.CAMPAIGN,
                 id="and then campaigns again"),
    pytest.param(LEADING, 10.0, Step.WAIT, id="a leader just renewed waits"),
    pytest.param(LEADING, 10.0 + THIRD - 0.01, Step.WAIT, id="for a third of the TTL"),
    pytest.param(LEADING, 10.0 + THIRD, Step.KEEPALIVE, id="then renews"),
    pytest.param(LEADING, 10.0 + TTL_S - 0.01, Step.KEEPALIVE,
                 id="a leader whose renewals failed tries again until the TTL is spent"),
    pytest.param(LEADING, 10.0 + TTL_S, Step.STEP_DOWN,
                 id="a whole TTL since the last renewal etcd answered: it steps down"),
    pytest.param(LEADING, 10.0 + 100 * TTL_S, Step.STEP_DOWN, id="and long after"),
])
def test_next_step(standing: Standing, now: float, step: Step) -> None:
    assert next_step(standing, now, TTL_S) is step


def test_a_follower_leads_at_most_a_ttl_and_a_third_after_the_last_renewal() -> None:
    """The old leader steps down at renewed_at + TTL, when etcd may let the key go at the
    earliest; a follower that campaigned just before tries again a third later."""
    leader, follower = LEADING, Standing(tried_at=10.0 + TTL_S - 0.001)
    assert next_step(leader, 10.0 + TTL_S, TTL_S) is Step.STEP_DOWN
    assert next_step(follower, 10.0 + TTL_S + THIRD, TTL_S) is Step.CAMPAIGN


# --- the key layout: pure -------------------------------------------------------------------

DIGEST = token_digest("t")


@pytest.mark.parametrize(("key", "expected"), [
    (Layout().leader, "/slurm-geo/federation/leader"),
    (Layout().job("onprem-7"), "/slurm-geo/federation/jobs/onprem-7"),
    (Layout().job("a/b c'\n"), "/slurm-geo/federation/jobs/a%2Fb%20c%27%0A"),
    (Layout().job("ünï"), "/slurm-geo/federation/jobs/%C3%BCn%C3%AF"),
    (Layout().incarnation("j", 3), "/slurm-geo/federation/incarnations/j/0000000003"),
    (Layout().lease("j"), "/slurm-geo/federation/leases/j"),
    (Layout().token(DIGEST), f"/slurm-geo/federation/tokens/{DIGEST}"),
    (Layout().secret("j", 12), "/slurm-geo/federation/secrets/j/0000000012"),
    (Layout().health("rented"), "/slurm-geo/federation/health/rented"),
    (Layout("/site/x").bandwidth, "/site/x/bandwidth"),
    (Layout().daemon, "/slurm-geo/federation/daemon"),
    (Layout().audit_entry(7), "/slurm-geo/federation/audit/000000000007"),
])
def test_key_names(key: str, expected: str) -> None:
    assert key == expected


@pytest.mark.parametrize("prefix", ["", "x", "/x/", "/x y", "/ü", "//x"])
def test_a_prefix_that_is_not_slash_separated_names_is_refused(prefix: str) -> None:
    with pytest.raises(ValueError, match="etcd prefix"):
        Layout(prefix)


def test_a_token_is_never_a_key_name() -> None:
    with pytest.raises(ValueError, match="SHA-256"):
        Layout().token("the-token-itself")


# --- one leader -----------------------------------------------------------------------------

def test_the_first_campaign_wins_and_followers_read_who_leads(two) -> None:
    onprem, cloud = two
    assert onprem.leadership.is_leader() and not cloud.leadership.campaign()
    assert not cloud.leadership.is_leader()
    assert cloud.leadership.leader() == onprem.leadership.me
    assert onprem.leadership.term is not None and onprem.leadership.lease is not None


def running_away(leader: EtcdFederationState) -> None:
    """The job at generation 1 on the cloud, running, its key token unused: a state in
    which every one of WRITES would be written."""
    leader.add_job(job())
    leader.begin_generation(NAME, 0, CLOUD, None, NOW - 10)
    leader.submitted(NAME, 1, 70, token_digest("tok"), NOW - 9)


# A write of each kind: a generation bump, a status move, a lease, health, identities.
WRITES: dict[str, Callable[[EtcdFederationState], Any]] = {
    "begin_generation": lambda s: s.begin_generation(NAME, 1, HOME, None, NOW),
    "move_status": lambda s: s.move_status(NAME, JobStatus.RUNNING, JobStatus.CANCELLED, NOW),
    "put_lease": lambda s: s.put_lease(Lease(NAME, 1, CLOUD, 70, 0, NOW, 1, False), True),
    "put_health": lambda s: s.put_health(Health(HOME, ClusterStatus.OUT, 3, NOW, None, "x")),
    "put_secret": lambda s: s.identities.put_secret(NAME, 2, "ab" * 32),
    "use_token": lambda s: s.identities.use_token("tok", 0),
    "add_job": lambda s: s.add_job(job(logical_job="onprem-8")),
}


@pytest.mark.parametrize("write", WRITES)
def test_a_followers_write_is_refused_naming_the_leader(two, write: str) -> None:
    onprem, cloud = two
    running_away(onprem)
    before = dump(onprem)
    with pytest.raises(NotLeader) as refused:
        WRITES[write](cloud)
    assert refused.value.leader == onprem.leadership.me
    assert "onprem-a at site onprem (https://onprem-a.example:9852) leads" in str(refused.value)
    assert dump(onprem) == before


@pytest.mark.parametrize("write", WRITES)
def test_a_deposed_leaders_write_is_refused_by_etcd(two, write: str) -> None:
    """The old leader's lease ran out while it was stalled (revoked here, as etcd does at
    its TTL) and the other site's replica took the key: the old one still thinks it
    leads, and etcd refuses its write on the leader key's create_revision."""
    onprem, cloud = two
    running_away(onprem)
    cloud.kv.revoke(onprem.leadership.lease or 0)
    assert cloud.leadership.campaign()
    assert onprem.leadership.is_leader()  # it has not heard
    before = dump(cloud)
    with pytest.raises(NotLeader) as refused:
        WRITES[write](onprem)
    assert refused.value.leader == cloud.leadership.me
    assert dump(cloud) == before
    assert not onprem.leadership.is_leader()
    WRITES[write](cloud)  # the new leader's goes through
    assert dump(cloud) != before


def test_a_leader_that_could_not_renew_for_a_ttl_stops_writing_before_etcd_lets_go(
        etcd: EtcdMember, prefix: str) -> None:
    """Stalled past its TTL (a pause, a partition), a leader refuses its own writes: etcd
    may hand the key to another replica from then on."""
    clock = ManualClock(1000.0)
    onprem = open_replica([etcd.client_url], prefix, "onprem-a", ttl_s=60, clock=clock)
    try:
        assert onprem.leadership.campaign()
        onprem.add_job(job())
        clock.now += 60
        before = dump(onprem)
        with pytest.raises(NotLeader) as refused:
            onprem.move_status(NAME, JobStatus.RUNNING, JobStatus.CANCELLED, NOW)
        assert refused.value.leader == onprem.leadership.me  # etcd still has its key
        assert dump(onprem) == before
    finally:
        onprem.leadership.resign()
        onprem.close()


def test_ticks_renew_the_lease_and_a_stalled_leader_gives_the_key_up(
        etcd: EtcdMember, prefix: str) -> None:
    clock = ManualClock(1000.0)
    onprem = open_replica([etcd.client_url], prefix, "onprem-a", ttl_s=TTL_S, clock=clock)
    leadership = onprem.leadership
    try:
        assert leadership.tick() is Step.CAMPAIGN and leadership.is_leader()
        clock.now += THIRD / 2
        assert leadership.tick() is Step.WAIT
        clock.now += THIRD / 2
        assert leadership.tick() is Step.KEEPALIVE and leadership.is_leader()
        clock.now += TTL_S
        assert not leadership.is_leader()
        assert leadership.tick() is Step.STEP_DOWN
        assert leadership.leader() is None  # its lease revoked, the key went with it
        assert leadership.tick() is Step.CAMPAIGN and leadership.is_leader()
    finally:
        leadership.resign()
        onprem.close()


def run_leadership(replica: EtcdFederationState) -> tuple[threading.Event, threading.Thread]:
    stop = threading.Event()
    thread = threading.Thread(target=replica.leadership.run, args=(stop,), daemon=True)
    thread.start()
    return stop, thread


@pytest.mark.slow
@pytest.mark.parametrize("how", ["keepalives stop", "leader resigns"])
def test_leadership_passes_to_the_other_site_and_never_to_two(
        etcd: EtcdMember, prefix: str, how: str) -> None:
    onprem = open_replica([etcd.client_url], prefix, "onprem-a", ttl_s=LIVE_TTL_S)
    cloud = open_replica([etcd.client_url], prefix, "cloud-b", ttl_s=LIVE_TTL_S, site="cloud")
    stop_onprem, onprem_thread = run_leadership(onprem)
    eventually(onprem.leadership.is_leader, bool, timeout_s=LIVE_TTL_S)
    stop_cloud, cloud_thread = run_leadership(cloud)
    try:
        time.sleep(1.5 * LIVE_TTL_S)  # renewals keep it: the follower's campaigns all lose
        assert onprem.leadership.is_leader() and not cloud.leadership.is_leader()
        stop_onprem.set()
        onprem_thread.join()
        stopped = time.monotonic()
        if how == "leader resigns":
            onprem.leadership.resign()  # its lease revoked: the key goes at once
        both: list[bool] = []
        onprem_down: list[float] = []

        def cloud_leads() -> bool:
            leads, old_leads = cloud.leadership.is_leader(), onprem.leadership.is_leader()
            both.append(leads and old_leads)
            if not old_leads and not onprem_down:
                onprem_down.append(time.monotonic())
            return leads
        eventually(cloud_leads, bool, timeout_s=3 * LIVE_TTL_S, interval_s=0.02)
        took = time.monotonic() - stopped
        print(f"\nleader failover ({how}, TTL {LIVE_TTL_S} s): cloud-b leads {took:.2f} s after "
              f"onprem-a stopped renewing, {time.monotonic() - onprem_down[0]:.2f} s after "
              "onprem-a stopped acting as leader")
        assert not any(both)
        assert cloud.leadership.leader() == cloud.leadership.me
        with pytest.raises(NotLeader):
            onprem.put_sync_transfer_id(1)
    finally:
        stop_cloud.set()
        cloud_thread.join()
        for replica in (onprem, cloud):
            replica.leadership.resign()
            replica.close()


# --- nothing on the replica's disk, nothing readable in etcd's -----------------------------

def fill(leader: EtcdFederationState, marker: str) -> None:
    """One of each record, the secrets among them carrying `marker`."""
    leader.add_job(job(script=f"#!/bin/bash\necho script-{marker}\n",
                       owner=Owner("alice", 2001, 2100),
                       owner_env={"HF_TOKEN": f"env-{marker}"}))
    leader.begin_generation(NAME, 0, CLOUD, 100, NOW - 10)
    leader.identities.put_secret(NAME, 1, f"secret-{marker}")
    leader.submitted(NAME, 1, 70, token_digest(f"token-{marker}"), NOW - 9)
    leader.put_lease(Lease(NAME, 1, CLOUD, 70, 0, NOW - 5, 100, False), True)
    leader.put_health(Health(HOME, ClusterStatus.OUT, 3, NOW - 60, NOW - 90, "timeout"))
    leader.put_bandwidth_snapshot([{"source": "pfs", "mbps": 200}])
    leader.put_bandwidth_probe_at(99.5)
    leader.put_sync_transfer_id(12)
    leader.end_incarnation(NAME, 0, "moved", NOW - 8)


def everything(replica: EtcdFederationState, marker: str) -> dict[str, Any]:
    token = replica.identities.token_owner(f"token-{marker}")
    return {"jobs": replica.jobs(), "incarnations": replica.incarnations(NAME),
            "lease": replica.lease(NAME), "health": replica.health(),
            "bandwidth": replica.bandwidth_snapshot(),
            "watermarks": (replica.bandwidth_probe_at(), replica.sync_transfer_id()),
            "secret": replica.identities.secret(NAME, 1), "token": token,
            "found": (replica.find_job(CLOUD, 70), replica.find_by_job_id(70),
                      replica.find_by_run("run-7"))}


def test_a_replica_started_on_an_empty_machine_reads_everything_back(two) -> None:
    onprem, _ = two
    marker = uuid.uuid4().hex
    fill(onprem, marker)
    written = everything(onprem, marker)
    assert written["secret"] == f"secret-{marker}" and written["token"] is not None
    assert written["jobs"][0].owner_env == {"HF_TOKEN": f"env-{marker}"}
    fresh = open_replica(onprem.kv.endpoints, onprem.layout.prefix, "cloud-c", site="cloud")
    try:
        assert everything(fresh, marker) == written
        onprem.leadership.resign()
        assert fresh.leadership.campaign()  # and, leading, takes writes
        assert fresh.begin_generation(NAME, 1, HOME, 200, NOW).generation == 2
    finally:
        fresh.leadership.resign()
        fresh.close()


def test_no_secret_token_script_or_environment_is_in_the_clear_in_etcds_data(
        two, etcd: EtcdMember) -> None:
    onprem, _ = two
    marker = uuid.uuid4().hex
    fill(onprem, marker)
    raw = etcd3gw.client(host="127.0.0.1", port=etcd.client_port)
    raw.put(f"{onprem.layout.prefix}-control", f"clear-{marker}")  # what the scan would see
    stored = data_bytes(etcd)
    assert f"clear-{marker}".encode() in stored
    assert token_digest(f"token-{marker}").encode() in stored  # the token's key name
    for text in (f"secret-{marker}", f"token-{marker}", f"script-{marker}", f"env-{marker}"):
        assert text.encode() not in stored, text
    assert marker.encode() not in stored.replace(f"clear-{marker}".encode(), b"")


def test_a_value_copied_under_another_key_does_not_open(two, etcd: EtcdMember) -> None:
    onprem, cloud = two
    onprem.add_job(job())
    onprem.add_job(job(logical_job="onprem-8", script="#!/bin/bash\nrm -rf ~\n"))
    raw = etcd3gw.client(host="127.0.0.1", port=etcd.client_port)
    (sealed,) = raw.get(onprem.layout.job("onprem-8"))
    raw.put(onprem.layout.job(NAME), sealed)
    with pytest.raises(FederationStateError, match="authentication failed"):
        cloud.job(NAME)


@pytest.mark.parametrize("deleted_between", [False, True])
def test_an_older_sealed_value_put_back_is_refused_as_a_replay(
        two, etcd: EtcdMember, deleted_between: bool) -> None:
    """Whoever can write to etcd (a member's disk, a stolen client) puts back a job's record
    as it was before later writes: it opens under its own key, but etcd counts the
    key's version past the one it was sealed for, so every reader refuses it with one line.
    Deleted and written anew, the key is in another life (another create_revision)."""
    onprem, cloud = two
    onprem.add_job(job())
    raw = etcd3gw.client(host="127.0.0.1", port=etcd.client_port)
    key = onprem.layout.job(NAME)
    (registered,) = raw.get(key)  # version 1
    onprem.begin_generation(NAME, 0, HOME, 200, NOW)  # version 2 ...
    (bumped,) = raw.get(key)
    onprem.count_lost_restart(NAME, NOW)  # ... 3
    assert cloud.job(NAME).generation == 1
    if deleted_between:
        raw.delete(key)
        raw.put(key, registered)  # version 1 again, in a new life
    raw.put(key, bumped)  # version 2 (4 without the delete), sealed for version 2
    for reader in (onprem, cloud):
        with pytest.raises(FederationStateError, match=r"refused .* replayed") as refused:
            reader.job(NAME)
        assert "\n" not in str(refused.value) and key in str(refused.value)
    if not deleted_between:
        raw.put(key, registered)  # the first value of the key's one life, at version 5
        with pytest.raises(FederationStateError, match="replayed"):
            cloud.job(NAME)


def test_a_replica_with_another_master_key_opens_nothing(two, etcd: EtcdMember) -> None:
    onprem, _ = two
    onprem.add_job(job())
    stranger = open_replica([etcd.client_url], onprem.layout.prefix, "rented-x",
                            master_key=bytes(32))
    try:
        with pytest.raises(FederationStateError, match="was sealed with key 050f16e03134dacf"):
            stranger.job(NAME)
    finally:
        stranger.close()


# --- writers and members ----------------------------------------------------------------------

def test_of_eight_threads_of_the_leader_that_saw_one_generation_exactly_one_moves_it(
        two, etcd: EtcdMember) -> None:
    onprem, _ = two
    onprem.add_job(job())
    writers = [EtcdFederationState(EtcdKV([etcd.client_url], KeyFile(MASTER_KEY)),
                                   onprem.layout, onprem.leadership) for _ in range(8)]
    outcomes: list[str] = []
    start = threading.Barrier(len(writers))

    def race(writer: EtcdFederationState, cluster: str) -> None:
        start.wait()
        try:
            writer.begin_generation(NAME, 0, cluster, None, NOW)
            outcomes.append(cluster)
        except StaleJob:
            outcomes.append("stale")

    threads = [threading.Thread(target=race, args=(w, f"c{i}")) for i, w in enumerate(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [o for o in outcomes if o != "stale"]
    assert len(winners) == 1 and outcomes.count("stale") == 7
    assert (onprem.job(NAME).generation, onprem.job(NAME).cluster) == (1, winners[0])
    assert [i.generation for i in onprem.incarnations(NAME)] == [0, 1]


@pytest.mark.slow
def test_the_state_keeps_serving_with_one_of_three_members_lost(
        etcd_cluster: list[EtcdMember], prefix: str) -> None:
    endpoints = [member.client_url for member in etcd_cluster]
    onprem = open_replica(endpoints, prefix, "onprem-a", ttl_s=TTL_S)
    cloud = open_replica(endpoints[::-1], prefix, "cloud-b", ttl_s=TTL_S, site="cloud")
    try:
        assert onprem.leadership.campaign()
        marker = uuid.uuid4().hex
        fill(onprem, marker)
        lost = etcd_cluster[0]  # the member onprem-a talks to
        lost.stop(signal.SIGKILL)
        assert onprem.leadership.keepalive()
        moved = onprem.begin_generation(NAME, 1, HOME, 200, NOW)
        assert moved.generation == 2
        assert cloud.job(NAME) == moved and not cloud.leadership.campaign()
        assert cloud.identities.secret(NAME, 1) == f"secret-{marker}"
        for member in etcd_cluster:
            assert f"secret-{marker}".encode() not in data_bytes(member)
    finally:
        for replica in (onprem, cloud):
            replica.leadership.resign()
            replica.close()
