"""The lease and key service over real HTTP, with the training side's client: who trains,
who is fenced, who gets the run key. No Slurm is involved in these exchanges (a job moved
by the daemon is already registered), so the daemon's state is set up directly."""

from __future__ import annotations

import socket
import time

import pytest

from slurm_geo.ckpt import LocalDirStore
from slurm_geo.ckpt.runkey import unwrap_run_key
from slurm_geo.config.model import parse_config
from slurm_geo.federation.audit import AuditLog
from slurm_geo.federation.bandwidth import BandwidthModel
from slurm_geo.federation.core import Federation
from slurm_geo.federation.model import JobStatus, LogicalJob, token_digest
from slurm_geo.federation.service import Metrics, serve
from slurm_geo.federation.state import FederationState
from slurm_geo.federation.wiring import Wiring
from slurm_geo.lease.client import FederatedRun, Fenced, Placement

KEY = bytes(range(32))
TTL = 1.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def service(tmp_path):
    (tmp_path / "pfs").mkdir()
    (tmp_path / "away").mkdir()
    port = free_port()
    site = parse_config({
        "site": {"home_cluster": "onprem"},
        "clusters": {
            "onprem": {"region": "home", "access": "cli", "slurm_conf": "/x", "store": "pfs"},
            "rented": {"region": "eu", "access": "cli", "slurm_conf": "/y", "store": "away"},
        },
        "stores": {"pfs": {"url": f"file://{tmp_path / 'pfs'}", "region": "home"},
                   "away": {"url": f"file://{tmp_path / 'away'}", "region": "eu"}},
        "federation": {"state": str(tmp_path / "fed.db"), "audit_path": str(tmp_path / "a.db"),
                       "listen_port": port, "lease_ttl_s": TTL},
    })
    assert site.federation is not None
    stores = {"pfs": LocalDirStore(tmp_path / "pfs"), "away": LocalDirStore(tmp_path / "away")}
    state = FederationState(site.federation.state)
    wiring = Wiring(site, site.federation, KEY, {}, stores, stores, state,
                    AuditLog(site.federation.audit_path))
    federation = Federation(wiring, {}, BandwidthModel())
    now = time.time()
    state.add_job(LogicalJob("onprem-5", "run-a", "onprem", "#!/bin/bash\n", {}, {}, 0,
                             "onprem", 5, None, JobStatus.RUNNING, None, None, now, now))
    state.begin_generation("onprem-5", 0, "rented", None, now)
    state.submitted("onprem-5", 1, 77, token_digest("secret-token"), now)
    metrics = Metrics()
    server = serve(federation, metrics, "127.0.0.1", port)
    metrics.observe(federation)
    yield federation, site.federation.url, stores
    server.shutdown()


def placement(url: str, generation: int, cluster: str, job_id: int, token: str = "",
              restart: int = 0, store_url: str = "file:///x") -> Placement:
    return Placement("run-a", cluster, job_id, restart, generation, None, url, store_url, "",
                     token, None)


def test_the_current_generation_trains_and_a_stale_one_is_fenced(service):
    federation, url, _ = service
    current = FederatedRun(placement(url, 1, "rented", 77))
    current.acquire(give_up_after_s=10)
    assert current.may_train()
    stale = FederatedRun(placement(url, 0, "onprem", 5))
    with pytest.raises(Fenced, match="generation 0 is stale"):
        stale.acquire(give_up_after_s=10)
    assert not stale.may_train()
    kinds = [e.kind for e in federation.audit.entries()]
    assert kinds.count("lease") == 1 and "fence" in kinds
    current.release(None)


def test_a_job_that_cannot_renew_stops_training_before_its_lease_runs_out(service):
    _, url, _ = service
    run = FederatedRun(placement(url, 1, "rented", 77))
    run.acquire(give_up_after_s=10)
    run._stop.set()  # the renewals stop, as if the job were cut off from the daemon
    time.sleep(0.65 * TTL)
    assert not run.may_train()  # at 0.6 x TTL, before the daemon's TTL runs out


def test_moving_the_job_on_fences_the_running_incarnation(service):
    federation, url, _ = service
    run = FederatedRun(placement(url, 1, "rented", 77))
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
    run = FederatedRun(placement(url, 1, "rented", 77, token="secret-token", store_url=away))
    repository = run.repository()
    assert repository.steps("run-a") == []
    assert repository._run_keys["run-a"].data_key == data_key
    wrong = FederatedRun(placement(url, 1, "rented", 77, token="guessed", store_url=away))
    with pytest.raises(Fenced, match="did not release the run key"):
        wrong.repository()
    federation.state.begin_generation("onprem-5", 1, "onprem", None, time.time())
    with pytest.raises(Fenced, match="did not release the run key"):
        run.repository()


def test_a_requeued_incarnation_waits_for_the_previous_lease_to_run_out(service):
    _, url, _ = service
    first = FederatedRun(placement(url, 1, "rented", 77, restart=0))
    first.acquire(give_up_after_s=10)
    first._stop.set()
    second = FederatedRun(placement(url, 1, "rented", 77, restart=1))
    started = time.monotonic()
    second.acquire(give_up_after_s=10)
    assert time.monotonic() - started >= 0.5 * TTL  # it waited for the old lease
    assert second.may_train()
    second.release(None)


def test_metrics_are_served_in_prometheus_text(service):
    import urllib.request

    _, url, _ = service
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
        text = response.read().decode()
    assert 'slurm_geo_federation_jobs{status="running"} 1.0' in text
    assert "slurm_geo_federation_ticks_total 1.0" in text
