"""Who may ask the federation daemon what (lease protocol 2): requests are authenticated
by MUNGE at home and by the incarnation's secret elsewhere, runs and jobs belong to their
owner, a key token works once. The whole daemon over FakeSlurm (tests' `Site`), with a
fake munged for alice (uid 2001, who owns the home jobs) and bob (2002)."""

from __future__ import annotations

import json

import pytest

from slurm_geo.ckpt.repo.runkey import unwrap_run_key
from slurm_geo.federation.access.authn import Authenticator, Caller
from slurm_geo.federation.act.registration import run_taken_by
from slurm_geo.federation.decide.owners import owner_environment
from slurm_geo.federation.model import JobStatus
from slurm_geo.lease.munge import FakeMunge, MungeUnavailable
from slurm_geo.lease.protocol import (
    ENV_KEY_TOKEN,
    ENV_LEASE_SECRET,
    LEASE_PATH,
    KeyRequest,
    LeaseRequest,
    ProtocolError,
)
from slurm_geo.lease.signing import Credentials, MungeSigner, NotAuthenticated, SecretSigner
from slurm_geo.slurm import JobState, Owner
from tests.kit.federation import (
    ALICE,
    ALICE_ENV,
    BOB,
    KEY,
    RUN,
    TTL,
    Site,
    dump,
    lose_home,
    operator_run,
)

BODY = b'{"protocol": 2}'


@pytest.fixture
def site(tmp_path) -> Site:
    return Site(tmp_path)


def fences(site: Site) -> list[str]:
    return [name for store in site.stores.values() for name in store.list("fences/")]


def moved_away(site: Site) -> tuple[int, int, str]:
    """alice's job trained at home, home was lost, generation 1 runs on rented."""
    home_id = site.home_job_training()
    site.checkpoint("away", 40)
    lose_home(site)
    site.tick()
    (away_id, spec), = site.rented.submitted
    site.rented.start(away_id)
    return home_id, away_id, spec.environment[ENV_KEY_TOKEN]


# --- MUNGE, with a fake munged ---------------------------------------------------------------

def munge_credentials(munge, path: str = LEASE_PATH, body: bytes = BODY,
                      payload_of: bytes | None = None) -> Credentials:
    signed_body = body if payload_of is None else payload_of
    headers = MungeSigner(munge).headers("POST", path, signed_body)
    return Credentials.from_headers(headers, "POST", path, body)


