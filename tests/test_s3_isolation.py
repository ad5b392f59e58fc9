"""Issue 28, as the attacker: a job or user on the S3 server's host with no S3 key, or with
run A's key. The server is a real `weed server` of the tests' own (tests.seaweed_server),
secured as the sandbox's is: internals behind security.toml, S3 on TLS, keys per run.
The rules the config and the daemon apply are checked without a server first."""

from __future__ import annotations

import json
import random
import socket
import ssl
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_geo.ckpt import Metadata, Repository, Tensor, WriteOptions
from slurm_geo.ckpt.stores.retry import is_permanent
from slurm_geo.ckpt.stores.s3store import S3Store, S3Unavailable, make_s3_client
from slurm_geo.ckpt.stores.transfer_plan import DEFAULT_PLAN, MIB, TransferPlan
from slurm_geo.config import load_config
from slurm_geo.config.tables import StoreConfig, parse_store
from slurm_geo.errors import ConfigError
from slurm_geo.federation.act.credentials import (
    IamRunKeys,
    job_environment,
    run_policy,
    run_user_name,
)
from slurm_geo.sandbox.layout import S3_BUCKET, S3_PREFIX
from slurm_geo.sandbox.seaweed import JwtKeys, SeaweedTls, security_toml
from tests.helpers import eventually
from tests.seaweed_server import DAEMONS, RunningServer, needs_weed

PART_PLAN = TransferPlan(part_size=5 * MIB, multipart_threshold=5 * MIB)

# --- the config: S3 endpoints are https unless loopback -----------------------------------


def store_table(**values) -> dict:
    return {"url": "s3://ckpt/site", "region": "remote", **values}


@pytest.mark.parametrize("endpoint, host", [("http://10.0.0.5:8333", "10.0.0.5"),
                                            ("http://s3.example.org", "s3.example.org"),
                                            ("http://[2001:db8::1]:9000", "2001:db8::1")])
def test_a_plain_http_s3_endpoint_to_another_host_is_refused_at_load_with_one_line(
        tmp_path, endpoint, host):
    config = tmp_path / "slurm-geo.toml"
    config.write_text('[site]\nhome_cluster = "onprem"\n\n[clusters.onprem]\n'
                      'region = "home"\naccess = "cli"\nslurm_conf = "/etc/slurm/slurm.conf"\n'
                      '\n[stores.offsite]\nurl = "s3://ckpt/site"\nregion = "remote"\n'
                      f'endpoint_url = "{endpoint}"\n')
    with pytest.raises(ConfigError) as info:
        load_config(config)
    message = str(info.value)
    assert "\n" not in message and info.value.exit_code == 3
    assert f"endpoint_url is plain http to {host}, which is not loopback" in message
    assert "[stores.offsite]" in message and "write https://" in message


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:8333", "http://localhost:9000",
                                      "https://s3.example.org", ""])
def test_https_or_loopback_s3_endpoints_load(endpoint):
    assert parse_store("offsite", store_table(endpoint_url=endpoint), "w").endpoint_url == \
        endpoint


def test_a_store_ca_file_needs_an_https_endpoint_and_job_keys_exclude_a_key_file(tmp_path):
    with pytest.raises(ConfigError, match="ca_file is for an S3 endpoint behind TLS"):
        parse_store("o", store_table(endpoint_url="http://127.0.0.1:1", ca_file="/ca.pem"), "w")
    with pytest.raises(ConfigError, match="remove job_credentials"):
        parse_store("o", store_table(job_keys="per-run", job_credentials="/k.env"), "w")
    with pytest.raises(ConfigError, match="must be one of per-run"):
        parse_store("o", store_table(job_keys="per-bucket"), "w")
    loaded = parse_store("o", store_table(endpoint_url="https://h:1", ca_file="/ca.pem",
                                          job_keys="per-run"), "w")
    assert (loaded.ca_file, loaded.job_keys) == (Path("/ca.pem"), "per-run")


# --- what a run's key may do, and what a job is given (pure) -------------------------------

def test_a_runs_policy_writes_only_its_own_manifests_and_pointer_and_deletes_only_locks():
    statements = {s["Sid"]: s for s in run_policy("ckpt", "/site/", "run-a")["Statement"]}
    assert statements["WriteTheRunsObjects"]["Resource"] == [
        "arn:aws:s3:::ckpt/site/manifests/run-a/*", "arn:aws:s3:::ckpt/site/latest/run-a",
        "arn:aws:s3:::ckpt/site/run-packs/run-a/*", "arn:aws:s3:::ckpt/site/locks/*",
        "arn:aws:s3:::ckpt/site/outputs/run-a/*"]
    assert statements["DeleteOnlyPushLocks"]["Resource"] == ["arn:aws:s3:::ckpt/site/locks/*"]
    written = {a for s in statements.values() for a in s["Action"] if s["Effect"] == "Allow"}
    assert not written & {"s3:PutBucketPolicy", "s3:DeleteBucket", "s3:*", "iam:*"}


