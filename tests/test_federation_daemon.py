"""The federation daemon's whole loop against in-memory Slurm clusters (FakeSlurm) and
directory stores: registration, outage and failover, the stale incarnation fenced,
failback at a checkpoint, a lost job restarted and given up, a hopeless queue left, a
move awaiting approval, a move cut short by a crash, cancel and resubmit. Seconds, not
minutes; the same paths run against real Slurm in the sandbox tests.

Every lease request is authenticated as lease protocol 2 has it: a home job's with a
credential of a fake munged for its user (alice unless told), an incarnation the daemon
submitted with the secret it was given (tests/test_federation_authn.py: who is refused)."""

from __future__ import annotations

import json
import random
import struct
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from slurm_geo.ckpt import LocalDirStore, Metadata, Repository, Tensor, WriteOptions
from slurm_geo.config.model import parse_config
from slurm_geo.federation.access.authn import Authenticator
from slurm_geo.federation.decide.bandwidth import BandwidthModel
from slurm_geo.federation.engine.core import Federation
from slurm_geo.federation.model import ClusterStatus, JobStatus, LeftHome
from slurm_geo.federation.state.audit import AuditLog
from slurm_geo.federation.state.identities import IncarnationSecrets
from slurm_geo.federation.state.sqlite import FederationState
from slurm_geo.federation.wiring import Wiring
from slurm_geo.lease.munge import FakeMunge
from slurm_geo.lease.protocol import (
    ENV_GENERATION,
    ENV_RESUME_STEP,
    KEY_PATH,
    LEASE_PATH,
    KeyRequest,
    LeaseRequest,
)
from slurm_geo.lease.signing import Credentials, MungeSigner, SecretSigner, secret_bytes
from slurm_geo.policy.directives import BY_OPTION
from slurm_geo.registry import Registry, RegistryReader
from slurm_geo.slurm import JobSpec, JobState, Owner, SlurmRejected
from slurm_geo.slurm.fake import FakeSlurm

KEY = bytes(range(32))
TTL = 10.0
OPTIONS = WriteOptions(chunk_size=4096, pack_size=16 * 1024)
RUN = "run-a"
ALICE = Owner("alice", 2001, 2100)
BOB = Owner("bob", 2002, 2002)
USERS = {"alice": 2001, "bob": 2002, "slurm-geo": 990}  # the uids the fake munged vouches for
# What alice's shell exported when she ran sbatch; Slurm keeps it (sacct --env-vars).
ALICE_ENV = {"PATH": "/home/alice/venv/bin:/usr/bin:/bin", "HOME": "/home/alice",
             "USER": "alice", "VIRTUAL_ENV": "/home/alice/venv", "LANG": "C.UTF-8",
             "LC_ALL": "C.UTF-8", "MODULEPATH": "/etc/modules", "EDITOR": "vim",
             "AWS_SECRET_ACCESS_KEY": "alices-own", "SLURM_GEO_FAILOVER": "never"}


def directives(failover: str | None = "auto") -> dict[str, str]:
    """What the SPANK plugin validated and handed Slurm for `script(failover)`."""
    found = {"geo-ckpt-dir": "/pfs/run-a", "geo-clusters": "onprem,rented"}
    return found if failover is None else {**found, "geo-failover": failover}


def script(failover: str = "auto") -> str:
    return ("#!/bin/bash\n#SBATCH --job-name=train\n#SBATCH --time=30\n"
            "#SBATCH --geo-ckpt-dir=/pfs/run-a\n"
            f"#SBATCH --geo-failover={failover}\n#SBATCH --geo-clusters=onprem,rented\n"
            "exec python train.py\n")


def spank_environment(options: dict[str, str]) -> dict[str, str]:
    """How sbatch puts the SPANK plugin's hand-over in the job's environment."""
    return {f"SLURM_SPANK_GEO_{BY_OPTION[name].env}": value for name, value in options.items()}


