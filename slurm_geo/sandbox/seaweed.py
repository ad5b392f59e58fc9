"""The sandbox's S3 endpoint: a SeaweedFS server (`weed server -s3`) with real identities.

SeaweedFS checks each request's signature against the identities of its `-s3.config` file,
enforces what each may do, and keeps its objects in its data directory, which `down` leaves
alone (only `down --purge` removes it): the sandbox's jobs meet the refusals a real site's
store gives, and its objects outlive a restart.

What an identity may do, in SeaweedFS 4.x (each point is checked in tests/test_seaweed.py):
* Its actions are Read, Write, List, Tagging and Admin, for every bucket or, as
  `Write:bucket`, for one; `Write:bucket/prefix*` limits one to keys under a prefix.
* Write covers PutObject and multipart uploads, but also DeleteObject, DeleteObjects and
  AbortMultipartUpload: no set of actions lets an identity write and not delete.
* A bucket policy is evaluated for these identities as well, and its explicit Deny wins.
So a bucket-wide job identity gets Read, List and Write on its own bucket, and the bucket's
policy denies it s3:DeleteObject everywhere but in its store's `locks/`: a writer deletes its
push lock after its manifest (docs/format.md §8.1). Aborting an unfinished multipart upload,
which a resumed put does, stays allowed: it removes no stored object.

A key per run is finer: the federation daemon mints it through the IAM API the S3 port
serves (`-s3.iam.readOnly=false`, the daemons' key only), with the statements of
slurm_geo.federation.act.credentials.run_policy, which SeaweedFS enforces per key prefix.

What jobs sharing the server's host must not reach, its master, volume server and filer,
check no S3 key: `security.toml` (`security_toml`) has them sign every volume and filer
read and write with JWT keys and demand a client certificate of a CA of their own on
every HTTP and gRPC port, which only the server holds. Its S3 port serves TLS with a
certificate of the site CA (`SeaweedTls`).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from slurm_geo.atomic import write_if_changed
from slurm_geo.errors import SandboxError
from slurm_geo.federation.act.credentials import parse_credentials
from slurm_geo.sandbox import certs
from slurm_geo.sandbox.certs import Issued as SiteCa
from slurm_geo.sandbox.layout import S3_BUCKET, S3_REGION, SandboxLayout
from slurm_geo.sandbox.sites import Site

WEED_PROGRAM = "weed"
DAEMONS_IDENTITY = "daemons"
# SeaweedFS's account for identities that name none; bucket policies name users under it.
DEFAULT_ACCOUNT = "000000000000"
LOCKS_PREFIX = "locks/"  # slurm_geo.ckpt.format.names.lock_name: what a job deletes
# Volumes are files of at most this size, grown as written (no preallocation). A bucket
# takes 7 at its first write and the filer's own log some more; 160 give about 20 GB,
# room for drills of 512 MiB checkpoints and the 1 GB replication benchmark, and take no
# disk until written.
VOLUME_SIZE_LIMIT_MB = 128
MAX_VOLUMES = 160


@dataclass(frozen=True)
class S3Credentials:
    access_key_id: str
    secret_access_key: str

    @classmethod
    def generate(cls, name: str) -> S3Credentials:
        # Hex only: the env file is also sourced by /bin/sh (render.hook_wrapper).
        return cls(f"{name}-{secrets.token_hex(8)}", secrets.token_hex(32))

    @classmethod
    def parse(cls, text: str, where: str) -> S3Credentials:
        found = parse_credentials(text, where)
        return cls(found["AWS_ACCESS_KEY_ID"], found["AWS_SECRET_ACCESS_KEY"])

    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": self.access_key_id,
                "AWS_SECRET_ACCESS_KEY": self.secret_access_key}

    def env_text(self) -> str:
        """The env-file form the stores' `job_credentials` files take."""
        return "".join(f"{name}={value}\n" for name, value in self.env().items())


@dataclass(frozen=True)
class SeaweedTls:
    """The files that keep a server's internals to itself and its S3 port on TLS: the
    directory of its security.toml (`-config_dir`), and the S3 gateway's certificate chain
    and key (PEM), from a CA its clients trust."""

    config_dir: Path
    s3_cert: Path
    s3_key: Path

    @property
    def security_toml(self) -> Path:
        return self.config_dir / "security.toml"

    @property
    def internal_ca(self) -> Path:
        """The CA of the internals' own certificates (never the site CA: no certificate
        the site issues to anyone else opens them)."""
        return self.config_dir / "internal-ca.crt"

    @property
    def internal_ca_key(self) -> Path:
        return self.config_dir / "internal-ca.key"

    @property
    def internal_cert(self) -> Path:
        return self.config_dir / "internal.crt"

    @property
    def internal_key(self) -> Path:
        return self.config_dir / "internal.key"

    @property
    def jwt_keys(self) -> Path:
        return self.config_dir / "jwt-keys.json"