@pytest.mark.parametrize("case, make, status, problem", [
    ("the owner's credential", lambda m: munge_credentials(m.as_uid(2001)), None, None),
    ("payload of another body", lambda m: munge_credentials(m.as_uid(2001),
                                                            payload_of=b"{}"), 403,
     "not made for this request"),
    ("payload of another path", lambda m: Credentials.from_headers(
        MungeSigner(m.as_uid(2001)).headers("POST", "/v1/key", BODY), "POST", LEASE_PATH,
        BODY), 403, "not made for this request"),
    ("not a credential of this munged", lambda m: Credentials(
        "POST", LEASE_PATH, BODY, munge="MUNGE:forged:"), 401, "not a valid credential"),
    ("no credential", lambda m: Credentials("POST", LEASE_PATH, BODY), 401, "no credential"),
    ("both kinds", lambda m: Credentials("POST", LEASE_PATH, BODY, munge="MUNGE:x:",
                                         incarnation="a/1"), 401, "one credential"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_munge_verification(site, case, make, status, problem):
    munged = FakeMunge()
    auth = Authenticator(site.state.identities, munged, site.clock)
    credentials = make(munged)
    if status is None:
        assert auth.authenticate(credentials) == Caller(uid=2001)
        return
    with pytest.raises(Exception, match=problem) as refused:
        auth.authenticate(credentials)
    assert refused.value.status == status


def test_a_munge_credential_replayed_is_forbidden_and_munged_down_is_503(site):
    munged = FakeMunge()
    auth = Authenticator(site.state.identities, munged, site.clock)
    credentials = munge_credentials(munged.as_uid(2001))
    auth.authenticate(credentials)
    with pytest.raises(Exception, match="replayed") as replay:
        auth.authenticate(credentials)
    assert replay.value.status == 403

    class Down:
        def decode(self, credential):
            raise MungeUnavailable("no socket")

    down = Authenticator(site.state.identities, Down(), site.clock)
    with pytest.raises(Exception, match="cannot check") as unavailable:
        down.authenticate(credentials)
    assert unavailable.value.status == 503


def test_the_owner_trains_and_another_uid_is_refused_for_her_job(site):
    job_id = site.home_job_training()
    job = site.job()
    assert job.owner == ALICE  # from Slurm's record
    before = dump(site)
    reply = site.lease_reply("onprem", job_id, last_step=5, as_user="bob")
    assert reply.status == 403 and "belongs to alice, not to uid 2002" in reply.body["reason"]
    # What the HTTP side audits of it, once per source per interval (federation.refusals).
    assert reply.refusal is not None and reply.refusal.kind == "refused"
    assert reply.refusal.what == f"refused a lease to onprem:{job_id} (403)"
    assert dump(site) == before
    assert site.lease("onprem", job_id, last_step=5)["verdict"] == "grant"


def test_a_home_job_registers_only_for_the_uid_slurm_says_owns_it(site):
    job_id = site.submit_home()
    site.start_home(job_id)
    reply = site.lease_reply("onprem", job_id, as_user="bob")
    assert reply.status == 403 and "belongs to alice" in reply.body["reason"]
    assert site.state.jobs() == []  # nothing registered
    assert site.lease("onprem", job_id)["verdict"] == "grant"


# --- bob's forged requests -------------------------------------------------------------------

def test_bobs_request_for_alices_run_gets_no_key_and_fences_nothing(site):
    alice_id = site.home_job_training()
    bob_id = site.submit_home(owner=BOB)
    site.start_home(bob_id)
    before = dump(site)
    reply = site.lease_reply("onprem", bob_id, as_user="bob")  # his own job, her run
    assert reply.status == 403 and reply.body == {
        "reason": f"run {RUN} belongs to logical job onprem-{alice_id}"}
    key = site.key("onprem", bob_id, as_user="bob")
    assert key.status == 403 and "data_key" not in key.body
    key = site.key("onprem", alice_id, as_user="bob")  # her job, his credential
    assert key.status == 403 and "data_key" not in key.body
    assert dump(site) == before
    lose_home(site)
    site.tick(rounds=2)  # her job moves; nothing of his was registered, so nothing of his
    assert [j.logical_job for j in site.state.jobs()] == [f"onprem-{alice_id}"]
    assert not any("fence" in k and str(bob_id) in k for k in site.kinds())


def test_bobs_forged_high_restart_is_refused_and_alice_keeps_her_lease(site):
    alice_id = site.home_job_training()
    lease = site.state.lease(site.job().logical_job)
    reply = site.lease_reply("onprem", alice_id, restart=5, as_user="bob")
    assert reply.status == 403
    assert site.state.lease(site.job().logical_job) == lease  # restart still 0
    assert site.lease("onprem", alice_id)["action"] == "train"  # not made to wait


def test_an_unauthenticated_request_is_401_and_changes_nothing(site):
    alice_id = site.home_job_training()
    before = dump(site)
    reply = site.federation.lease(LeaseRequest(RUN, "onprem", alice_id, 9, 0, 99),
                                  Credentials("POST", LEASE_PATH, b"{}"))
    assert reply.status == 401 and "no credential" in reply.body["reason"]
    assert dump(site) == before


def test_a_killed_jobs_lease_is_not_kept_alive_by_someone_elses_renewals(site):
    alice_id = site.home_job_training()
    logical = site.job().logical_job
    renewed_at = site.state.lease(logical).renewed_at
    site.onprem.finish(alice_id, JobState.NODE_FAIL)
    for _ in range(4):  # bob renews it every few seconds, past its TTL
        assert site.lease_reply("onprem", alice_id, as_user="bob").status == 403
        site.tick(seconds=TTL / 3)
    assert site.state.lease(logical).renewed_at == renewed_at
    site.tick(rounds=2)
    job = site.job()
    assert (job.generation, job.recoveries) == (1, 1)  # restarted: the lease ran out


# --- incarnations the daemon submitted: their secret -----------------------------------------

def test_a_moved_incarnation_signs_with_its_secret_and_nobody_else_can(site):
    home_id, away_id, _ = moved_away(site)
    (_, spec), = site.rented.submitted
    secret = spec.environment[ENV_LEASE_SECRET]
    assert site.state.identities.secret(site.job().logical_job, 1) == secret
    assert site.lease("rented", away_id, generation=1)["verdict"] == "grant"
    # No credential, another secret, alice's MUNGE: none speaks for generation 1.
    unsigned = site.federation.lease(_lease(away_id, restart=4),
                                     Credentials("POST", LEASE_PATH, b"{}"))
    assert unsigned.status == 401
    forged = _signed(site, away_id, bytes(32), restart=4)
    assert forged.status == 401 and "signature does not match" in forged.body["reason"]
    munge = site.lease_reply("rented", away_id, generation=1, restart=4, as_user="alice")
    assert munge.status == 403
    assert site.state.lease(site.job().logical_job).restart == 0


def test_a_signed_request_replayed_or_stale_is_refused(site):
    _, away_id, _ = moved_away(site)
    secret = bytes.fromhex(site.state.identities.secret(site.job().logical_job, 1))
    request = _lease(away_id)
    body = json.dumps(request.to_json()).encode()
    headers = SecretSigner(site.job().logical_job, 1, secret, clock=site.clock).headers(
        "POST", LEASE_PATH, body)
    credentials = Credentials.from_headers(headers, "POST", LEASE_PATH, body)
    assert site.federation.lease(request, credentials).status == 200
    replay = site.federation.lease(request, credentials)
    assert replay.status == 403 and "replayed" in replay.body["reason"]
    site.clock.advance(61)
    late = site.federation.lease(request, credentials)
    assert late.status == 401 and "outside ±60 s" in late.body["reason"]


def test_another_incarnations_secret_does_not_speak_for_this_one(site):
    _, away_id, _ = moved_away(site)
    logical = site.job().logical_job
    site.state.identities.put_secret(logical, 7, "77" * 32)  # some other incarnation's
    request = _lease(away_id)
    body = json.dumps(request.to_json()).encode()
    headers = SecretSigner(logical, 7, bytes.fromhex("77" * 32), clock=site.clock).headers(
        "POST", LEASE_PATH, body)
    reply = site.federation.lease(request, Credentials.from_headers(headers, "POST",
                                                                    LEASE_PATH, body))
    assert reply.status == 403 and "does not speak for rented" in reply.body["reason"]


def test_a_key_token_works_once_per_restart_and_only_for_its_incarnation(site):
    _, away_id, token = moved_away(site)
    logical = site.job().logical_job
    assert site.key("rented", away_id, 1, token=token).status == 409  # no lease yet
    site.lease("rented", away_id, generation=1)
    bob = site.key("rented", away_id, 1, token=token, as_user="bob")
    assert bob.status == 403
    first = site.key("rented", away_id, 1, token=token)
    assert first.status == 200
    assert bytes.fromhex(first.body["data_key"]) == unwrap_run_key(
        site.stores["away"], KEY, RUN)
    again = site.key("rented", away_id, 1, token=token)
    assert again.status == 403 and again.body == {
        "reason": "this token has released the key already"}
    # Requeued by Slurm (same job, restart 1): once it holds the lease, its key once more.
    site.clock.advance(TTL + 1)
    site.lease("rented", away_id, generation=1, restart=1)
    assert site.state.lease(logical).restart == 1
    assert site.key("rented", away_id, 1, restart=1, token=token).status == 200
    assert site.key("rented", away_id, 1, restart=1, token=token).status == 403


# --- the home job's key, by MUNGE ------------------------------------------------------------

def test_a_home_job_gets_its_run_key_by_munge_and_nobody_else_does(site):
    job_id = site.submit_home()
    site.start_home(job_id)
    assert site.key("onprem", job_id).status == 403  # not registered yet
    site.lease("onprem", job_id)
    reply = site.key("onprem", job_id)
    assert reply.status == 200 and reply.body["run"] == RUN
    assert bytes.fromhex(reply.body["data_key"]) == unwrap_run_key(site.stores["pfs"], KEY,
                                                                   RUN)
    assert site.key("onprem", job_id, as_user="bob").status == 403
    assert site.key("onprem", job_id, token="anything").status == 403
    assert fences(site) == []


def test_a_home_job_of_a_moved_run_gets_no_key_from_home(site):
    home_id, _, _ = moved_away(site)
    site.onprem.come_back()
    reply = site.key("onprem", home_id)
    assert reply.status == 403 and "not the job's current incarnation" in reply.body["reason"]


# --- runs and owners -------------------------------------------------------------------------

def test_a_finished_run_may_be_continued_by_its_owner_only(site):
    first = site.home_job_training()
    site.lease("onprem", first, last_step=10, release=True)
    site.onprem.finish(first)
    site.tick()
    assert site.job().status is JobStatus.COMPLETED
    bob_id = site.submit_home(owner=BOB)
    site.start_home(bob_id)
    assert site.lease_reply("onprem", bob_id, as_user="bob").status == 403
    again = site.submit_home()
    site.start_home(again)
    assert site.lease("onprem", again)["verdict"] == "grant"


def test_a_job_registered_before_owners_is_claimed_by_the_owner_slurm_names(site):
    job_id = site.home_job_training()
    logical = site.job().logical_job
    site.state.db.execute("UPDATE jobs SET owner_user = NULL, owner_uid = NULL, "
                          "owner_gid = NULL, owner_env = '{}'")  # as migrated from v2
    assert site.lease_reply("onprem", job_id, as_user="bob").status == 403
    assert site.job().owner is None
    assert site.lease("onprem", job_id)["verdict"] == "grant"
    claimed = site.state.job(logical)
    assert claimed.owner == ALICE  # and her allow-listed environment, as at registration
    assert claimed.owner_env == owner_environment(ALICE_ENV) != {}


def test_a_job_discovered_pending_is_owned_by_who_submitted_it(site):
    job_id = site.submit_home(owner=BOB)
    site.tick()
    assert site.job().owner == BOB
    site.start_home(job_id)
    assert site.lease_reply("onprem", job_id).status == 403  # alice's MUNGE
    assert site.lease("onprem", job_id, as_user="bob")["verdict"] == "grant"


@pytest.mark.parametrize("others, uid, stored_in, taken", [
    ([], 2001, None, False),                                    # a brand-new run
    ([], 2001, "pfs", True),    # in a store, named by no job: no recorded owner, nobody's
    ([("onprem-1", JobStatus.COMPLETED, 2001)], 2001, "pfs", False),  # its owner continues
    ([("onprem-1", JobStatus.COMPLETED, 2001)], 2002, "pfs", True),
    ([("onprem-9", JobStatus.RUNNING, 2002)], 2002, "pfs", False),  # the job itself
    ([("onprem-1", JobStatus.RUNNING, 2001)], 2001, None, True),  # one active job per run
    ([("onprem-1", JobStatus.COMPLETED, 2001)], 2001, None, False),  # its owner continues it
    ([("onprem-1", JobStatus.COMPLETED, 2001)], 2002, None, True),
    ([("onprem-1", JobStatus.FAILED, None)], 2001, None, True),    # owner unknown: refused
    ([("onprem-9", JobStatus.RUNNING, 2002)], 2002, None, False),  # the job itself
])
def test_who_may_name_a_run(others, uid, stored_in, taken):
    from dataclasses import replace

    from tests.kit.builders import logical_job as job

    jobs = [replace(job(), logical_job=name, status=status,
                    owner=None if uid is None else Owner(f"u{uid}", uid, uid))
            for name, status, uid in others]
    reason = run_taken_by(jobs, "run-7", "onprem-9", uid, stored_in)
    assert (reason is not None) is taken




def test_a_stored_run_no_job_names_cannot_be_claimed_nor_its_key_released(site):
    """Issue 28, 1: bob's job names a run that exists in the store and no registered job
    names; neither registering nor (discovered pending) naming it gets it, nor its key."""
    run = operator_run(site)
    leasing = site.submit_home(owner=BOB, failover=None)  # registers at its first lease
    site.start_home(leasing)
    pending = site.submit_home(owner=BOB)  # discovered pending: names its run at a lease
    site.tick()
    site.start_home(pending)
    before, stored = dump(site), sorted(site.stores["pfs"].list(""))
    for job_id in (leasing, pending):
        reply = site.lease_reply("onprem", job_id, run=run, as_user="bob")
        assert reply.status == 403, reply.body
        assert reply.body == {"reason": f"run {run} is already in store pfs and no job of the "
                              "federation names it, so it has no recorded owner to continue "
                              "it; name a new run"}
        key = site.key("onprem", job_id, as_user="bob")
        assert key.status in (403, 409) and "data_key" not in key.body
    assert dump(site) == before and sorted(site.stores["pfs"].list("")) == stored
    # A brand-new run is still claimed by its first job, as before.
    assert site.lease("onprem", pending, run="bobs-new-run", as_user="bob")["verdict"] \
        == "grant"


@pytest.mark.parametrize("field, value", [
    ("run", "../../.."), ("run", "a/b"), ("run", ".hidden"), ("run", "a" * 129),
    ("run", "x\ny"), ("cluster", "../onprem"), ("cluster", "on prem"), ("cluster", ""),
])
def test_hostile_run_ids_and_cluster_names_are_refused_at_the_door(site, field, value):
    """Issue 28, 2: one grammar per name, checked as the request is parsed (400)."""
    job_id = site.submit_home(owner=BOB)
    site.tick()
    site.start_home(job_id)
    before = dump(site)
    body = {**LeaseRequest(RUN, "onprem", job_id, 0, 0, None).to_json(), field: value}
    with pytest.raises(ProtocolError, match=field):
        LeaseRequest.from_json(body)
    with pytest.raises(ProtocolError):
        KeyRequest.from_json({**KeyRequest("onprem", job_id, 0, 0).to_json(),
                              "cluster": value if field == "cluster" else "a/b"})
    if field == "run":  # past the parser too: the registrar's own check (the HTTP side: 400)
        with pytest.raises(ProtocolError, match="is not a run id"):
            site.lease_reply("onprem", job_id, run=value, as_user="bob")
    assert dump(site) == before


@pytest.mark.parametrize("incarnation", ["../x/1", "a b/1", "/1", "onprem-5/x"])
def test_a_hostile_incarnation_header_is_not_authenticated(site, incarnation):
    auth = Authenticator(site.state.identities, FakeMunge(), site.clock)
    with pytest.raises(NotAuthenticated):
        auth.authenticate(Credentials("POST", LEASE_PATH, BODY, incarnation=incarnation,
                                      signature="00" * 32))


def _lease(away_id: int, restart: int = 0) -> LeaseRequest:
    return LeaseRequest(RUN, "rented", away_id, restart, 1, None)


def _signed(site: Site, away_id: int, secret: bytes, restart: int = 0):
    request = _lease(away_id, restart)
    body = json.dumps(request.to_json()).encode()
    headers = SecretSigner(site.job().logical_job, 1, secret, clock=site.clock).headers(
        "POST", LEASE_PATH, body)
    return site.federation.lease(request, Credentials.from_headers(headers, "POST",
                                                                   LEASE_PATH, body))