@dataclass
class Clock:
    now: float = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Site:
    """Two fake clusters, two directory stores, one daemon; `restart()` is a daemon
    killed and started again on the same state."""

    tmp: Path
    clock: Clock = field(default_factory=Clock)
    rented_cluster: dict = field(default_factory=dict)  # keys replacing rented's config

    def __post_init__(self) -> None:
        for name in ("pfs", "away"):
            (self.tmp / name).mkdir()
        self.raw = {
            "site": {"home_cluster": "onprem"},
            "clusters": {
                "onprem": {"region": "home", "access": "cli", "slurm_conf": "/x",
                           "store": "pfs"},
                "rented": {"region": "eu", "access": "cli", "slurm_conf": "/y",
                           "store": "away", **self.rented_cluster},
            },
            "stores": {"pfs": {"url": f"file://{self.tmp / 'pfs'}", "region": "home"},
                       "away": {"url": f"file://{self.tmp / 'away'}", "region": "eu"}},
            "policy": {"max_restarts": 2},
            "federation": self.federation_table(),
        }
        self.config = parse_config(self.raw)
        self.stores = {"pfs": LocalDirStore(self.tmp / "pfs"),
                       "away": LocalDirStore(self.tmp / "away")}
        self.onprem = FakeSlurm("onprem", clock=self.clock)
        self.rented = FakeSlurm("rented", clock=self.clock)
        self.registry_path = self.tmp / "registry.db"
        self.submitted_directives: dict[int, dict[str, str]] = {}
        self.munged = FakeMunge()
        self.restart()

    def federation_table(self) -> dict:
        return {"state": str(self.tmp / "fed.db"), "audit_path": str(self.tmp / "audit.db"),
                "lease_ttl_s": TTL, "outage_after": 2, "failback_stable_s": 5, "margin_s": 60}

    def restart(self) -> None:
        assert self.config.federation is not None
        self.state = FederationState(self.config.federation.state)
        clients = {"onprem": self.onprem, "rented": self.rented}
        wiring = Wiring(self.config, self.config.federation, KEY, dict(clients), self.stores,
                        self.stores, self.state,
                        AuditLog(self.config.federation.audit_path, clock=self.clock), self.clock,
                        RegistryReader(self.registry_path, missing_ok=True))
        authenticator = Authenticator(self.state.identities, self.munged, self.clock)
        self.federation = Federation(wiring, dict(clients), BandwidthModel(), authenticator)

    def submit_home(self, text: str | None = None, failover: str | None = "auto",
                    owner: Owner = ALICE) -> int:
        """`owner` runs sbatch on onprem with `text` (default: script(failover)): the SPANK
        plugin validates the directives sbatch parsed and hands them to Slurm."""
        options = directives(failover)
        job_id = self.onprem.submit(JobSpec(
            script=text or script(failover or "auto"), owner=owner,
            environment={**ALICE_ENV, **spank_environment(options)}))
        self.submitted_directives[job_id] = options
        return job_id

    def start_home(self, job_id: int) -> None:
        """Slurm starts the home job, after PrologSlurmctld recorded it in the registry."""
        info = self.onprem.job(job_id)
        with Registry(self.registry_path) as registry:
            registry.job_started("onprem", job_id, info.restart_count, name=info.name,
                                 user=info.user, nodes="", now=self.clock(),
                                 directives=self.submitted_directives[job_id])
        self.onprem.start(job_id)

    def tick(self, rounds: int = 1, seconds: float = 1.0) -> None:
        for _ in range(rounds):
            self.federation.tick()
            self.clock.advance(seconds)

    def lease(self, cluster: str, job_id: int, generation: int = 0,
              last_step: int | None = None, release: bool = False, *, restart: int = 0,
              run: str = RUN, as_user: str | None = None) -> dict:
        return self.lease_reply(cluster, job_id, generation, last_step, release,
                                restart=restart, run=run, as_user=as_user).body

    def lease_reply(self, cluster: str, job_id: int, generation: int = 0,
                    last_step: int | None = None, release: bool = False, *, restart: int = 0,
                    run: str = RUN, as_user: str | None = None):
        request = LeaseRequest(run, cluster, job_id, restart, generation, last_step, release)
        credentials = self.credentials(LEASE_PATH, request.to_json(), cluster, job_id,
                                       generation, as_user)
        return self.federation.lease(request, credentials)

    def key(self, cluster: str, job_id: int, generation: int = 0, *, restart: int = 0,
            token: str = "", as_user: str | None = None):
        request = KeyRequest(cluster, job_id, restart, generation, token)
        credentials = self.credentials(KEY_PATH, request.to_json(), cluster, job_id,
                                       generation, as_user)
        return self.federation.key(request, credentials)

    def credentials(self, path: str, body: dict, cluster: str, job_id: int, generation: int,
                    as_user: str | None = None) -> Credentials:
        """What the job's client would send: MUNGE as `as_user` (default: alice) for a
        home job, else the signature of the incarnation that is Slurm job `job_id` on
        `cluster` with its secret (no credential at all when it has none)."""
        data = json.dumps(body).encode()
        headers: dict[str, str] = {}
        if as_user is not None or (cluster == "onprem" and generation == 0):
            munge = self.munged.as_uid(USERS[as_user or "alice"])
            headers = MungeSigner(munge).headers("POST", path, data)
        else:
            job = self.state.find_job(cluster, job_id)
            secret = None if job is None else self.state.identities.secret(job.logical_job,
                                                                           generation)
            if job is not None and secret is not None:  # the session's, once it has one
                signer = SecretSigner(job.logical_job, generation, secret_bytes(
                    IncarnationSecrets.parse(secret).signing), clock=self.clock)
                headers = signer.headers("POST", path, data)
        return Credentials.from_headers(headers, "POST", path, data)

    def checkpoint(self, store: str, step: int) -> None:
        """A checkpoint saved by the cluster whose store `store` is."""
        rng = random.Random(step)
        data = struct.pack("<1024f", *(rng.gauss(0, 1) for _ in range(1024)))
        cluster = "rented" if store == "away" else "onprem"
        Repository(self.stores[store], KEY, OPTIONS).write_checkpoint(
            RUN, [Tensor("w", "float32", (1024,), data)], b"",
            Metadata(step, step, 0, 1.0, "2026-12-01T00:00:00Z", cluster, "1"))

    def job(self) -> object:
        return self.state.jobs()[0]

    def kinds(self) -> list[str]:
        return [f"{e.kind}: {e.what}" for e in self.federation.audit.entries()]

    def home_job_training(self, failover: str = "auto") -> int:
        job_id = self.submit_home(failover=failover)
        self.start_home(job_id)
        self.tick()
        assert self.lease("onprem", job_id, last_step=None)["verdict"] == "grant"
        return job_id

    def moved_away(self) -> tuple[int, int]:
        """A home job training at generation 0, then moved to rented from its checkpoint
        40 (generation 1, pending there) while home is out: (home job id, rented job id)."""
        home_id = self.home_job_training()
        self.checkpoint("away", 40)
        lose_home(self)
        self.tick()
        (away_id, _), = self.rented.submitted
        return home_id, away_id


