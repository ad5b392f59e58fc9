"""The sandbox's S3 server (sandbox.seaweed): its config rendered without I/O, then a real
`weed server` of the tests' own, on free ports in a temporary directory, showing what each
identity may do, S3Store's paths against it, and objects surviving a restart."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from slurm_geo.ckpt import Metadata, Repository, Tensor, WriteOptions
from slurm_geo.ckpt.stores.retry import is_permanent
from slurm_geo.ckpt.stores.s3store import S3Store, S3Unavailable
from slurm_geo.ckpt.stores.transfer_plan import MIB, TransferPlan
from slurm_geo.errors import SandboxError
from slurm_geo.sandbox import Sandbox, service_account, stages
from slurm_geo.sandbox.layout import S3_BUCKET, S3_PREFIX, SandboxLayout
from slurm_geo.sandbox.seaweed import (
    S3Credentials,
    SeaweedServer,
    bucket_policy,
    ensure_credentials,
    hand_over,
    install_program,
    installed_program,
    prepare_sandbox_files,
    private_tmp,
    s3_config,
    sandbox_tls,
)
from slurm_geo.sandbox.sites import Site
from tests.helpers import eventually
from tests.seaweed_server import (
    DAEMONS,
    JOB,
    OTHER_BUCKET,
    OTHER_JOB,
    RunningServer,
    needs_weed,
)

PART = 5 * MIB
PART_PLAN = TransferPlan(part_size=PART, multipart_threshold=PART)


# --- rendering, no I/O ------------------------------------------------------------------------

@pytest.mark.parametrize("jobs, expected", [
    ({}, [("daemons", DAEMONS, ["Admin"])]),
    ({"ckpt": JOB}, [("daemons", DAEMONS, ["Admin"]),
                     ("job-ckpt", JOB, ["Read:ckpt", "List:ckpt", "Write:ckpt"])]),
    ({"b": OTHER_JOB, "a": JOB}, [("daemons", DAEMONS, ["Admin"]),
                                  ("job-a", JOB, ["Read:a", "List:a", "Write:a"]),
                                  ("job-b", OTHER_JOB, ["Read:b", "List:b", "Write:b"])]),
])
def test_each_bucket_has_its_own_job_identity_and_the_daemons_have_all(jobs, expected):
    identities = json.loads(s3_config(DAEMONS, jobs))["identities"]
    assert [(i["name"], S3Credentials(i["credentials"][0]["accessKey"],
                                      i["credentials"][0]["secretKey"]), i["actions"])
            for i in identities] == expected


@pytest.mark.parametrize("bucket, prefix, spared", [
    ("ckpt", "checkpoints", "arn:aws:s3:::ckpt/checkpoints/locks/*"),
    ("ckpt", "/site/a/", "arn:aws:s3:::ckpt/site/a/locks/*"),
    ("ckpt", "", "arn:aws:s3:::ckpt/locks/*"),
])
def test_the_policy_denies_the_job_every_delete_but_of_its_push_locks(bucket, prefix, spared):
    (statement,) = json.loads(bucket_policy(bucket, prefix))["Statement"]
    assert statement["Effect"] == "Deny" and statement["Action"] == ["s3:DeleteObject"]
    assert statement["Principal"] == {"AWS": [f"arn:aws:iam::000000000000:user/job-{bucket}"]}
    assert statement["NotResource"] == [spared]


def test_the_server_listens_on_the_declared_ports_only_and_keeps_the_disk_small():
    layout = SandboxLayout(Path("/srv/box"), 16800)
    server = SeaweedServer(layout.s3_data_dir, layout.s3_identities, layout.s3_port,
                           layout.s3_internal_ports)
    flags = dict(arg.lstrip("-").split("=", 1) for arg in server.argv("weed")[2:] if "=" in arg)
    ports = [int(value) for name, value in flags.items() if name.endswith((".port", ".grpc"))]
    assert sorted(ports) == [16840, 16841, 16842, 16843, 16844, 16846, 16847, 16848]
    assert (flags["s3.port.iceberg"], flags["s3.port.lance"]) == ("0", "0")
    assert flags["dir"] == "/srv/box/s3/offsite" and flags["s3.config"].startswith("/srv/box/s3/")
    assert flags["master.volumePreallocate"] == "false" and int(flags["volume.max"]) <= 160
    # Only the S3 gateway on the site's address; what checks no key on loopback alone.
    assert (flags["ip.bind"], flags["s3.ip.bind"]) == ("127.0.0.1", server.s3_address)
    others = {layout.mariadb_port, layout.port_base + 45, layout.port_base + 50}
    for cluster in layout.clusters:
        others |= {cluster.ctld_port, cluster.dbd_port, *cluster.node_ports, cluster.rest_port}
    assert not others & set(ports)


def test_credentials_round_trip_through_their_env_file_form():
    made = S3Credentials.generate("job")
    assert made.access_key_id.startswith("job-") and len(made.secret_access_key) == 64
    assert made.secret_access_key.isalnum()  # the env file is sourced by /bin/sh too
    assert S3Credentials.parse(made.env_text(), "f") == made
    assert made.env_text().splitlines()[0] == f"AWS_ACCESS_KEY_ID={made.access_key_id}"


def test_credentials_are_made_once_and_kept_private(tmp_path):
    path = tmp_path / "daemons.env"
    first = ensure_credentials(path, "daemons")
    assert ensure_credentials(path, "daemons") == first
    assert path.stat().st_mode & 0o777 == 0o600


def test_the_sandbox_makes_its_keys_once_and_hands_the_daemons_theirs(tmp_path):
    sandbox = Sandbox(tmp_path / "box")
    with pytest.raises(SandboxError, match="run `slurm-geo sandbox up`"):
        sandbox.env_lines("onprem")
    layout = sandbox.layout
    prepare_sandbox_files(layout)
    made = {path: path.read_text() for path in (layout.s3_daemon_credentials,
                                               layout.offsite_job_credentials,
                                               layout.s3_identities)}
    prepare_sandbox_files(layout)
    assert {path: path.read_text() for path in made} == made
    assert all(path.stat().st_mode & 0o777 == 0o600 for path in made)
    assert layout.s3_dir.stat().st_mode & 0o777 == 0o700 and layout.s3_data_dir.is_dir()
    daemons = S3Credentials.parse(made[layout.s3_daemon_credentials], "daemons")
    job = S3Credentials.parse(made[layout.offsite_job_credentials], "job")
    assert made[layout.s3_identities] == s3_config(daemons, {S3_BUCKET: job})
    assert f"export AWS_SECRET_ACCESS_KEY={daemons.secret_access_key}" in sandbox.env_lines(
        "onprem")
    assert job.secret_access_key != daemons.secret_access_key


def test_the_sandboxs_server_runs_as_its_account_with_a_tmp_of_its_own():
    """Dropped as the other daemons of a site are (setpriv), from the site's copy of weed,
    with its own directory bound over /tmp before it drops: weed's fixed socket names
    there are no other account's to take or reach."""
    layout = SandboxLayout(Path("/srv/box"), 20000)
    (daemon,) = [d for stage in stages.daemons_by_stage(layout, None, {}) for d in stage
                 if d.name == stages.S3_DAEMON]
    assert (daemon.user, daemon.group) == (service_account.S3_NAME, service_account.S3_NAME)
    command = daemon.command
    tmp = str(private_tmp(layout))
    assert command[:2] == ["nsenter", "--net=/run/netns/" + layout.namespace(Site.REMOTE)]
    assert command[2:9] == ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                            'mount --bind -- "$0" /tmp && exec "$@"']
    assert command[9] == tmp == "/srv/box/s3/tmp"
    assert command[10:16] == ["setpriv", "--reuid", service_account.S3_NAME, "--regid",
                              service_account.S3_NAME, "--clear-groups"]
    assert command[16] == str(installed_program(layout))
    assert not str(installed_program(layout)).startswith("/root")