@dataclass(frozen=True)
class SeaweedServer:
    """One `weed server`: master, volume server, filer and S3 gateway in one process."""

    data_dir: Path
    identities: Path  # the -s3.config file (s3_config)
    s3_port: int
    # Its own ports, all declared so none lands on another component's (weed's default
    # gRPC port is its HTTP port + 10000): s3 gRPC, master HTTP and gRPC, volume HTTP and
    # gRPC, filer HTTP and gRPC.
    internal_ports: tuple[int, int, int, int, int, int, int]
    # Where the S3 gateway listens; the rest, which checks no key, only on the loopback of
    # the namespace it runs in (in the sandbox, the remote site's).
    s3_address: str = "127.0.0.1"
    tls: SeaweedTls | None = None  # None: plain http, internals unauthenticated (tests only)

    @classmethod
    def of_sandbox(cls, layout: SandboxLayout) -> SeaweedServer:
        return cls(layout.s3_data_dir, layout.s3_identities, layout.s3_port,
                   layout.s3_internal_ports, layout.address(Site.REMOTE),
                   sandbox_tls(layout))

    @property
    def endpoint(self) -> str:
        scheme = "http" if self.tls is None else "https"
        return f"{scheme}://{self.s3_address}:{self.s3_port}"

    def argv(self, program: str) -> list[str]:
        s3_grpc, master, master_grpc, volume, volume_grpc, filer, filer_grpc = self.internal_ports
        secured = [] if self.tls is None else [
            # S3 on TLS only; IAM writes (minting a run's key) for the Admin identity.
            f"-s3.cert.file={self.tls.s3_cert}", f"-s3.key.file={self.tls.s3_key}",
            "-s3.iam.readOnly=false"]
        config_dir = [] if self.tls is None else [f"-config_dir={self.tls.config_dir}"]
        return [
            program, *config_dir, "server", f"-dir={self.data_dir}",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={master}", f"-master.port.grpc={master_grpc}",
            f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
            f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
            # The filer's HTTP API takes no key: any local user could read and delete every
            # object through it. The S3 gateway needs only its gRPC.
            "-filer.disableHttp",
            "-s3", f"-s3.ip.bind={self.s3_address}", f"-s3.port={self.s3_port}",
            f"-s3.port.grpc={s3_grpc}",
            f"-s3.config={self.identities}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",  # no listeners beyond S3
            # Else the daemons' admin key creates any bucket it writes to, and a misspelt
            # bucket is no NoSuchBucket (nor, once volumes run out, anything but a 500).
            "-s3.autoCreateBucket=false",
            f"-master.volumeSizeLimitMB={VOLUME_SIZE_LIMIT_MB}", f"-volume.max={MAX_VOLUMES}",
            "-master.volumePreallocate=false",
            # Resuming the raft state made a restart take 14-20 s to elect its one master,
            # against 3 s without; the volume server reports its volumes at its first
            # heartbeat, so the objects are all there either way.
            "-master.resumeState=false",
            # Its default 10 s wait before stopping outlasts the sandbox's stop grace.
            "-volume.preStopSeconds=0",
            "-master.telemetry=false",
            *secured,
        ]


def sandbox_tls(layout: SandboxLayout) -> SeaweedTls:
    return SeaweedTls(layout.s3_dir / "security", layout.s3_dir / "s3.crt",
                      layout.s3_dir / "s3.key")


@dataclass(frozen=True)
class JwtKeys:
    """SeaweedFS's signing keys: volume writes and reads (master and volume server), filer
    writes and reads (S3 gateway and filer). Hex, from `generate`."""

    volume_write: str
    volume_read: str
    filer_write: str
    filer_read: str

    @classmethod
    def generate(cls) -> JwtKeys:
        return cls(*(secrets.token_hex(32) for _ in range(4)))


