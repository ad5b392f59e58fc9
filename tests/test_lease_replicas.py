"""Following the leader among the replicas, from the job's side and the follower's: the
pure decisions table-tested (which replica next, what a follower answers, what
`federation status` makes of etcd's members), and a job that refuses a redirect to a URL
that is not one of its replicas, sending it nothing."""

from __future__ import annotations

import json
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import lease_site
import pytest

from slurm_geo.federation.daemon.followers import follower_reply, leader_status, retry_after_s
from slurm_geo.federation.model import Replica
from slurm_geo.federation.operator.replication import (
    MemberView,
    ReplicationStatus,
    ReplicaView,
    member_views,
    render,
)
from slurm_geo.lease.client import FederatedRun, FederationUnreachable, Placement
from slurm_geo.lease.protocol import LEADER_PATH
from slurm_geo.lease.replicas import Answer, Hop, Move, next_hop, parse_urls, retry_after

A, B, C = "https://a.example:9852", "https://b.example:9852", "https://c.example/fed"
URLS = (A, B, C)
LEASE = "/v1/lease"
NO_LEADER = {"reason": "no replica leads", "leader": None}


@pytest.mark.parametrize(("asked", "answer", "hop"), [
    pytest.param(0, Answer(200, {"verdict": "grant"}), Hop(Move.DONE, 0), id="the leader's grant"),
    pytest.param(1, Answer(409, {"verdict": "fenced"}), Hop(Move.DONE, 1),
                 id="a fence is an answer"),
    pytest.param(0, Answer(403, {"reason": "x"}), Hop(Move.DONE, 0), id="a refusal is an answer"),
    pytest.param(0, Answer(503, {"reason": "munged down"}), Hop(Move.DONE, 0),
                 id="the leader cannot answer now: its answer"),
    pytest.param(0, Answer(None, {"reason": "refused"}), Hop(Move.NEXT, 1, "refused"),
                 id="no answer: the next replica"),
    pytest.param(2, Answer(None, {"reason": "timeout"}), Hop(Move.NEXT, 0, "timeout"),
                 id="after the last, the first"),
    pytest.param(0, Answer(307, {}, B + LEASE), Hop(Move.FOLLOW, 1), id="redirected to a replica"),
    pytest.param(0, Answer(307, {}, C + LEASE), Hop(Move.FOLLOW, 2),
                 id="a replica behind a path prefix"),
    pytest.param(1, Answer(308, {}, A + LEASE), Hop(Move.FOLLOW, 0), id="a permanent one too"),
    pytest.param(0, Answer(503, NO_LEADER, retry_after_s=2), Hop(Move.WAIT, 0, "no replica leads"),
                 id="nobody leads: ask again"),
])
def test_which_replica_a_job_asks_next(asked: int, answer: Answer, hop: Hop) -> None:
    assert next_hop(URLS, asked, LEASE, answer) == hop


@pytest.mark.parametrize("location", [
    "https://evil.example/v1/lease", B + "/v1/key", "http://a.example:9852/v1/lease",
    "https://a.example:9852.evil.example/v1/lease", "",
], ids=["another host", "another path", "another scheme", "a look-alike host", "none"])
def test_a_redirect_to_anything_but_a_replica_at_the_same_path_is_refused(location):
    hop = next_hop(URLS, 0, LEASE, Answer(307, {}, location))
    assert hop.move is Move.REFUSE and hop.index == 0
    assert "not followed" in hop.reason


@pytest.mark.parametrize(("text", "urls"), [
    ("", ()), (A, (A,)), (f"{A}, {B},,{A}", (A, B)), (f" {C} ", (C,)),
])
def test_the_replica_list_in_the_environment(text, urls):
    assert parse_urls(text) == urls


@pytest.mark.parametrize("text", ["a.example:9852", "ftp://a.example", "https://"])
def test_a_replica_list_with_a_non_url_is_refused(text):
    with pytest.raises(ValueError, match="not an http:// or https:// URL"):
        parse_urls(f"{A},{text}")


@pytest.mark.parametrize(("value", "seconds"), [
    (None, 1.0), ("2", 2.0), ("0", 1.0), ("3600", 60.0), ("soon", 1.0),
])
def test_retry_after_is_bounded_whole_seconds(value, seconds):
    assert retry_after(value) == seconds


# --- the follower's side: pure -----------------------------------------------------------------

LEADER = Replica("home-a", "home", "https://fed-home.example:9852/")


def test_a_follower_points_at_the_leaders_url_of_the_same_path():
    reply = follower_reply(LEADER, "/v1/key", 2)
    assert (reply.status, reply.headers) == (307, {
        "Location": "https://fed-home.example:9852/v1/key"})
    assert reply.body["leader"] == {"name": "home-a", "site": "home",
                                    "url": "https://fed-home.example:9852/"}
    assert "data_key" not in reply.body and "verdict" not in reply.body