def test_run_user_names_fit_iam_and_keep_runs_and_stores_apart():
    one = StoreConfig("a", "s3://ckpt/site", "r")
    other = StoreConfig("b", "s3://ckpt/other", "r")
    names = {run_user_name(s, r) for s in (one, other) for r in ("run-a", "x" * 128)}
    assert len(names) == 4 and all(len(n) <= 64 for n in names)


class FakeMinter:
    def __init__(self):
        self.minted: list[tuple[str, str]] = []

    def mint(self, store: StoreConfig, run: str) -> dict[str, str]:
        self.minted.append((store.name, run))
        return {"AWS_ACCESS_KEY_ID": f"key-{run}", "AWS_SECRET_ACCESS_KEY": "s"}


def test_a_per_run_store_gives_each_job_its_runs_key_and_the_ca_path_never_the_daemons():
    store = StoreConfig("offsite", "s3://ckpt/site", "remote", "https://s3:1",
                        ca_file=Path("/etc/ca.pem"), job_keys="per-run")
    daemon = {"AWS_ACCESS_KEY_ID": "daemons", "AWS_SECRET_ACCESS_KEY": "x",
              "AWS_DEFAULT_REGION": "us-east-1"}
    minter = FakeMinter()
    env = job_environment(store, daemon, "run-a", minter)
    assert env == {"AWS_ACCESS_KEY_ID": "key-run-a", "AWS_SECRET_ACCESS_KEY": "s",
                   "AWS_DEFAULT_REGION": "us-east-1", "AWS_CA_BUNDLE": "/etc/ca.pem"}
    assert minter.minted == [("offsite", "run-a")]
    # A job that never trained names no run yet: no key at submission (the key reply
    # brings one, minted for the run its first lease names), never the daemon's.
    assert job_environment(store, daemon, "", minter) == {
        "AWS_DEFAULT_REGION": "us-east-1", "AWS_CA_BUNDLE": "/etc/ca.pem"}
    assert minter.minted == [("offsite", "run-a")]


def test_security_toml_signs_volume_and_filer_io_and_asks_every_port_for_a_certificate():
    tls = SeaweedTls(Path("/s3/security"), Path("/s3/s3.crt"), Path("/s3/s3.key"))
    keys = JwtKeys("a" * 64, "b" * 64, "c" * 64, "d" * 64)
    text = security_toml(keys, tls)
    import tomllib
    parsed = tomllib.loads(text)
    assert parsed["jwt"]["signing"]["key"] == "a" * 64
    assert parsed["jwt"]["signing"]["read"]["key"] == "b" * 64
    assert parsed["jwt"]["filer_signing"]["key"] == "c" * 64
    assert parsed["jwt"]["filer_signing"]["read"]["key"] == "d" * 64
    ca = "/s3/security/internal-ca.crt"
    assert parsed["grpc"]["ca"] == ca
    for part in ("master", "volume", "filer"):
        assert parsed["https"][part]["ca"] == ca  # a client certificate is asked for
        assert parsed["grpc"][part]["cert"] == "/s3/security/internal.crt"
    assert parsed["https"]["client"]["enabled"] is True


# --- a real server: the internals, as a local user without the server's certificate -------

def internal_ports(weed: RunningServer) -> dict[str, int]:
    s3_grpc, master, master_grpc, volume, volume_grpc, filer, filer_grpc = \
        weed.server.internal_ports
    return {"master": master, "master gRPC": master_grpc, "volume": volume,
            "volume gRPC": volume_grpc, "filer": filer, "filer gRPC": filer_grpc,
            "s3 gRPC": s3_grpc}


def http_over_tls(port: int, request: bytes, certificate: SeaweedTls | None) -> bytes:
    """`request` on a TLS connection to 127.0.0.1:`port`, with the server's own client
    certificate when `certificate` is given; the first bytes of the answer."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # any server
    if certificate is not None:
        context.load_cert_chain(certificate.internal_cert, certificate.internal_key)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        tls.sendall(request)
        return tls.recv(64)


def plain_http(port: int, request: bytes) -> bytes:
    """The first bytes of the answer to `request` in clear; b"" for a closed connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        try:
            raw.sendall(request)
            return raw.recv(64)
        except ConnectionResetError:
            return b""


def not_served(answer: bytes) -> bool:
    """A TLS server's answer to clear text: 400, or the connection closed."""
    return answer == b"" or answer.startswith((b"HTTP/1.0 400", b"HTTP/1.1 400"))