def security_toml(keys: JwtKeys, tls: SeaweedTls) -> str:
    """The security.toml that closes a server's internals: each volume and filer read and
    write carries a JWT signed with `keys` (10 s), and every master, volume and filer port,
    HTTP and gRPC, asks for a client certificate of `tls.internal_ca`, which the server's
    own components present to each other."""
    ca, cert, key = (str(path) for path in (tls.internal_ca, tls.internal_cert,
                                            tls.internal_key))
    pair = [f"cert = {json.dumps(cert)}", f"key = {json.dumps(key)}"]
    sections: list[tuple[str, list[str]]] = [
        ("jwt.signing", [f'key = "{keys.volume_write}"', "expires_after_seconds = 10"]),
        ("jwt.signing.read", [f'key = "{keys.volume_read}"', "expires_after_seconds = 10"]),
        ("jwt.filer_signing", [f'key = "{keys.filer_write}"', "expires_after_seconds = 10"]),
        ("jwt.filer_signing.read", [f'key = "{keys.filer_read}"',
                                    "expires_after_seconds = 10"]),
        ("access", ["ui = false"]),
        ("filer.expose_directory_metadata", ["enabled = false"]),
        ("grpc", [f"ca = {json.dumps(ca)}"]),
        *((f"grpc.{part}", pair) for part in ("master", "volume", "filer", "s3", "client")),
        *((f"https.{part}", [*pair, f"ca = {json.dumps(ca)}"])
          for part in ("master", "volume", "filer")),
        ("https.client", ["enabled = true", *pair, f"ca = {json.dumps(ca)}"]),
    ]
    return "".join(f"[{name}]\n" + "".join(f"{line}\n" for line in lines) + "\n"
                   for name, lines in sections)


def ensure_security_files(tls: SeaweedTls, hosts: Sequence[str], site: SiteCa,
                          now: datetime | None = None) -> None:
    """The internals' CA, their certificate (server and client), the JWT keys and the
    security.toml naming them, made where missing (0600 keys, 0700 directory); and the S3
    port's certificate for `hosts`, from the site CA `site`."""
    now = now or datetime.now(UTC)
    tls.config_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    certs.ensure_internal_pki(tls.internal_ca, tls.internal_ca_key, tls.internal_cert,
                              tls.internal_key, now)
    if not tls.jwt_keys.exists():
        write_if_changed(tls.jwt_keys, json.dumps(asdict(JwtKeys.generate())), 0o600)
    keys = JwtKeys(**json.loads(tls.jwt_keys.read_text()))
    write_if_changed(tls.security_toml, security_toml(keys, tls), 0o600)
    certs.ensure_issued(site, tls.s3_cert, tls.s3_key, hosts, now)


def job_identity(bucket: str) -> str:
    return f"job-{bucket}"


def s3_config(daemons: S3Credentials, jobs: Mapping[str, S3Credentials]) -> str:
    """The -s3.config identities: the daemons may do anything; each bucket's job key may
    read, list and write that bucket alone (bucket_policy takes deleting away)."""
    identities = [_identity(DAEMONS_IDENTITY, daemons, ["Admin"])]
    for bucket, credentials in sorted(jobs.items()):
        actions = [f"{action}:{bucket}" for action in ("Read", "List", "Write")]
        identities.append(_identity(job_identity(bucket), credentials, actions))
    return json.dumps({"identities": identities}, indent=2) + "\n"


def _identity(name: str, credentials: S3Credentials, actions: list[str]) -> dict:
    return {"name": name,
            "credentials": [{"accessKey": credentials.access_key_id,
                             "secretKey": credentials.secret_access_key}],
            "actions": actions}


def bucket_policy(bucket: str, store_prefix: str) -> str:
    """Denies the bucket's job key every delete but of push locks under `store_prefix`."""
    prefix = f"{store_prefix.strip('/')}/" if store_prefix.strip("/") else ""
    return json.dumps({"Version": "2012-10-17", "Statement": [{
        "Sid": "JobsDeleteOnlyTheirPushLocks",
        "Effect": "Deny",
        "Principal": {"AWS": [f"arn:aws:iam::{DEFAULT_ACCOUNT}:user/{job_identity(bucket)}"]},
        "Action": ["s3:DeleteObject"],
        "NotResource": [f"arn:aws:s3:::{bucket}/{prefix}{LOCKS_PREFIX}*"],
    }]}, sort_keys=True)


def prepare_sandbox_files(layout: SandboxLayout) -> None:
    """The sandbox server's keys (made at the first `up`, 0600), the identities holding
    them (0600), its data directory, and the files that keep its internals closed and its
    S3 port on TLS."""
    layout.s3_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    layout.s3_data_dir.mkdir(exist_ok=True)
    # Its S3 port answers on the remote site's loopback too (weed listens there as well).
    ensure_security_files(sandbox_tls(layout), [layout.address(Site.REMOTE), "127.0.0.1"],
                          certs.site_ca(layout))
    daemons = ensure_credentials(layout.s3_daemon_credentials, "daemons")
    # What jobs the federation daemon moves to rented get (the offsite store's
    # job_credentials): the server holds them to the bucket, and to no deletes but locks.
    job = ensure_credentials(layout.offsite_job_credentials, "job")
    write_if_changed(layout.s3_identities, s3_config(daemons, {S3_BUCKET: job}), 0o600)