@pytest.fixture
def site(tmp_path: Path) -> Site:
    return Site(tmp_path)


def lose_home(site: Site) -> None:
    """onprem's controller dies; the daemon declares it out and the lease runs out."""
    site.onprem.go_down()
    site.tick(rounds=2)
    assert site.state.health()["onprem"].status is ClusterStatus.OUT
    site.clock.advance(TTL + 1)


def test_a_home_job_registers_at_its_first_lease_and_trains(site):
    job_id = site.home_job_training()
    job = site.job()
    assert (job.logical_job, job.status, job.generation) == (f"onprem-{job_id}",
                                                             JobStatus.RUNNING, 0)
    assert site.lease("onprem", job_id, last_step=10)["action"] == "train"
    assert any(k.startswith("register") for k in site.kinds())


def test_an_outage_moves_the_job_to_its_newest_verified_checkpoint_off_site(site):
    job_id = site.home_job_training()
    site.checkpoint("away", 20)
    site.checkpoint("away", 40)
    site.onprem.go_down()
    site.tick(rounds=2)
    assert site.job().generation == 0  # the lease is still live: it may be training
    assert any("waiting to move until the lease runs out" in k for k in site.kinds())
    site.clock.advance(TTL + 1)
    site.tick()
    job = site.job()
    assert (job.cluster, job.generation, job.resume_step, job.status) == (
        "rented", 1, 40, JobStatus.RUNNING)
    assert (job.left_home, job.recoveries) == (LeftHome.OUTAGE, 1)
    (new_id, spec), = site.rented.submitted
    assert spec.environment[ENV_GENERATION] == "1"
    assert spec.environment[ENV_RESUME_STEP] == "40"
    # The stale home incarnation is refused a lease and, once home answers, cancelled.
    assert site.lease("onprem", job_id, generation=0)["verdict"] == "fenced"
    site.onprem.come_back()
    site.tick(rounds=2)
    assert site.onprem.job(job_id).state is JobState.CANCELLED
    assert site.state.incarnations(job.logical_job)[0].end_reason == "cancelled: fenced"


def test_a_job_away_fails_back_at_its_next_checkpoint_and_its_checkpoint_goes_home(site):
    _, away_id = site.moved_away()
    site.rented.start(away_id)
    assert site.lease("rented", away_id, generation=1)["verdict"] == "grant"
    site.checkpoint("away", 60)
    site.onprem.come_back()
    site.tick(rounds=8)  # home must be up failback_stable_s before the failback is planned
    assert site.job().move_to == "onprem"
    assert site.lease("rented", away_id, generation=1, last_step=60)["action"] == "release"
    site.lease("rented", away_id, generation=1, last_step=60, release=True)
    site.tick()
    job = site.job()
    assert (job.cluster, job.generation, job.resume_step) == ("onprem", 2, 60)
    assert job.left_home is None
    assert Repository(site.stores["pfs"], KEY).steps(RUN) == [60]  # carried home
    assert any(k.startswith("transfer: copied run-a@60 from away to pfs") for k in site.kinds())