@needs_weed
@pytest.mark.slow
def test_master_volume_and_filer_refuse_reads_and_deletes_without_the_servers_certificate(weed):
    daemons = S3Store(S3_BUCKET, f"{S3_PREFIX}/internals", weed.client(DAEMONS))
    daemons.put("keys/r", b"secret")
    requests = [b"GET /dir/status HTTP/1.1\r\nHost: x\r\n\r\n",
                f"GET /col/delete?collection={S3_BUCKET} HTTP/1.1\r\nHost: x\r\n\r\n".encode(),
                b"GET /dir/lookup?volumeId=1 HTTP/1.1\r\nHost: x\r\n\r\n",
                f"DELETE /buckets/{S3_BUCKET}/ HTTP/1.1\r\nHost: x\r\n\r\n".encode()]
    for name, port in internal_ports(weed).items():
        for request in requests:
            with pytest.raises(ssl.SSLError, match="CERTIFICATE_REQUIRED|certificate required"):
                http_over_tls(port, request, None)
            # Plain http meets a TLS server: it is answered 400, or not at all.
            assert not_served(plain_http(port, request)), name
    assert daemons.get("keys/r") == b"secret"  # /col/delete deleted nothing
    # The refusal is the missing certificate: the server's own is let in.
    assert http_over_tls(internal_ports(weed)["master"], requests[0], weed.server.tls) \
        .startswith(b"HTTP/1.1 200")