@pytest.mark.root(reason="needs root to give files away")
def test_an_older_sandboxs_root_owned_server_files_are_handed_to_its_account(tmp_path):
    """A sandbox brought up before the server had an account of its own left its data,
    keys and identities root's: `up` hands them all over (the daemons' key excepted),
    private to the account, and the S3 directory only traversable by its group."""
    layout = SandboxLayout(tmp_path / "box", 20000)
    layout.root.mkdir()
    prepare_sandbox_files(layout)
    tls = sandbox_tls(layout)
    tls.s3_cert.write_text("cert")
    tls.s3_key.write_text("key")
    volume = layout.s3_data_dir / "vol" / "1.dat"  # as a root-run server left it
    volume.parent.mkdir()
    volume.write_text("objects")
    (layout.s3_data_dir / "link").symlink_to("/etc/passwd")
    account = service_account.ensure(service_account.S3_NAME)
    hand_over(layout, account.uid, account.gid)
    hand_over(layout, account.uid, account.gid)  # again: each `up` does

    def owner_mode(path: Path) -> tuple[int, int, int]:
        info = os.lstat(path)
        return info.st_uid, info.st_gid, info.st_mode & 0o7777

    mine = (account.uid, account.gid)
    assert owner_mode(layout.s3_dir) == (0, account.gid, 0o710)
    assert owner_mode(layout.s3_daemon_credentials) == (0, 0, 0o600)
    for directory in (layout.s3_data_dir, tls.config_dir, private_tmp(layout)):
        assert owner_mode(directory) == (*mine, 0o700)
    for path in (layout.s3_identities, tls.s3_cert, tls.s3_key, *tls.config_dir.iterdir()):
        assert owner_mode(path) == (*mine, 0o600), path
    assert owner_mode(volume)[:2] == owner_mode(volume.parent)[:2] == mine
    assert owner_mode(layout.s3_data_dir / "link")[:2] == mine  # the link, not its target
    assert os.stat("/etc/passwd").st_uid == 0


