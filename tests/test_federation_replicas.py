"""Two replicas of the federation daemon, home and control, on one real etcd: exactly one
leads; the follower answers lease and key requests with the way to the leader and never
with a grant or a key; when the leader's keepalives stop the other leads within the TTL
and decides; a deposed leader's round submits and fences nothing; jobs follow the
leader; `slurm-geo federation status` shows who leads. Failover times are printed,
never asserted."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_geo.ckpt.format.names import fence_name
from slurm_geo.cli import cli
from slurm_geo.federation.daemon.entry import run_round
from slurm_geo.federation.model import JobStatus, LogicalJob, token_digest
from slurm_geo.lease.client import ELECTION_WAIT_S, FederatedRun, Placement
from slurm_geo.lease.protocol import (
    ENV_FEDERATION_URL,
    ENV_FEDERATION_URLS,
    KEY_PATH,
    LEADER_PATH,
    LEASE_PATH,
    KeyRequest,
    LeaseRequest,
)
from slurm_geo.lease.signing import SecretSigner, secret_bytes
from slurm_geo.slurm import Owner
from tests.etcd_server import EtcdMember, fresh_prefix
from tests.helpers import eventually
from tests.kit.clock import ManualClock
from tests.kit.federation import KEY, RUN, TTL, lose_home
from tests.replica_site import LEADER_TTL_S, ReplicatedSite

SECRET = "5e" * 32
TOKEN = "secret-token"
ALICE = Owner("alice", 2001, 2100)
NAME = "onprem-5"


@pytest.fixture
def site(etcd: EtcdMember, tmp_path: Path) -> Iterator[ReplicatedSite]:
    # The daemons' clock is the wall clock's now, held still: the jobs' real signatures
    # fall in its window, and leases run out only when a test moves it on.
    replicated = ReplicatedSite(tmp_path, clock=ManualClock(time.time()),
                                etcd_url=etcd.client_url, prefix=fresh_prefix())
    yield replicated
    replicated.close()


def home_leads(site: ReplicatedSite) -> None:
    assert site.daemons["home-a"].leadership.campaign()
    assert not site.daemons["control-b"].leadership.campaign()


def moved_to_rented(site: ReplicatedSite) -> None:
    """onprem-5 at generation 1 on rented (Slurm job 77), with its secret and key token,
    written by the leader, home-a."""
    state, now = site.daemons["home-a"].federation.state, site.clock()
    state.add_job(LogicalJob(logical_job=NAME, run=RUN, home="onprem", script="#!/bin/bash\n",
                             spec={}, directives={}, generation=0, cluster="onprem", job_id=5,
                             resume_step=None, status=JobStatus.RUNNING, created_at=now,
                             updated_at=now, owner=ALICE))
    state.begin_generation(NAME, 0, "rented", None, now)
    state.identities.put_secret(NAME, 1, SECRET)
    state.submitted(NAME, 1, 77, token_digest(TOKEN), now)


def signed_post(url: str, path: str, body: dict) -> tuple[int, dict, dict]:
    """Generation 1's request, signed with its secret: status, JSON body, headers."""
    data = json.dumps(body).encode()
    headers = SecretSigner(NAME, 1, secret_bytes(SECRET)).headers("POST", path, data)
    request = urllib.request.Request(url + path, data=data, method="POST", headers={
        "Content-Type": "application/json", **headers})
    opener = urllib.request.build_opener(NoRedirect)
    try:
        with opener.open(request, timeout=5) as response:
            return response.status, json.loads(response.read()), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def leader_says(url: str) -> dict:
    with urllib.request.urlopen(url + LEADER_PATH, timeout=5) as response:
        return json.loads(response.read())


def incarnation(site: ReplicatedSite, *urls: str) -> FederatedRun:
    """Generation 1's trainer, knowing the replicas at `urls` (the first asked first)."""
    return FederatedRun(Placement(RUN, "rented", 77, 0, 1, None, urls[0],
                                  f"file://{site.stores['away'].root}", "", TOKEN,
                                  logical_job=NAME, lease_secret=SECRET,
                                  federation_urls=urls[1:]))