@needs_weed
@pytest.mark.slow
@pytest.mark.root(reason="needs root to act as another user")
def test_the_servers_local_sockets_refuse_other_users(weed):
    """weed also serves its gRPC and filer on unix sockets in /tmp, mode 0755 root's: a
    user cannot connect to them."""
    ports = set(internal_ports(weed).values()) | {weed.server.s3_port}
    sockets = [p for p in Path("/tmp").glob("seaweedfs-*.sock")
               if int(p.stem.rsplit("-", 1)[1]) in ports]
    assert sockets
    probe = ("import socket, sys\nfor path in sys.argv[1:]:\n"
             "    s = socket.socket(socket.AF_UNIX)\n"
             "    try:\n        s.connect(path); print('OPEN', path)\n"
             "    except PermissionError:\n        pass\n")
    done = subprocess.run(["setpriv", "--reuid", "nobody", "--regid", "nogroup",
                           "--clear-groups", sys.executable, "-c", probe,
                           *map(str, sockets)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and done.stdout == "", done.stdout + done.stderr


@needs_weed
@pytest.mark.slow
def test_the_s3_port_speaks_tls_only_and_is_verified_against_the_configured_ca(weed):
    system_cas = make_s3_client(weed.server.endpoint, "us-east-1",
                                access_key_id=DAEMONS.access_key_id,
                                secret_access_key=DAEMONS.secret_access_key,
                                connect_timeout_s=2, read_timeout_s=5)
    with pytest.raises(Exception, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
        system_cas.list_buckets()
    assert not_served(plain_http(weed.server.s3_port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"))
    assert weed.client(DAEMONS).list_buckets()["Buckets"]


# --- a real server: run A's key against run B's objects -----------------------------------

def minted(weed: RunningServer, prefix: str, run: str, plan: TransferPlan = DEFAULT_PLAN
           ) -> tuple[S3Store, dict[str, str]]:
    config = StoreConfig("offsite", f"s3://{S3_BUCKET}/{prefix}", "remote",
                         weed.server.endpoint, ca_file=weed.ca_file, job_keys="per-run")
    env = job_environment(config, {**DAEMONS.env(), "AWS_DEFAULT_REGION": "us-east-1"}, run)
    client = make_s3_client(weed.server.endpoint, "us-east-1",
                            access_key_id=env["AWS_ACCESS_KEY_ID"],
                            secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                            connect_timeout_s=2, read_timeout_s=20, ca_file=env["AWS_CA_BUNDLE"])
    return S3Store(S3_BUCKET, prefix, client, plan=plan), env


def refused(call) -> str:
    with pytest.raises(S3Unavailable) as info:
        call()
    assert is_permanent(info.value) and "AccessDenied" in str(info.value), info.value
    return str(info.value)


@pytest.fixture
def prefix() -> str:
    return f"{S3_PREFIX}/runs-{random.getrandbits(64):016x}"


@needs_weed
@pytest.mark.slow
def test_run_as_key_cannot_overwrite_or_delete_run_bs_objects(weed, prefix):
    daemons = S3Store(S3_BUCKET, prefix, weed.client(DAEMONS))
    a, _ = minted(weed, prefix, "run-a")
    b, _ = minted(weed, prefix, "run-b")
    b.put("manifests/run-b/00000000000000000010", b"b's manifest")
    b.put("latest/run-b", b"b's pointer")
    b.put("run-packs/run-b/" + "cd" * 32, b"b's pack")
    daemons.put("packs/cd/" + "cd" * 32, b"a pack of the layout every run shared")
    for name in ("keys/run-b", "fences/run-b", "promoted/run-b/00000000000000000010"):
        daemons.put(name, b"b's " + name.encode())
    theirs = {name: daemons.get(name) for name in daemons.list("")}
    for name in theirs:
        refused(lambda name=name: a.put(name, b"evil"))
        refused(lambda name=name: a.delete(name))
    assert {name: daemons.get(name) for name in daemons.list("")} == theirs
    # Nor may A write under names of B's to come, or delete a pack.
    refused(lambda: a.put("manifests/run-b/00000000000000000020", b"evil"))
    refused(lambda: a.put("keys/run-a", b"a key only the daemons write"))
    refused(lambda: a.put("run-packs/run-b/" + "ef" * 32, b"evil"))
    refused(lambda: a.put("packs/ef/" + "ef" * 32, b"evil"))  # the layout before format 4
    a.put("run-packs/run-a/" + "ab" * 32, b"a's pack")
    refused(lambda: a.delete("run-packs/run-a/" + "ab" * 32))
    a.put("manifests/run-a/00000000000000000010", b"a's manifest")
    refused(lambda: a.delete("manifests/run-a/00000000000000000010"))  # nor its own
    token = f"{random.getrandbits(128):032x}"
    a.put(f"locks/{token}", b"{}")
    a.delete(f"locks/{token}")


@needs_weed
@pytest.mark.slow
def test_minting_a_runs_key_again_revokes_the_one_its_earlier_incarnation_got(weed, prefix):
    first, first_env = minted(weed, prefix, "run-c")
    first.put("latest/run-c", b"1")
    second, second_env = minted(weed, prefix, "run-c")
    assert first_env["AWS_ACCESS_KEY_ID"] != second_env["AWS_ACCESS_KEY_ID"]
    second.put("latest/run-c", b"2")

    def first_still_writes() -> bool:
        try:
            first.put("latest/run-c", b"1 again")
        except S3Unavailable:
            return False
        return True

    eventually(first_still_writes, lambda writes: not writes, timeout_s=10)


@needs_weed
@pytest.mark.slow
def test_a_runs_key_cannot_mint_keys_or_change_the_bucket(weed, prefix):
    _store, env = minted(weed, prefix, "run-d")
    iam = IamRunKeys(env)
    config = StoreConfig("offsite", f"s3://{S3_BUCKET}/{prefix}", "remote",
                         weed.server.endpoint, ca_file=weed.ca_file, job_keys="per-run")
    with pytest.raises(ConfigError, match="cannot mint run run-e's key"):
        iam.mint(config, "run-e")
    client = make_s3_client(weed.server.endpoint, "us-east-1",
                            access_key_id=env["AWS_ACCESS_KEY_ID"],
                            secret_access_key=env["AWS_SECRET_ACCESS_KEY"], ca_file=weed.ca_file)
    from botocore.exceptions import ClientError
    with pytest.raises(ClientError, match="AccessDenied"):
        client.put_bucket_policy(Bucket=S3_BUCKET, Policy=json.dumps(
            {"Version": "2012-10-17", "Statement": []}))


@needs_weed
@pytest.mark.slow
def test_a_moved_job_checkpoints_and_resumes_with_its_runs_key(weed, prefix):
    """The run's data key was made at home (the daemons' key here); the moved job writes
    packs (by multipart upload), its manifest and pointer, takes and drops its push lock,
    and reads back."""
    master, rng = random.Random(7).randbytes(32), random.Random(8)
    tensors = [Tensor(f"layer{i}.w", "uint8", (3 * MIB,), rng.randbytes(3 * MIB))
               for i in range(3)]
    daemons = S3Store(S3_BUCKET, prefix, weed.client(DAEMONS))
    Repository(daemons, master).write_checkpoint(
        "run-f", tensors, b"", Metadata(5, 5, 1, 2.5, "2026-12-06T03:00:00Z", "onprem", "1"))
    job, _ = minted(weed, prefix, "run-f", PART_PLAN)
    Repository(job, master, WriteOptions(pack_size=8 * MIB)).write_checkpoint(
        "run-f", tensors, b"x", Metadata(10, 10, 1, 2.0, "2026-12-06T03:05:00Z", "rented", "2"))
    assert Repository(job, master).read_checkpoint("run-f", 10).tensors == tensors
    assert job.list("locks/") == []
