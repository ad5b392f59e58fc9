"""The federation world tests build on: two fake clusters (FakeSlurm), two directory stores
and one daemon (`Site`; `restart()` is the daemon killed and started again on the same
state), with alice and bob, the run, the key and the lease TTL they use; `lose_home`, the
outage most tests begin with. tests/test_federation_daemon.py runs the daemon's whole loop
in it.

Every lease request is authenticated as lease protocol 2 has it: a home job's with a
credential of a fake munged for its user (alice unless told), an incarnation the daemon
submitted with the secret it was given (tests/test_federation_authn.py: who is refused)."""

from __future__ import annotations

import json
import random
import struct
from dataclasses import dataclass, field
from pathlib import Path

from slurm_geo.ckpt import LocalDirStore, Metadata, Repository, Tensor, WriteOptions
from slurm_geo.config.model import parse_config
from slurm_geo.federation.access.authn import Authenticator
from slurm_geo.federation.decide.bandwidth import BandwidthModel
from slurm_geo.federation.engine.core import Federation
from slurm_geo.federation.model import ClusterStatus, JobStatus, LogicalJob
from slurm_geo.federation.state.audit import AuditLog
from slurm_geo.federation.state.identities import IncarnationSecrets
from slurm_geo.federation.state.sqlite import FederationState
from slurm_geo.federation.wiring import Wiring
from slurm_geo.lease.munge import FakeMunge
from slurm_geo.lease.protocol import (
    KEY_PATH,
    LEASE_PATH,
    KeyRequest,
    LeaseRequest,
)
from slurm_geo.lease.signing import Credentials, MungeSigner, SecretSigner, secret_bytes
from slurm_geo.policy.directives import BY_OPTION
from slurm_geo.registry import Registry, RegistryReader
from slurm_geo.slurm import JobSpec, Owner
from slurm_geo.slurm.fake import FakeSlurm
from tests.kit.clock import ManualClock

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
class Site:
    """Two fake clusters, two directory stores, one daemon; `restart()` is a daemon
    killed and started again on the same state."""

    tmp: Path
    clock: ManualClock = field(default_factory=ManualClock)
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


def lose_home(site: Site) -> None:
    """onprem's controller dies; the daemon declares it out and the lease runs out."""
    site.onprem.go_down()
    site.tick(rounds=2)
    assert site.state.health()["onprem"].status is ClusterStatus.OUT
    site.clock.advance(TTL + 1)


def dump(site: Site) -> dict[str, list[tuple]]:
    """Every row of every table of the site's SQLite state."""
    db = site.state.db
    tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
    return {t: sorted(tuple(r) for r in db.execute(f"SELECT * FROM {t}")) for t in tables}


def operator_run(site: Site, run: str = "operator-run") -> str:
    """A run an operator wrote into the home store (with the master key): no job of the
    federation names it."""
    Repository(site.stores["pfs"], KEY, OPTIONS).write_checkpoint(
        run, [Tensor("w", "float32", (4,), bytes(16))], b"",
        Metadata(3, 3, 0, 1.0, "2026-12-01T00:00:00Z", "onprem", "1"))
    return run


def rest_site(tmp_path: Path, users: dict) -> Site:
    token = tmp_path / "geo.jwt"
    return Site(tmp_path, rented_cluster={
        "access": "rest", "rest_url": "https://r.example", "rest_user": "geo",
        "token_file": str(token), "users": users})


def world_job(world: dict[str, str], spec: dict | None = None,
              owner: Owner | None = ALICE) -> LogicalJob:
    """onprem-1 of RUN, running at home with the world `world` (its directives)."""
    return LogicalJob(logical_job="onprem-1", run=RUN, home="onprem", script="#!/bin/bash\n",
                      spec=spec or {}, directives=world, generation=0, cluster="onprem", job_id=1,
                      resume_step=None, status=JobStatus.RUNNING, owner=owner)
