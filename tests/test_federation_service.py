"""The lease and key service over real HTTP, with the training side's client: who trains,
who is fenced, who gets the run key. No Slurm is involved in these exchanges (a job moved
by the daemon is already registered), so the daemon's state is set up directly. Requests
are authenticated as lease protocol 2 says: the moved incarnation signs with its secret,
the home one sends a credential of a fake munged."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import lease_site
import pytest

from slurm_geo.ckpt.repo.runkey import unwrap_run_key
from slurm_geo.lease.client import FederatedRun, Fenced, Placement
from slurm_geo.lease.munge import FakeMunge
from slurm_geo.lease.protocol import LEASE_PATH, LeaseRequest
from slurm_geo.lease.signing import MungeSigner, SecretSigner, secret_bytes
from tests.kit.site import cluster, write_site

KEY, TTL, SECRET = lease_site.KEY, lease_site.TTL, lease_site.SECRET
ALICE = lease_site.ALICE.uid
MUNGED = FakeMunge()


@pytest.fixture
def service(tmp_path):
    site = lease_site.start(tmp_path, munged=MUNGED)
    yield site.federation, site.url, site.stores
    site.close()


def placement(url: str, generation: int, cluster: str, job_id: int, token: str = "",
              restart: int = 0, store_url: str = "file:///x") -> Placement:
    """Generation 1 is the incarnation the daemon submitted (it holds the secret); 0 the
    home job, which proves itself by MUNGE."""
    secret = SECRET if generation else ""
    return Placement("run-a", cluster, job_id, restart, generation, None, url, store_url, "",
                     token, "onprem-5" if generation else "", secret)


def trainer(p: Placement) -> FederatedRun:
    signer = None if p.lease_secret else MungeSigner(MUNGED.as_uid(ALICE))
    return FederatedRun(p, signer=signer)


def test_the_current_generation_trains_and_a_stale_one_is_fenced(service):
    federation, url, _ = service
    current = trainer(placement(url, 1, "rented", 77))
    current.acquire(give_up_after_s=10)
    assert current.may_train()
    stale = trainer(placement(url, 0, "onprem", 5))
    with pytest.raises(Fenced, match="generation 0 is stale"):
        stale.acquire(give_up_after_s=10)
    assert not stale.may_train()
    kinds = [e.kind for e in federation.audit.entries()]
    assert kinds.count("lease") == 1 and "fence" in kinds
    current.release(None)


def test_a_job_that_cannot_renew_stops_training_before_its_lease_runs_out(service):
    _, url, _ = service
    run = trainer(placement(url, 1, "rented", 77))
    run.acquire(give_up_after_s=10)
    run._stop.set()  # the renewals stop, as if the job were cut off from the daemon
    time.sleep(0.65 * TTL)
    assert not run.may_train()  # at 0.6 x TTL, before the daemon's TTL runs out


def test_moving_the_job_on_fences_the_running_incarnation(service):
    federation, url, _ = service
    run = trainer(placement(url, 1, "rented", 77))
    run.acquire(give_up_after_s=10)
    federation.state.begin_generation("onprem-5", 1, "onprem", None, time.time())
    deadline = time.time() + 10
    with pytest.raises(Fenced):
        while time.time() < deadline:
            run.wait_for_lease()
            time.sleep(0.05)


def test_the_run_key_goes_only_to_the_current_generation_with_its_token(service):
    federation, url, stores = service
    away = f"file://{stores['away'].root}"
    data_key = unwrap_run_key(stores["away"], KEY, "run-a", create=True)
    run = trainer(placement(url, 1, "rented", 77, token="secret-token", store_url=away))
    with pytest.raises(Fenced, match="hold the lease first"):
        run.repository()  # the key goes only to the incarnation holding the lease
    run.acquire(give_up_after_s=10)
    wrong = trainer(placement(url, 1, "rented", 77, token="guessed", store_url=away))
    with pytest.raises(Fenced, match="no key token of this incarnation"):
        wrong.repository()
    repository = run.repository()
    assert repository.steps("run-a") == []
    assert repository._keys("run-a").current.data_key == data_key
    with pytest.raises(Fenced, match="released the key already"):
        run.repository()  # the token works once
    federation.state.begin_generation("onprem-5", 1, "onprem", None, time.time())
    with pytest.raises(Fenced, match="not the job's current incarnation"):
        run.repository()
    run.release(None)


def test_the_secret_and_the_token_leave_the_environment_when_read(service):
    _, url, _ = service
    env = {"SLURM_CLUSTER_NAME": "rented", "SLURM_JOB_ID": "77", "SLURM_GEO_GENERATION": "1",
           "SLURM_GEO_LOGICAL_JOB": "onprem-5", "SLURM_GEO_FEDERATION_URL": url,
           "SLURM_GEO_STORE": "file:///x", "SLURM_GEO_KEY_TOKEN": "secret-token",
           "SLURM_GEO_LEASE_SECRET": SECRET, "SLURM_GEO_RUN": "run-a"}
    run = FederatedRun.from_environment("run-a", env)
    assert "SLURM_GEO_KEY_TOKEN" not in env and "SLURM_GEO_LEASE_SECRET" not in env
    assert (run.placement.key_token, run.placement.lease_secret) == ("secret-token", SECRET)
    assert SECRET not in repr(run.placement) and "secret-token" not in repr(run.placement)
    run.acquire(give_up_after_s=10)  # it signs with the secret it read
    assert run.may_train()
    run.release(None)


def post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict]:
    request = urllib.request.Request(url + LEASE_PATH, data=body, method="POST",
                                     headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_trainer_signs_with_its_session_secret_and_the_bootstrap_one_is_spent(service):
    """Issue 28, 5, over HTTP: the client takes the session secret from its first lease's
    reply and signs with it; then the bootstrap secret in its environment (and in
    slurmdbd's records) gets nothing more."""
    federation, url, _ = service
    run = trainer(placement(url, 1, "rented", 77, token="secret-token"))
    run.acquire(give_up_after_s=10)
    run.run_key()  # signed with the session secret: the bootstrap one is spent now
    assert run.placement.lease_secret == SECRET  # its ranks still share under it
    lease = federation.state.lease("onprem-5")
    body = json.dumps(LeaseRequest("run-a", "rented", 77, 0, 1, None).to_json()).encode()
    stolen = SecretSigner("onprem-5", 1, secret_bytes(SECRET)).headers("POST", LEASE_PATH,
                                                                       body)
    status, reply = post(url, body, stolen)
    assert status == 401 and "exchanged for a session secret" in reply["reason"]
    assert federation.state.lease("onprem-5") == lease
    run._ask(release=False)  # the trainer itself still renews
    assert run.may_train()
    run.release(None)


def test_unauthenticated_forged_and_replayed_requests_over_http(service):
    federation, url, _ = service
    body = json.dumps(LeaseRequest("run-a", "rented", 77, 5, 1, None).to_json()).encode()
    before = federation.state.lease("onprem-5")
    assert post(url, body, {}) == (401, {"reason": "the request carries no credential "
                                         "(lease protocol 2: a MUNGE credential at home, "
                                         "else the incarnation's signature)"})
    forged = SecretSigner("onprem-5", 1, bytes(32)).headers("POST", LEASE_PATH, body)
    assert post(url, body, forged)[0] == 401
    signed = SecretSigner("onprem-5", 1, secret_bytes(SECRET)).headers("POST", LEASE_PATH,
                                                                       body)
    assert post(url, body, signed)[1]["verdict"] == "grant"
    status, reply = post(url, body, signed)
    assert (status, reply["reason"]) == (403, "this nonce was seen already: a replayed "
                                         "request")
    home = MungeSigner(MUNGED.as_uid(ALICE)).headers("POST", LEASE_PATH, body)
    status, reply = post(url, body, home)  # alice's MUNGE does not speak for generation 1
    assert status == 403 and "only for generation 0" in reply["reason"]
    assert federation.state.lease("onprem-5").restart == 5 and before is None


def test_a_version_1_request_is_refused_with_the_versions_spoken(service):
    _, url, _ = service
    body = json.dumps({"protocol": 1, "run": "run-a", "cluster": "rented", "job_id": 77,
                       "generation": 1}).encode()
    status, reply = post(url, body, {})
    assert status == 400 and "supported: 2" in reply["reason"]


class Requeued:
    """Slurm's record of rented:77: requeued once (a requeue starts it again with its
    bootstrap secret, which then speaks for restart 1: federation.sessions)."""

    def job(self, job_id: int) -> SimpleNamespace:
        return SimpleNamespace(restart_count=1)


def test_a_requeued_incarnation_waits_for_the_previous_lease_to_run_out(service):
    federation, url, _ = service
    federation.wiring.clients["rented"] = Requeued()
    first = trainer(placement(url, 1, "rented", 77, restart=0))
    first.acquire(give_up_after_s=10)
    first._stop.set()
    second = trainer(placement(url, 1, "rented", 77, restart=1))
    started = time.monotonic()
    second.acquire(give_up_after_s=10)
    assert time.monotonic() - started >= 0.5 * TTL  # it waited for the old lease
    assert second.may_train()
    second.release(None)


def test_a_requeued_incarnation_keeps_its_generations_last_checkpoint_until_it_saves(service):
    federation, url, _ = service
    federation.wiring.clients["rented"] = Requeued()
    first = trainer(placement(url, 1, "rented", 77, restart=0))
    first.acquire(give_up_after_s=10)
    first.checkpointed(40)
    first._ask(release=False)  # noqa: SLF001  # a renewal now, not in a third of the TTL
    assert federation.wiring.state.lease("onprem-5").last_step == 40
    first._stop.set()
    second = trainer(placement(url, 1, "rented", 77, restart=1))
    second.acquire(give_up_after_s=10)  # renews with no step of its own yet
    assert federation.wiring.state.lease("onprem-5").last_step == 40
    second.checkpointed(60)
    second._ask(release=False)  # noqa: SLF001
    assert federation.wiring.state.lease("onprem-5").last_step == 60
    second.release(None)


def test_metrics_are_served_in_prometheus_text(service):
    import urllib.request

    _, url, _ = service
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
        text = response.read().decode()
    assert 'slurm_geo_federation_jobs{status="running"} 1.0' in text
    assert "slurm_geo_federation_ticks_total 1.0" in text


def test_a_home_job_finds_munged_in_the_config_and_reads_no_master_key(tmp_path,
                                                                      monkeypatch):
    conf = tmp_path / "slurm.conf"
    conf.write_text("AuthType=auth/munge\nAuthInfo=socket=/run/home/munge.socket\n")
    config = write_site(tmp_path, "site.toml", clusters={"onprem": cluster(slurm_conf=conf)},
                        federation={"key_file": tmp_path / "no-such-master.key"})
    monkeypatch.setenv("SLURM_GEO_CONFIG", str(config))
    env = {"SLURM_CLUSTER_NAME": "onprem", "SLURM_JOB_ID": "5"}
    run = FederatedRun.from_environment("run-a", env)
    p = run.placement
    assert (p.generation, p.key_token, p.lease_secret) == (0, "", "")
    assert p.munge_socket == Path("/run/home/munge.socket")  # from the cluster's slurm.conf
    with config.open("a") as handle:
        handle.write('munge_socket = "/etc/configured.socket"\n')
    assert FederatedRun.from_environment("run-a", env).placement.munge_socket == Path(
        "/etc/configured.socket")