def test_a_lost_job_restarts_until_max_restarts_then_gives_up(site):
    job_id = site.home_job_training()
    site.onprem.finish(job_id, JobState.NODE_FAIL)
    site.tick()
    assert site.job().generation == 0  # its lease has not run out yet
    for generation in (1, 2):
        site.clock.advance(TTL + 1)
        site.tick(rounds=2)  # the restart, then the lost incarnation's fence
        job = site.job()
        assert (job.generation, job.cluster, job.lost_restarts) == (generation, "onprem",
                                                                    generation)
        new_id = job.job_id
        site.onprem.start(new_id)
        site.lease("onprem", new_id, generation=generation)
        site.onprem.finish(new_id, JobState.NODE_FAIL)
    site.clock.advance(TTL + 1)
    site.tick()
    assert site.job().status is JobStatus.FAILED
    assert any(k == "decision: give up" for k in site.kinds())


def test_a_job_completed_after_releasing_its_lease_finishes(site):
    job_id = site.home_job_training()
    site.lease("onprem", job_id, last_step=100, release=True)
    site.onprem.finish(job_id)
    site.tick()
    assert site.job().status is JobStatus.COMPLETED


def test_a_hopeless_queue_is_left_for_the_rented_cluster(site):
    job_id = site.submit_home()
    site.onprem.set_expected_start(7200.0)  # home would start it in two hours
    site.tick()
    assert site.job().generation == 0  # queued for less than the margin
    site.clock.advance(120)
    site.tick()
    job = site.job()
    assert (job.cluster, job.generation, job.left_home) == ("rented", 1, LeftHome.QUEUE)
    assert site.onprem.job(job_id).state is JobState.CANCELLED
    (away_id, _), = site.rented.submitted
    site.rented.start(away_id)
    site.lease("rented", away_id, generation=1)
    site.tick(rounds=10)
    assert site.job().move_to is None  # a job that left a queue does not fail back


def test_a_move_without_consent_waits_for_approval(site):
    site.home_job_training(failover="manual")
    site.checkpoint("away", 40)
    lose_home(site)
    site.tick(rounds=3)
    job = site.job()
    assert (job.generation, job.awaiting_approval) == (0, "rented")
    assert sum("needs approval" in k for k in site.kinds()) == 1  # said once
    site.federation.approve(job.logical_job, "rented", "operator")
    site.tick()
    job = site.job()
    assert (job.cluster, job.generation, job.awaiting_approval) == ("rented", 1, None)


def test_an_approval_never_moves_a_job_where_its_policy_forbids(site):
    """Consent is not a way round the site's rules: a job submitted
    --geo-failover=never (or outside its residency, --geo-clusters, an owner with no
    account there: planner.policy_refusal) is refused in one line, nothing planned."""
    from slurm_geo.federation.model import NotActionable

    site.home_job_training(failover="never")
    site.checkpoint("away", 40)
    logical = site.job().logical_job
    with pytest.raises(NotActionable, match="may not move to rented: --geo-failover=never"):
        site.federation.approve(logical, "rented", "operator")
    assert site.job().move_to is None
    assert not [k for k in site.kinds() if "approv" in k]


def test_a_move_cut_short_by_a_crash_is_finished_by_the_next_daemon(site):
    site.home_job_training()
    site.checkpoint("away", 40)
    lose_home(site)
    logical = site.job().logical_job
    site.state.begin_generation(logical, 0, "rented", 40, site.clock())  # then killed
    site.restart()
    site.tick()
    job = site.job()
    assert (job.status, job.generation, job.resume_step) == (JobStatus.RUNNING, 1, 40)
    assert len(site.rented.submitted) == 1


def test_a_submission_refused_is_audited_and_retried(site):
    site.home_job_training()
    site.checkpoint("away", 40)
    lose_home(site)
    site.rented.reject_next_submit("QOSMaxSubmitJobPerUserLimit")
    site.tick()
    assert site.job().status is JobStatus.MOVING
    assert any("could not be submitted on rented" in k for k in site.kinds())
    site.tick()
    assert site.job().status is JobStatus.RUNNING


