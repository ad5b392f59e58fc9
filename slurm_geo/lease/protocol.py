"""The lease protocol between training jobs and the federation daemon, defined once: the
paths, the request and reply bodies, their strict parsing, and the SLURM_GEO_* variables
an incarnation the daemon submits is told where to find it. The service
(slurm_geo.federation.daemon.service), the daemon and the client (slurm_geo.lease.client) all use
these types; docs/federation.md ("Lease protocol") specifies them as a wire protocol.

Every body is a JSON object. Requests carry `"protocol": PROTOCOL_VERSION`; a missing one
means version 1. A daemon answers a request of a version it does not speak with 400 and
the versions it does. Unknown fields are ignored, so a later version may add optional
ones; a field that changes meaning gets a new version.

Version 2 authenticates every request (slurm_geo.lease.signing): a job the user submitted
on the home cluster sends a MUNGE credential, an incarnation the daemon submitted signs
with the secret it was given; version 1, which trusted every field, is no longer spoken.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from slurm_geo.ckpt.errors import UnsafeObjectName
from slurm_geo.ckpt.format.keys import RunKeyRing
from slurm_geo.ckpt.format.names import check_run_id
from slurm_geo.names import NAME_RULE, is_name

PROTOCOL_VERSION = 2
SUPPORTED_VERSIONS = (2,)

LEASE_PATH = "/v1/lease"
KEY_PATH = "/v1/key"
METRICS_PATH = "/metrics"
LEADER_PATH = "/v1/leader"  # GET, on every replica: whether it leads, who does
OWNER_PATH = "/v1/owner"  # POST, MUNGE at home: a user's verbs on her own jobs and runs
MAX_BODY_BYTES = 64 * 1024
_HEX64 = re.compile(r"[0-9a-f]{64}")
# A trainer trains only while its last granted renewal is younger than this share of the
# lease's TTL; the daemon moves a job only once a whole TTL passed without one. The gap is
# the margin for clock-rate drift and late packets.
TRAINER_SHARE = 0.6

# What an incarnation submitted by the daemon finds in its environment.
ENV_LOGICAL_JOB = "SLURM_GEO_LOGICAL_JOB"
ENV_GENERATION = "SLURM_GEO_GENERATION"
ENV_RESUME_STEP = "SLURM_GEO_RESUME_STEP"
ENV_RUN = "SLURM_GEO_RUN"
ENV_FEDERATION_URL = "SLURM_GEO_FEDERATION_URL"
# Every replica's URL, comma-separated, when the daemon has replicas: a job follows the
# leader among them (slurm_geo.lease.replicas).
ENV_FEDERATION_URLS = "SLURM_GEO_FEDERATION_URLS"
# The PEM text of the CA the daemon's https certificate is verified against; absent: the
# system's CAs.
ENV_FEDERATION_CA = "SLURM_GEO_FEDERATION_CA"
# The store's CA bundle: its path, and its PEM for a cluster where that path is not there
ENV_CA_BUNDLE = "AWS_CA_BUNDLE"
ENV_STORE_CA = "SLURM_GEO_STORE_CA"
ENV_KEY_TOKEN = "SLURM_GEO_KEY_TOKEN"
ENV_LEASE_SECRET = "SLURM_GEO_LEASE_SECRET"  # signs this incarnation's requests (64 hex)
ENV_STORE = "SLURM_GEO_STORE"
ENV_STORE_ENDPOINT = "SLURM_GEO_STORE_ENDPOINT"

# How a request proves who sends it (docs/federation.md, "Authentication").
HEADER_MUNGE = "X-Slurm-Geo-Munge"              # home: a MUNGE credential
HEADER_INCARNATION = "X-Slurm-Geo-Incarnation"  # elsewhere: LOGICAL_JOB/GENERATION,
HEADER_TIMESTAMP = "X-Slurm-Geo-Timestamp"      # integer seconds since the epoch,
HEADER_NONCE = "X-Slurm-Geo-Nonce"              # 32 hex digits, fresh for each request,
HEADER_SIGNATURE = "X-Slurm-Geo-Signature"      # HMAC-SHA256, 64 hex digits


class ProtocolError(ValueError):
    """A body that is not a request of this protocol: answered 400 with this text."""


class Verdict(Enum):
    GRANT = "grant"          # train (or, with action release, stop after this checkpoint)
    WAIT = "wait"            # ask again after retry_s; do not train meanwhile
    FENCED = "fenced"        # this incarnation is stale: stop for good, commit nothing


class Action(Enum):
    TRAIN = "train"
    RELEASE = "release"      # save a checkpoint (already saved: last_step), release, exit


@dataclass(frozen=True)
class LeaseRequest:
    run: str
    cluster: str
    job_id: int
    restart: int             # SLURM_JOB_RESTART_COUNT: same-cluster requeues keep the job id
    generation: int
    last_step: int | None    # the newest checkpoint this incarnation committed
    release: bool = False    # the incarnation is done with the lease (finished or moving)

    def to_json(self) -> dict[str, Any]:
        return {"protocol": PROTOCOL_VERSION, "run": self.run, "cluster": self.cluster,
                "job_id": self.job_id, "restart": self.restart,
                "generation": self.generation, "last_step": self.last_step,
                "release": self.release}

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> LeaseRequest:
        _check_version(body)
        run = _text(body, "run", allow_empty=True)
        return cls(run=check_run(run) if run else run,
                   cluster=check_cluster(_text(body, "cluster")),
                   job_id=_count(body, "job_id"),
                   restart=_count(body, "restart", default=0),
                   generation=_count(body, "generation"),
                   last_step=_count(body, "last_step", default=None),
                   release=_flag(body, "release", default=False))


@dataclass(frozen=True)
class LeaseReply:
    """200 for grant and wait, 409 for fenced."""

    verdict: Verdict
    reason: str
    action: Action = Action.TRAIN
    logical_job: str = ""
    generation: int = 0
    ttl_s: float = 0.0
    retry_s: float = 0.0
    # An incarnation's first lease: the secret to sign with from now on (64 hex digits);
    # its bootstrap secret (the one in its environment) is spent once this one is used.
    session_secret: str = ""
    # A grant to an incarnation that has not saved yet (its request names no last_step):
    # the newest step of the run known, outside the store, to have been saved in the
    # store it resumes from (docs/format.md §8.6); a store holding nothing as new has
    # rolled the run back, and the job does not resume from it (FederatedRun.checked).
    high_water: int | None = None

    @property
    def http_status(self) -> int:
        return 409 if self.verdict is Verdict.FENCED else 200

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"verdict": self.verdict.value, "reason": self.reason}
        if self.verdict is Verdict.GRANT:
            body.update(action=self.action.value, logical_job=self.logical_job,
                        generation=self.generation, ttl_s=self.ttl_s)
            if self.high_water is not None:
                body["high_water"] = self.high_water
        elif self.verdict is Verdict.WAIT:
            body["retry_s"] = self.retry_s
        if self.session_secret and self.verdict is not Verdict.FENCED:
            body["session_secret"] = self.session_secret
        return body

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> LeaseReply:
        verdict = Verdict(body["verdict"])
        session = str(body.get("session_secret", ""))
        if session and not _HEX64.fullmatch(session):
            raise ValueError("session_secret must be 64 lower-case hex digits")
        mark = body.get("high_water")
        if mark is not None and (type(mark) is not int or mark < 0):
            raise ValueError("high_water must be a non-negative integer or absent")
        return cls(verdict, str(body.get("reason", "")),
                   Action(body.get("action", Action.TRAIN.value)),
                   str(body.get("logical_job", "")), int(body.get("generation", 0)),
                   float(body.get("ttl_s", 0.0)), float(body.get("retry_s", 1.0)), session,
                   mark)


@dataclass(frozen=True)
class KeyRequest:
    """The incarnation asking for its run's data key: it must hold the lease. `token` is
    the one-time token an incarnation the daemon submitted was given; empty at home."""

    cluster: str
    job_id: int
    restart: int
    generation: int
    token: str = ""
    # An incarnation submitted before its job named a run got no store key: it asks for
    # its run's with the data key (only for a store that mints a key per run).
    store_credentials: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"protocol": PROTOCOL_VERSION, "cluster": self.cluster, "job_id": self.job_id,
                "restart": self.restart, "generation": self.generation, "token": self.token,
                "store_credentials": self.store_credentials}

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> KeyRequest:
        _check_version(body)
        return cls(cluster=check_cluster(_text(body, "cluster")),
                   job_id=_count(body, "job_id"),
                   restart=_count(body, "restart", default=0),
                   generation=_count(body, "generation"),
                   token=_text(body, "token", allow_empty=True, default=""),
                   store_credentials=body.get("store_credentials") is True)


@dataclass(frozen=True)
class TreeGrant:
    """One root of the job's world (`--geo-inputs`, `--geo-env`, its working directory,
    its script) as the daemon names it (docs/format.md §11): the home path, the tree id and
    domain the daemon derived for it (per owner and root; the shared domain for a root the
    job found world-readable throughout), and the domain's key ring. Only the domains of
    the job's own roots are ever granted."""

    what: str   # input, env, workdir or script
    path: str
    tree: str
    domain: str
    ring: RunKeyRing
    # The shared tree of a root: staged into only while every user may read the root
    # (slurm_geo.stage.public); the job is granted its own tree of the root with it.
    shared: bool = False

    def to_json(self) -> dict[str, Any]:
        found = {"what": self.what, "path": self.path, "tree": self.tree,
                 "domain": self.domain, "keys": [k.hex() for k in self.ring.data_keys]}
        return {**found, "shared": True} if self.shared else found

    @classmethod
    def from_json(cls, raw: Any) -> TreeGrant:
        if not isinstance(raw, dict) or not all(isinstance(raw.get(k), str) for k in
                                                ("what", "path", "tree", "domain")):
            raise ValueError("a tree grant is {what, path, tree, domain, keys}")
        keys = raw.get("keys")
        if not isinstance(keys, list) or not keys or not all(isinstance(k, str) for k in keys):
            raise ValueError("a tree grant's keys are a list of hex keys")
        for name in ("tree", "domain"):
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", raw[name]):
                raise ValueError(f"a tree grant's {name} is not an id")
        if not isinstance(raw.get("shared", False), bool):
            raise ValueError("a tree grant's shared is true or false")
        return cls(raw["what"], raw["path"], raw["tree"], raw["domain"],
                   RunKeyRing.of([bytes.fromhex(k) for k in keys]), raw.get("shared", False))