# --- one leader ---------------------------------------------------------------------------

def test_exactly_one_of_two_replicas_campaigning_at_once_leads(site):
    start, won = threading.Barrier(2), {}

    def campaign(name: str) -> None:
        start.wait()
        won[name] = site.daemons[name].leadership.campaign()
    threads = [threading.Thread(target=campaign, args=(n,)) for n in site.daemons]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(won.values()) == [False, True]
    leader = next(name for name, leads in won.items() if leads)
    answers = {name: leader_says(d.url) for name, d in site.daemons.items()}
    assert {a["leader"]["name"] for a in answers.values()} == {leader}
    assert [name for name, a in answers.items() if a["leading"]] == [leader]
    assert all(a["replicated"] for a in answers.values())
    site.tick()
    gauge = {name: d.metrics.leading._value.get() for name, d in site.daemons.items()}
    assert gauge == {name: float(name == leader) for name in site.daemons}


# --- a follower serves nothing that could contradict the leader ------------------------------

def test_a_follower_redirects_lease_and_key_requests_and_releases_no_key(site):
    """The attacker's case: the follower is asked for the run key with a valid token and
    signature. It answers the way to the leader, consumes nothing, writes nothing."""
    home_leads(site)
    moved_to_rented(site)
    state = site.daemons["home-a"].federation.state
    follower, leader = site.daemons["control-b"].url, site.daemons["home-a"].url
    lease = LeaseRequest(RUN, "rented", 77, 0, 1, None).to_json()
    status, body, headers = signed_post(follower, LEASE_PATH, lease)
    assert (status, headers["Location"]) == (307, leader + LEASE_PATH)
    assert body["leader"] == {"name": "home-a", "site": "home", "url": leader}
    assert "verdict" not in body and state.lease(NAME) is None
    key = KeyRequest("rented", 77, 0, 1, TOKEN).to_json()
    status, body, headers = signed_post(follower, KEY_PATH, key)
    assert (status, headers["Location"]) == (307, leader + KEY_PATH)
    assert "data_key" not in body
    assert state.identities.token_owner(TOKEN).used_restart is None  # not consumed
    # The same requests at the leader: a grant, then the key, once.
    assert signed_post(leader, LEASE_PATH, lease)[1]["verdict"] == "grant"
    assert "data_key" in signed_post(leader, KEY_PATH, key)[1]
    assert state.identities.token_owner(TOKEN).used_restart == 0


def test_while_nobody_leads_a_replica_says_so_and_when_to_ask_again(site):
    home_leads(site)
    moved_to_rented(site)
    site.daemons["home-a"].leadership.resign()
    status, body, headers = signed_post(site.daemons["control-b"].url, LEASE_PATH,
                                        LeaseRequest(RUN, "rented", 77, 0, 1, None).to_json())
    assert (status, body["leader"], headers["Retry-After"]) == (503, None, "1")
    assert leader_says(site.daemons["home-a"].url)["leader"] is None


# --- jobs follow the leader ------------------------------------------------------------------

def test_a_job_asking_the_follower_first_gets_its_lease_and_key_from_the_leader(site):
    home_leads(site)
    moved_to_rented(site)
    follower, leader = site.daemons["control-b"].url, site.daemons["home-a"].url
    run = incarnation(site, follower, leader)
    run.acquire(give_up_after_s=10)
    assert run.may_train()
    repository = run.repository()
    assert repository.steps(RUN) == []
    assert run._asking == 1  # it asks the leader from then on
    run.release(None)


def test_a_job_passes_over_a_replica_that_does_not_answer(site):
    home_leads(site)
    moved_to_rented(site)
    dead = "http://127.0.0.1:9"  # discard: nothing listens
    run = incarnation(site, dead, site.daemons["control-b"].url, site.daemons["home-a"].url)
    run.acquire(give_up_after_s=10)
    assert run.may_train()
    run.release(None)