def test_while_nobody_leads_a_follower_says_when_to_ask_again():
    reply = follower_reply(None, "/v1/lease", 2)
    assert (reply.status, reply.body["leader"], reply.headers) == (
        503, None, {"Retry-After": "2"})


@pytest.mark.parametrize(("ttl", "seconds"), [(2, 1), (5, 2), (6, 2), (60, 20)])
def test_retry_after_is_a_follower_campaign_interval(ttl, seconds):
    assert retry_after_s(ttl) == seconds


def test_what_a_replica_says_of_leadership():
    me = Replica("control-b", "control", "https://fed-control.example:9852")
    assert leader_status(me, None, LEADER, True) == {
        "replica": {"name": "control-b", "site": "control",
                    "url": "https://fed-control.example:9852"},
        "replicated": True, "leading": False, "term": None,
        "leader": {"name": "home-a", "site": "home", "url": "https://fed-home.example:9852/"}}
    assert leader_status(LEADER, 7, LEADER, True)["leading"] is True


# --- federation status: pure -------------------------------------------------------------------

MEMBERS = {"members": [{"ID": "11", "name": "home"}, {"ID": "22", "name": "control"},
                       {"ID": "33", "name": "rented"}]}


def status(member: str, index: int, leader: str = "11", **more) -> dict:
    return {"header": {"member_id": member}, "leader": leader, "raftIndex": str(index),
            "raftTerm": "4", "version": "3.4.23", **more}


def test_each_member_is_named_and_its_lag_is_against_the_furthest():
    views = member_views([("https://h:2379", status("11", 120)),
                          ("https://c:2379", status("22", 117)),
                          ("https://r:2379", "connection refused")], MEMBERS)
    assert views == [
        MemberView("https://h:2379", True, "home", "11", True, 120, 4, 0, "3.4.23"),
        MemberView("https://c:2379", True, "control", "22", False, 117, 4, 3, "3.4.23"),
        MemberView("https://r:2379", False, error="connection refused")]


def test_a_member_without_a_raft_leader_or_with_errors_is_not_healthy():
    views = member_views([("https://h:2379", status("11", 5, leader="0")),
                          ("https://c:2379", status("22", 5, errors=["NOSPACE"]))], MEMBERS)
    assert [(v.healthy, v.error) for v in views] == [(False, ""), (False, "NOSPACE")]


def test_the_status_table():
    text = render(ReplicationStatus(True, LEADER, [
        ReplicaView("home-a", "home", "https://h", True, True),
        ReplicaView("control-b", "control", "https://c", False, None, "timed out")],
        [MemberView("https://h:2379", True, "home", "11", True, 120, 4, 0, "3.4.23")]))
    lines = text.splitlines()
    assert lines[0].split() == ["REPLICA", "SITE", "URL", "REACHABLE", "LEADS"]
    assert lines[1].split() == ["home-a", "home", "https://h", "yes", "yes"]
    assert lines[2].split() == ["control-b", "control", "https://c", "no", "-"]
    assert lines[3] == "leader: home-a at site home (https://fed-home.example:9852/)"
    assert lines[6].split() == ["home", "https://h:2379", "yes", "yes", "120", "0", "-"]


# --- a redirect outside the list ----------------------------------------------------------------

class Recorder(HTTPServer):
    def __init__(self, answer_location: str | None):
        self.seen: list[tuple[str, dict]] = []
        self.answer_location = answer_location

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                server: Recorder = self.server  # type: ignore[assignment]
                self.rfile.read(int(self.headers["Content-Length"]))
                server.seen.append((self.path, dict(self.headers)))
                self.send_response(307 if server.answer_location else 200)
                if server.answer_location:
                    self.send_header("Location", server.answer_location)
                body = b"{}"
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass
        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def test_a_job_redirected_outside_its_replicas_sends_that_url_nothing(tmp_path):
    evil = Recorder(None)
    follower = Recorder(evil.url + LEASE)
    try:
        run = FederatedRun(Placement("run-a", "rented", 77, 0, 1, None, follower.url,
                                     "file:///x", "", "tok", logical_job="onprem-5",
                                     lease_secret=lease_site.SECRET))
        with pytest.raises(FederationUnreachable):
            run.acquire(give_up_after_s=0.5)
        assert follower.seen and evil.seen == []
        with pytest.raises(FederationUnreachable, match="not followed"):
            run.run_key()
        assert evil.seen == []
    finally:
        for server in (evil, follower):
            server.shutdown()
            server.server_close()


def test_a_daemon_alone_says_it_leads(tmp_path: Path):
    site = lease_site.start(tmp_path)
    try:
        with urllib.request.urlopen(site.url + LEADER_PATH, timeout=5) as response:
            said = json.loads(response.read())
        assert (said["replicated"], said["leading"], said["leader"]["url"]) == (
            False, True, site.url)
    finally:
        site.close()