def test_a_moved_job_that_dies_before_its_first_lease_says_so(site):
    _, away_id = site.moved_away()
    site.rented.start(away_id)
    site.rented.finish(away_id, JobState.FAILED, exit_code=127)
    site.tick()
    assert site.job().status is JobStatus.FAILED
    assert any("ended FAILED before its first lease" in k for k in site.kinds())


class RenewsDuringVerify:
    """The away store, whose first read lets the frozen trainer at home renew its lease,
    as a thawed process would while the daemon verifies a large checkpoint."""

    def __init__(self, inner: LocalDirStore, renew):
        self.inner, self.renew, self.renewed = inner, renew, False

    def get(self, name: str) -> bytes:
        if not self.renewed:
            self.renewed = True
            self.renew()
        return self.inner.get(name)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def test_a_lease_renewed_while_the_move_verifies_abandons_the_move(site):
    job_id = site.home_job_training()
    site.checkpoint("away", 40)
    lose_home(site)
    away = RenewsDuringVerify(site.stores["away"], lambda: site.lease("onprem", job_id))
    site.federation.wiring.paced_stores["away"] = away
    site.tick()
    assert away.renewed
    job = site.job()
    assert (job.generation, job.cluster, job.status) == (0, "onprem", JobStatus.RUNNING)
    assert site.rented.submitted == []
    assert any(k == "decision: move to rented abandoned" for k in site.kinds())


def test_metrics_gauges_are_set_afresh_each_round(site):
    from slurm_geo.federation.daemon.service import Metrics

    metrics = Metrics()
    job_id = site.home_job_training()
    metrics.observe(site.federation)

    def jobs(status: str) -> float | None:
        return metrics.registry.get_sample_value("slurm_geo_federation_jobs",
                                                 {"status": status})

    assert (jobs("running"), jobs("completed")) == (1.0, 0.0)
    site.lease("onprem", job_id, last_step=100, release=True)
    site.onprem.finish(job_id)
    site.tick()
    site.onprem.go_down()
    site.tick()
    metrics.observe(site.federation)
    assert (jobs("running"), jobs("completed")) == (0.0, 1.0)
    nodes = metrics.registry.get_sample_value("slurm_geo_federation_nodes_available",
                                              {"cluster": "onprem"})
    assert nodes is None  # no probe of it answered this round


class EnvironmentRecordedLate:
    """slurmdbd records a job's environment a few seconds after its submission: the first
    `rounds` reads of it fail, as `sacct --env-vars` does before the record exists."""

    def __init__(self, inner: FakeSlurm, rounds: int):
        self.inner, self.rounds = inner, rounds

    def batch_environment(self, job_id: int) -> dict[str, str]:
        if self.rounds > 0:
            self.rounds -= 1
            raise SlurmRejected("onprem", "read the batch environment", "no record yet")
        return self.inner.batch_environment(job_id)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def test_a_pending_job_recorded_late_is_still_registered_and_leaves_the_queue(site):
    site.federation.wiring.clients["onprem"] = EnvironmentRecordedLate(site.onprem, rounds=2)
    job_id = site.submit_home()
    site.onprem.set_expected_start(7200.0)
    site.tick(rounds=2)
    assert site.state.jobs() == []  # not recorded yet: looked at again, not given up
    site.tick()
    assert site.job().job_id == job_id
    site.clock.advance(120)
    site.tick()
    assert (site.job().cluster, site.job().left_home) == ("rented", LeftHome.QUEUE)


def test_a_store_rolled_back_under_a_job_is_said_and_never_resumed_from(site):
    """Issue 28: the provider of the store a job away writes to deletes its newest
    checkpoint and pointer. The daemon resumed the run from step 40 there, so a restart
    from the 20 that is left would silently lose steps: it is said once, and not done."""
    site.home_job_training()
    site.checkpoint("away", 20)
    site.checkpoint("away", 40)
    lose_home(site)
    site.tick()
    (away_id, _), = site.rented.submitted
    assert site.job().resume_step == 40
    away = site.stores["away"]
    away.delete("manifests/run-a/00000000000000000040")  # the provider's doing
    away.delete("latest/run-a")
    site.rented.start(away_id)
    site.lease("rented", away_id, generation=1)
    site.rented.finish(away_id, JobState.NODE_FAIL)
    site.clock.advance(TTL + 1)
    site.tick(rounds=3)
    job = site.job()
    assert (job.generation, job.resume_step) == (1, 40)  # no incarnation from step 20
    assert len(site.rented.submitted) == 1
    said = [e for e in site.federation.audit.entries() if "rolled back" in e.what]
    assert len(said) == 1 and "holds checkpoints up to step 20" in said[0].why
    assert "step 40 was saved" in said[0].why and "\n" not in said[0].why