def test_the_daemon_tells_the_incarnations_it_submits_every_replica(site):
    home_leads(site)
    site.home_job_training()
    site.checkpoint("away", 40)
    lose_home(site)
    site.tick()
    (_, spec), = site.rented.submitted
    home, control = site.daemons["home-a"].url, site.daemons["control-b"].url
    assert spec.environment[ENV_FEDERATION_URL] == home
    assert spec.environment[ENV_FEDERATION_URLS] == f"{home},{control}"


# --- failover --------------------------------------------------------------------------------

def keep_leadership(site: ReplicatedSite, name: str) -> tuple[threading.Event, threading.Thread]:
    stop = threading.Event()
    thread = threading.Thread(target=site.daemons[name].leadership.run, args=(stop,),
                              daemon=True)
    thread.start()
    return stop, thread


def test_when_the_leaders_keepalives_stop_the_other_leads_within_the_ttl_and_decides(site):
    home, control = site.daemons["home-a"], site.daemons["control-b"]
    stop_home, home_thread = keep_leadership(site, "home-a")
    eventually(home.leadership.is_leader, bool, timeout_s=LEADER_TTL_S, interval_s=0.02)
    stop_control, control_thread = keep_leadership(site, "control-b")
    try:
        job_id = site.home_job_training()
        site.checkpoint("away", 40)
        assert site.job().generation == 0 and not control.leadership.is_leader()
        stop_home.set()  # home-a's site is cut off: its renewals stop, it does not resign
        home_thread.join()
        stopped = time.monotonic()
        eventually(control.leadership.is_leader, bool, timeout_s=4 * LEADER_TTL_S,
                   interval_s=0.02)
        took = time.monotonic() - stopped
        print(f"\nreplica failover (leader_ttl_s {LEADER_TTL_S}): control-b leads "
              f"{took:.2f} s after home-a's keepalives stopped")
        assert not home.leadership.is_leader()
        site.use("control-b")
        lose_home(site)  # control-b probes, declares onprem out; the lease runs out
        site.tick()
        job = site.job()
        assert (job.generation, job.cluster, job.status) == (1, "rented", JobStatus.RUNNING)
        (_, spec), = site.rented.submitted
        assert spec.environment[ENV_FEDERATION_URL] == control.url
        requeue = [e for e in site.federation.audit.entries(kind="requeue")]
        assert [e.detail["replica"] for e in requeue] == ["control-b"]
        registered = site.federation.audit.entries()[0]
        assert registered.detail["replica"] == "home-a"  # the first leader's decision
        assert site.lease("onprem", job_id, generation=0)["verdict"] == "fenced"
    finally:
        stop_control.set()
        control_thread.join()


def test_a_deposed_leaders_round_submits_and_fences_nothing(site, caplog):
    """home-a stalled past its TTL while control-b took the key; it still thinks it leads
    when its round runs. Its first write is refused by etcd, and the round ends there."""
    caplog.set_level(logging.INFO, "slurm_geo.federation")
    home, control = site.daemons["home-a"], site.daemons["control-b"]
    home_leads(site)
    site.home_job_training()
    site.checkpoint("away", 40)
    lose_home(site)  # the move is due: home is out, the lease ran out
    control.federation.state.kv.revoke(home.leadership.lease or 0)  # as etcd does at its TTL
    assert control.leadership.campaign()
    assert home.leadership.is_leader()  # it has not heard
    run_round(home.federation, home.metrics)
    assert site.rented.submitted == []
    assert not site.stores["away"].exists(fence_name(RUN))
    assert site.job().generation == 0
    said = [m for m in caplog.messages if m.startswith("event=not_leader")]
    assert len(said) == 1 and "control-b at site control" in said[0]
    run_round(home.federation, home.metrics)  # it follows now, silently
    assert [m for m in caplog.messages if m.startswith("event=not_leader")] == said
    assert not home.leadership.is_leader()
    # control-b begins its term (every live lease counts as renewed: jobs could not
    # renew while nobody led), then moves the job once that lease has run out.
    site.use("control-b")
    site.tick()
    assert site.rented.submitted == []
    site.clock.advance(TTL + 1)
    site.tick()
    assert len(site.rented.submitted) == 1
    assert site.stores["away"].exists(fence_name(RUN))
    assert any(m.startswith("event=leading") for m in caplog.messages)