def test_weed_is_copied_once_where_its_account_can_run_it(tmp_path):
    source = tmp_path / "weed"
    source.write_bytes(b"binary")
    target = tmp_path / "site" / "weed"
    target.parent.mkdir()
    assert install_program(source, target) is True
    assert target.read_bytes() == b"binary" and target.stat().st_mode & 0o777 == 0o755
    assert install_program(source, target) is False
    source.write_bytes(b"binary, a new version")
    assert install_program(source, target) is True
    assert target.read_bytes() == b"binary, a new version"


# --- a real server (tests.seaweed_server) ------------------------------------------------------

@pytest.fixture
def prefix() -> str:
    return f"{S3_PREFIX}/tests/{random.getrandbits(64):016x}"


def store(weed: RunningServer, credentials: S3Credentials, prefix: str,
          bucket: str = S3_BUCKET, **options) -> S3Store:
    return S3Store(bucket, prefix, weed.client(credentials), **options)


def read_or_none(store: S3Store, name: str) -> bytes | None:
    try:
        return store.get(name)
    except S3Unavailable as exc:
        if is_permanent(exc):
            raise
        return None


def refused(call) -> S3Unavailable:
    with pytest.raises(S3Unavailable) as info:
        call()
    assert is_permanent(info.value), info.value
    return info.value


@needs_weed
@pytest.mark.slow
def test_a_job_key_reads_lists_and_writes_its_bucket(weed, prefix):
    job = store(weed, JOB, prefix)
    job.put("keys/r", b"key")
    job.put("packs/ab/cd", b"pack")
    assert (job.get("keys/r"), job.list(""), job.exists("packs/ab/cd")) == (
        b"key", ["keys/r", "packs/ab/cd"], True)


@needs_weed
@pytest.mark.slow
@pytest.mark.parametrize("operation", ["put", "get", "list"])
def test_a_job_key_is_refused_on_another_bucket(weed, prefix, operation):
    store(weed, DAEMONS, prefix, OTHER_BUCKET).put("keys/r", b"theirs")
    theirs = store(weed, JOB, prefix, OTHER_BUCKET)
    calls = {"put": lambda: theirs.put("keys/r", b"mine"), "get": lambda: theirs.get("keys/r"),
             "list": lambda: theirs.list("")}
    error = refused(calls[operation])
    assert "AccessDenied" in str(error) and "AWS_ACCESS_KEY_ID" in str(error)
    assert f"'{OTHER_BUCKET}'" in str(error)
    assert store(weed, DAEMONS, prefix, OTHER_BUCKET).get("keys/r") == b"theirs"


@needs_weed
@pytest.mark.slow
@pytest.mark.parametrize("name", ["packs/ab/{}", "manifests/run-{}/0000000010", "latest/run-{}",
                                  "fences/run-{}"])
def test_a_job_key_is_refused_on_delete_but_of_its_push_locks(weed, name):
    """In the store the policy names (S3_PREFIX), as the sandbox's moved jobs write it."""
    token = f"{random.getrandbits(128):032x}"
    job, name = store(weed, JOB, S3_PREFIX), name.format(token)
    job.put(name, b"x")
    assert "AccessDenied" in str(refused(lambda: job.delete(name)))
    batch = weed.client(JOB).delete_objects(
        Bucket=S3_BUCKET, Delete={"Objects": [{"Key": f"{S3_PREFIX}/{name}"}]})
    assert [e["Code"] for e in batch.get("Errors", ())] == ["AccessDenied"]
    assert job.get(name) == b"x"
    job.put(f"locks/{token}", b"{}")
    job.delete(f"locks/{token}")
    assert not job.exists(f"locks/{token}")