@dataclass(frozen=True)
class KeyReply:
    """200 {run, data_key (hex), data_keys (hex, newest first)[, store_env]}; errors are
    {reason} with 401, 403, 409 or 503. `data_keys`: the run's key ring (docs/format.md
    §4.2), of which `data_key` is the first, the one new checkpoints are sealed under (a
    reply without `data_keys` holds that one alone). `store_env`: the run's own store key
    (S3 variables), when the request asked."""

    run: str
    data_keys: RunKeyRing
    store_env: dict[str, str] = field(default_factory=dict)
    # The key rings of the job's world's trees (TreeGrant), when the daemon grants any.
    trees: tuple[TreeGrant, ...] = ()

    @property
    def data_key(self) -> bytes:
        return self.data_keys.current.data_key

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"run": self.run, "data_key": self.data_key.hex(),
                                "data_keys": [k.hex() for k in self.data_keys.data_keys]}
        if self.store_env:
            body["store_env"] = dict(self.store_env)
        if self.trees:
            body["trees"] = [grant.to_json() for grant in self.trees]
        return body

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> KeyReply:
        env = body.get("store_env") or {}
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                and k.startswith("AWS_")
                                                for k, v in env.items()):
            raise ValueError("store_env is not a map of AWS_* variables")
        keys = body.get("data_keys") or [body["data_key"]]
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise ValueError("data_keys is not a list of hex keys")
        ring = RunKeyRing.of([bytes.fromhex(k) for k in keys])
        if "data_key" in body and bytes.fromhex(str(body["data_key"])) != ring.current.data_key:
            raise ValueError("data_key is not the first of data_keys")
        trees = body.get("trees") or []
        if not isinstance(trees, list):
            raise ValueError("trees is not a list of tree grants")
        return cls(str(body["run"]), ring, dict(env),
                   tuple(TreeGrant.from_json(raw) for raw in trees))