def private_tmp(layout: SandboxLayout) -> Path:
    """What the sandbox server sees as /tmp (processes.Daemon.private_tmp): weed makes its
    gRPC and filer sockets at fixed names there, which in the machine's /tmp any user could
    take first (a root-owned one left by an older sandbox blocked the server too)."""
    return layout.s3_dir / "tmp"


def hand_over(layout: SandboxLayout, uid: int, gid: int) -> None:
    """The sandbox server's files to its own account (service_account.S3_NAME), after
    `prepare_sandbox_files`: its data, security and /tmp directories (0700, everything in
    them its own, a data directory an older sandbox's root-run server filled included),
    its identities and its S3 port's key and certificate (0600). The S3 directory stays
    root's, 0710 to its group: the daemons' key (daemons.env, which root's hooks source)
    stays root's, and the server can neither read it nor put another in its place."""
    tls = sandbox_tls(layout)
    os.chown(layout.s3_dir, 0, gid)
    layout.s3_dir.chmod(0o710)
    for directory in (layout.s3_data_dir, tls.config_dir, private_tmp(layout)):
        directory.mkdir(mode=0o700, exist_ok=True)
        _own_tree(directory, uid, gid)
        directory.chmod(0o700)
    for path in (layout.s3_identities, tls.s3_key, tls.s3_cert,
                 *(p for p in tls.config_dir.iterdir() if not p.is_symlink())):
        os.chown(path, uid, gid)
        path.chmod(0o600)


def _own_tree(top: Path, uid: int, gid: int) -> None:
    """`top` and everything under it owned by uid:gid; links given over, never followed."""
    for directory, _subdirs, files in os.walk(top):
        for path in [directory, *(os.path.join(directory, name) for name in files)]:
            info = os.lstat(path)
            if (info.st_uid, info.st_gid) != (uid, gid):
                os.lchown(path, uid, gid)


def installed_program(layout: SandboxLayout) -> Path:
    """Where the sandbox runs weed from: the site's software tree, which its account can
    execute (the suite's may be under root's home, 0700)."""
    return layout.site_python_dir / "bin" / WEED_PROGRAM


def program_differs(source: Path, target: Path) -> bool:
    try:
        have, want = target.stat(), source.stat()
    except FileNotFoundError:
        return True
    return (have.st_size, have.st_mtime_ns) != (want.st_size, want.st_mtime_ns)


def install_program(source: Path, target: Path) -> bool:
    """A copy of `source` at `target`, root's, 0755, unless one is there already; True
    when it copied."""
    if not program_differs(source, target):
        return False
    temp = target.with_name(f".{target.name}.installing")
    temp.unlink(missing_ok=True)
    shutil.copy2(source, temp)
    if os.geteuid() == 0:
        os.chown(temp, 0, 0)
    temp.chmod(0o755)
    temp.replace(target)
    return True


def ensure_credentials(path: Path, name: str) -> S3Credentials:
    """The credentials in env file `path`, made (0600) at the first call."""
    if not path.exists():
        write_if_changed(path, S3Credentials.generate(name).env_text(), 0o600)
    return S3Credentials.parse(path.read_text(), str(path))


def ensure_bucket(endpoint: str, daemons: S3Credentials, bucket: str, policy: str,
                  timeout_s: float = 30.0, ca_file: Path | None = None) -> None:
    """Create `bucket` unless it exists and set its policy, as the daemons; waits up to
    `timeout_s` for a server that has just opened its port to take writes. An https
    `endpoint` is verified against `ca_file`."""
    from botocore.exceptions import BotoCoreError, ClientError

    from slurm_geo.ckpt.stores.s3store import make_s3_client

    client = make_s3_client(endpoint, S3_REGION, access_key_id=daemons.access_key_id,
                            secret_access_key=daemons.secret_access_key, ca_file=ca_file)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            _create_bucket(client, bucket)
            client.put_bucket_policy(Bucket=bucket, Policy=policy)
            return
        except (ClientError, BotoCoreError) as exc:
            if not _is_transient(exc) or time.monotonic() > deadline:
                raise SandboxError(f"cannot create the sandbox's bucket '{bucket}' at "
                                   f"{endpoint}: {exc}; see the s3 log in the sandbox's "
                                   "log/ directory") from None
            time.sleep(0.5)


def _create_bucket(client, bucket: str) -> None:
    from botocore.exceptions import ClientError

    try:
        client.create_bucket(Bucket=bucket)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") != "BucketAlreadyOwnedByYou":
            raise


def _is_transient(exc: Exception) -> bool:
    """A server still starting: refused connections, or 5xx while its volumes register."""
    from botocore.exceptions import ClientError

    if not isinstance(exc, ClientError):
        return True
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0) >= 500