@needs_weed
@pytest.mark.slow
def test_a_moved_job_writes_and_reads_a_checkpoint_with_its_key(weed):
    """Writing takes a push lock and deletes it (docs/format.md §8.1): the one delete a job
    key may do."""
    job = store(weed, JOB, S3_PREFIX, plan=PART_PLAN)
    run = f"run-{random.getrandbits(64):016x}"
    master, rng = random.Random(7).randbytes(32), random.Random(8)
    tensors = [Tensor(f"layer{i}.w", "uint8", (3 * MIB,), rng.randbytes(3 * MIB))
               for i in range(3)]
    metadata = Metadata(10, 10, 1, 2.5, "2026-11-29T15:02:11Z", "rented", "4711")
    locks_before = job.list("locks/")
    Repository(job, master, WriteOptions(pack_size=8 * MIB)).write_checkpoint(
        run, tensors, b"extra", metadata)
    assert Repository(job, master).read_checkpoint(run, 10).tensors == tensors
    assert job.list("locks/") == locks_before


@needs_weed
@pytest.mark.slow
def test_the_daemons_key_does_everything(weed, prefix):
    daemons = store(weed, DAEMONS, prefix)
    daemons.put("packs/ab/cd", b"x")
    daemons.delete("packs/ab/cd")
    assert not daemons.exists("packs/ab/cd")
    client = weed.client(DAEMONS)
    client.create_bucket(Bucket="made-by-daemons")
    client.put_bucket_policy(Bucket="made-by-daemons",
                             Policy=bucket_policy("made-by-daemons", ""))
    client.delete_bucket_policy(Bucket="made-by-daemons")
    client.delete_bucket(Bucket="made-by-daemons")


@needs_weed
@pytest.mark.slow
def test_a_wrong_secret_and_a_missing_bucket_are_permanent_failures(weed, prefix):
    forged = S3Credentials(JOB.access_key_id, "f" * 64)
    assert "SignatureDoesNotMatch" in str(refused(lambda: store(weed, forged, prefix).list("")))
    missing = store(weed, DAEMONS, prefix, "no-such-bucket")
    assert "create it" in str(refused(lambda: missing.put("keys/r", b"x")))


@needs_weed
@pytest.mark.slow
@pytest.mark.parametrize("change, uploaded", [(None, [3, 4]), ("all", [1, 2, 3, 4])])
def test_a_multipart_put_cut_by_a_crash_resumes_with_a_job_key(weed, prefix, change, uploaded):
    """Resuming lists the unfinished upload and its parts; a fresh start aborts it."""
    job = store(weed, JOB, prefix, plan=PART_PLAN)
    client = job._client
    first = random.Random(1).randbytes(3 * PART + 1000)
    sent: list[int] = []

    def count_or_crash(params, **_kwargs):
        if len(sent) == 2:
            raise KeyboardInterrupt
        sent.append(params["PartNumber"])

    client.meta.events.register("provide-client-params.s3.UploadPart", count_or_crash)
    with pytest.raises(KeyboardInterrupt):
        job.put("packs/ab/big", first)
    client.meta.events.unregister("provide-client-params.s3.UploadPart", count_or_crash)
    second = random.Random(2).randbytes(len(first)) if change == "all" else first

    sent.clear()
    client.meta.events.register("provide-client-params.s3.UploadPart",
                                lambda params, **_kw: sent.append(params["PartNumber"]))
    job.put("packs/ab/big", second)
    assert sent == uploaded and job.get("packs/ab/big") == second
    uploads = client.list_multipart_uploads(Bucket=S3_BUCKET, Prefix=f"{prefix}/")
    assert uploads.get("Uploads", []) == []


@needs_weed
@pytest.mark.slow
def test_a_write_conditional_on_absence_is_refused_over_an_object(weed, prefix):
    client, key = weed.client(JOB), f"{prefix}/packs/ab/cd"
    client.put_object(Bucket=S3_BUCKET, Key=key, Body=b"first", IfNoneMatch="*")
    from botocore.exceptions import ClientError

    with pytest.raises(ClientError) as info:
        client.put_object(Bucket=S3_BUCKET, Key=key, Body=b"second", IfNoneMatch="*")
    assert info.value.response["Error"]["Code"] == "PreconditionFailed"
    assert client.get_object(Bucket=S3_BUCKET, Key=key)["Body"].read() == b"first"


@needs_weed
@pytest.mark.slow
def test_objects_and_the_policy_survive_a_kill_and_a_start_on_the_same_directory(weed, prefix):
    job = store(weed, JOB, prefix)
    job.put("packs/ab/cd", b"kept")
    weed.kill()
    weed.start(create_buckets=False)  # nor sets the policy again
    job = store(weed, JOB, prefix)
    # Its S3 port opens before its volume server has reported the volumes to the master:
    # until then a read is a 500 (retryable; RetryingStore's job in slurm-geo).
    assert eventually(lambda: read_or_none(job, "packs/ab/cd"), lambda data: data is not None,
                      30) == b"kept"
    refused(lambda: job.delete("packs/ab/cd"))