OWNER_VERBS = ("status", "logs", "cancel", "resubmit", "run-key", "approve")


@dataclass(frozen=True)
class OwnerRequest:
    """A user at home asking about her own jobs and runs (`slurm-geo status`, `logs`,
    `cancel`, `resubmit`, `approve`, `ckpt ls/verify/pull`), by MUNGE: `job` a reference
    as the CLI takes it (logical job id, CLUSTER:JOBID, job id or run name; none: all
    hers), `run` the run whose data key she asks for, `cluster` where she consents to
    her job's move. Replies are JSON objects; a refusal is {reason, exit_code}
    (slurm_geo.exitcodes)."""

    verb: str
    job: str = ""
    run: str = ""
    cluster: str = ""

    def to_json(self) -> dict[str, Any]:
        found = {"protocol": PROTOCOL_VERSION, "verb": self.verb, "job": self.job,
                 "run": self.run}
        return {**found, "cluster": self.cluster} if self.cluster else found

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> OwnerRequest:
        _check_version(body)
        verb = _text(body, "verb")
        if verb not in OWNER_VERBS:
            raise ProtocolError(f"verb {verb!r:.40} is not one of {', '.join(OWNER_VERBS)}")
        job = _text(body, "job", allow_empty=True, default="")
        if len(job) > 200 or not job.isprintable():
            raise ProtocolError("job must be a printable reference of at most 200 characters")
        run = _text(body, "run", allow_empty=True, default="")
        if verb in ("logs", "cancel", "resubmit", "approve") and not job:
            raise ProtocolError(f"{verb} names a job")
        if verb == "run-key":
            check_run(run)
        cluster = _text(body, "cluster", allow_empty=True, default="")
        if verb == "approve":
            check_cluster(cluster)
        return cls(verb, job, run, cluster)