# --- operators -------------------------------------------------------------------------------

def test_federation_status_shows_the_replicas_the_leader_and_etcd(site, etcd):
    home_leads(site)
    key_file = site.tmp / "master.key"
    key_file.write_bytes(KEY)
    os.chmod(key_file, 0o600)
    result = CliRunner().invoke(cli, ["federation", "status", "--json", "--config",
                                      str(site.config_file("control-b"))])
    assert result.exit_code == 0, result.output
    status = json.loads(result.output)
    assert status["replicated"] and status["leader"]["name"] == "home-a"
    assert [(r["name"], r["reachable"], r["leading"]) for r in status["replicas"]] == [
        ("home-a", True, True), ("control-b", True, False)]
    (member,) = status["etcd"]
    assert (member["endpoint"], member["healthy"], member["raft_leader"], member["lag"]) == (
        etcd.client_url, True, True, 0)
    assert member["raft_index"] > 0
    table = CliRunner().invoke(cli, ["federation", "status", "--config",
                                     str(site.config_file("home-a"))])
    assert table.exit_code == 0, table.output
    assert "leader: home-a at site home" in table.output
    assert "RAFT INDEX" in table.output


def test_a_persons_commands_read_and_write_the_state_in_etcd_whoever_leads(site):
    """`slurm-geo status`, `cancel` and `audit verify` at a replica's host: the command
    leads nothing, and its writes hold by their own compare-and-set, as beside SQLite."""
    home_leads(site)
    job_id = site.home_job_training()
    key_file = site.tmp / "master.key"
    key_file.write_bytes(KEY)
    os.chmod(key_file, 0o600)
    config = str(site.config_file("control-b"))
    runner = CliRunner(env={"SLURM_GEO_CONFIG": config})
    listed = runner.invoke(cli, ["status", "--json", "--config", config])
    assert listed.exit_code == 0, listed.output
    assert [v["logical_job"] for v in json.loads(listed.output)] == [f"onprem-{job_id}"]
    cancelled = runner.invoke(cli, ["cancel", f"onprem-{job_id}", "--config", config])
    assert cancelled.exit_code == 0, cancelled.output
    assert site.job().status is JobStatus.CANCELLED
    assert site.lease("onprem", job_id)["verdict"] == "fenced"
    verified = runner.invoke(cli, ["audit", "verify", "--json"])
    assert verified.exit_code == 0, verified.output
    report = json.loads(verified.output)
    assert report["ok"] and report["db"] == f"etcd {site.prefix}"
    entries = site.federation.audit.entries()
    cancel = next(e for e in entries if e.kind == "cancel")
    assert "replica" not in cancel.detail  # a person's, which says who
    assert entries[0].detail["replica"] == "home-a"


def test_a_trainers_renewal_waits_out_the_election_and_is_granted_by_the_new_leader(site):
    home, control = site.daemons["home-a"], site.daemons["control-b"]
    stop_home, home_thread = keep_leadership(site, "home-a")
    eventually(home.leadership.is_leader, bool, timeout_s=LEADER_TTL_S, interval_s=0.02)
    stop_control, control_thread = keep_leadership(site, "control-b")
    try:
        moved_to_rented(site)
        run = incarnation(site, home.url, control.url)
        run.acquire(give_up_after_s=10)
        stop_home.set()
        home_thread.join()
        home.leadership.resign()  # home-a's daemon stops: it gives the lead up
        resigned = time.monotonic()
        reply = run._ask(release=False, election_wait_s=ELECTION_WAIT_S)
        print(f"\na renewal after the leader resigned was granted by control-b "
              f"{time.monotonic() - resigned:.2f} s later")
        assert reply is not None and reply.verdict.value == "grant"
        assert run._asking == 1 and run.may_train() and run.fenced_reason is None
        run.release(None)
    finally:
        stop_control.set()
        control_thread.join()