RUN_RULE = "1-128 letters, digits, '.', '_' or '-', starting with a letter or digit"


# --- names a request carries: one grammar each, checked wherever a request enters ----------

def check_run(run: str) -> str:
    """`run` if it is a run id (slurm_geo.ckpt.format.names, the store's own rule: it becomes an
    object name); ProtocolError otherwise."""
    try:
        return check_run_id(run)
    except UnsafeObjectName:
        raise ProtocolError(f"run {run!r:.80} is not a run id ({RUN_RULE})") from None


def check_logical_job(logical_job: str) -> str:
    """A logical job id (`CLUSTER-JOBID`) follows the run ids' grammar."""
    try:
        return check_run_id(logical_job)
    except UnsafeObjectName:
        raise ProtocolError(f"logical job {logical_job!r:.80} is not CLUSTER-JOBID "
                            f"({RUN_RULE})") from None


def check_cluster(cluster: str) -> str:
    """A cluster name follows the config's grammar (slurm_geo.names)."""
    if not is_name(cluster):
        raise ProtocolError(f"cluster {cluster!r:.80} is not a cluster name ({NAME_RULE})")
    return cluster


def _check_version(body: dict[str, Any]) -> None:
    version = body.get("protocol", 1)
    if type(version) is not int or version not in SUPPORTED_VERSIONS:
        raise ProtocolError(f"protocol {version!r} is not spoken here (supported: "
                            f"{', '.join(map(str, SUPPORTED_VERSIONS))})")


_MISSING = object()


def _text(body: dict[str, Any], name: str, allow_empty: bool = False,
          default: Any = _MISSING) -> str:
    value = body.get(name, default)
    if not isinstance(value, str) or (not value and not allow_empty):
        raise ProtocolError(f"{name} must be a{'' if allow_empty else ' non-empty'} string")
    return value


def _count(body: dict[str, Any], name: str, default: Any = _MISSING) -> Any:
    """A non-negative integer: true JSON integers only (not 1.0, "1" or true)."""
    value = body.get(name, default)
    if value is _MISSING:
        raise ProtocolError(f"{name} is missing")
    if value is default and default is not _MISSING:
        return value
    if type(value) is not int or value < 0:
        raise ProtocolError(f"{name} must be a non-negative integer, not {value!r:.40}")
    return value


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if type(value) is not bool:
        raise ProtocolError(f"{name} must be true or false, not {value!r:.40}")
    return value
