"""S3Store against the sandbox's real S3 endpoint (SeaweedFS), RetryingStore against
fakes, and open_store's URL forms. The conformance suite is in test_ckpt_store.py."""

from __future__ import annotations

import random
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from botocore.exceptions import (
    ClientError,
    EndpointConnectionError,
    NoCredentialsError,
    ReadTimeoutError,
)

from slurm_geo.ckpt import (
    Metadata,
    ObjectMissing,
    Repository,
    StoreUnavailable,
    Tensor,
    UnsafeObjectName,
    WriteOptions,
)
from slurm_geo.ckpt.stores.open_store import ACCEPTED_FORMS, open_store
from slurm_geo.ckpt.stores.retry import RetryingStore, is_permanent
from slurm_geo.ckpt.stores.s3store import S3Store, S3Unavailable, classify_s3_error, make_s3_client
from slurm_geo.ckpt.stores.store import LocalDirStore
from slurm_geo.ckpt.stores.transfer_plan import (
    DEFAULT_MULTIPART_THRESHOLD,
    DEFAULT_PART_SIZE,
    MIB,
    TransferPlan,
)
from slurm_geo.errors import ConfigError
from slurm_geo.sandbox.layout import S3_BUCKET
from tests.helpers import stored_packs

PART = 5 * MIB  # the smallest part S3 accepts
sandbox_only = pytest.mark.sandbox


@contextmanager
def api_calls(client, operation: str, crash_after: int | None = None) -> Iterator[list[dict]]:
    """Records the parameters of each `operation` call; the call after `crash_after` raises
    KeyboardInterrupt, standing for the process dying there."""
    calls: list[dict] = []

    def record(params, **_kwargs):
        if crash_after is not None and len(calls) >= crash_after:
            raise KeyboardInterrupt
        calls.append(dict(params))

    event = f"provide-client-params.s3.{operation}"
    client.meta.events.register(event, record)
    try:
        yield calls
    finally:
        client.meta.events.unregister(event, record)


def unfinished_uploads(client, key: str) -> list[str]:
    uploads = client.list_multipart_uploads(Bucket=S3_BUCKET, Prefix=key).get("Uploads", ())
    return [u["UploadId"] for u in uploads if u["Key"] == key]


# --- S3Store --------------------------------------------------------------------------------

@sandbox_only
def test_objects_are_keys_under_the_prefix_and_prefixes_are_separate(s3_client, s3_prefix):
    store = S3Store(S3_BUCKET, s3_prefix + "/", s3_client)
    other = S3Store(S3_BUCKET, s3_prefix + "/other", s3_client)
    store.put("keys/r", b"one")
    other.put("keys/r", b"two")
    body = s3_client.get_object(Bucket=S3_BUCKET, Key=f"{s3_prefix}/keys/r")["Body"].read()
    assert (body, store.get("keys/r"), other.get("keys/r")) == (b"one", b"one", b"two")
    assert other.list("") == ["keys/r"]
    assert store.list("") == ["keys/r", "other/keys/r"]


@sandbox_only
def test_list_pages_through_every_key_and_skips_foreign_ones(s3_client, s3_prefix):
    store = S3Store(S3_BUCKET, s3_prefix, s3_client, list_page_size=2)
    for i in range(5):
        store.put(f"packs/0{i}", b"x")
    for foreign in ("packs/.upload.tmp", "packs/with space"):
        s3_client.put_object(Bucket=S3_BUCKET, Key=f"{s3_prefix}/{foreign}", Body=b"x")
    with api_calls(s3_client, "ListObjectsV2") as calls:
        assert store.list("packs/") == [f"packs/0{i}" for i in range(5)]
    assert len(calls) == 4  # 7 keys, 2 a page


def test_sizes_come_from_one_listing_without_foreign_keys():
    from botocore.stub import Stubber

    client = make_s3_client("http://127.0.0.1:9", "us-east-1", access_key_id="a",
                            secret_access_key="b")
    store = S3Store("bkt", "site", client)
    with Stubber(client) as stub:
        stub.add_response("list_objects_v2", {"Contents": [
            {"Key": "site/packs/ab", "Size": 7}, {"Key": "site/packs/with space", "Size": 1},
            {"Key": "site/packs/cd", "Size": 0}]}, {"Bucket": "bkt", "Prefix": "site/packs/",
                                                    "MaxKeys": 1000})
        assert store.sizes("packs/") == {"packs/ab": 7, "packs/cd": 0}


@sandbox_only
@pytest.mark.parametrize("change, uploaded", [
    (None, [3, 4]),  # same bytes: only the parts the crash cut off
    (0, [1, 3, 4]),  # part 1 differs: it too
    ("all", [1, 2, 3, 4]),  # nothing reusable: a fresh upload, the old one aborted
])
def test_a_put_cut_by_a_crash_resumes_with_the_missing_parts(s3_client, s3_prefix, change,
                                                             uploaded):
    store = S3Store(S3_BUCKET, s3_prefix, s3_client,
                    plan=TransferPlan(part_size=PART, multipart_threshold=PART))
    first = random.Random(1).randbytes(3 * PART + 1000)
    with api_calls(s3_client, "UploadPart", crash_after=2), pytest.raises(KeyboardInterrupt):
        store.put("packs/ab/big", first)
    assert not store.exists("packs/ab/big")
    key = f"{s3_prefix}/packs/ab/big"
    assert len(unfinished_uploads(s3_client, key)) == 1

    second = bytearray(first)
    if change == "all":
        second = bytearray(random.Random(2).randbytes(len(first)))
    elif change is not None:
        second[change] ^= 1
    with api_calls(s3_client, "UploadPart") as calls:
        store.put("packs/ab/big", second)
    assert [c["PartNumber"] for c in calls] == uploaded
    assert store.get("packs/ab/big") == second
    assert unfinished_uploads(s3_client, key) == []


@sandbox_only
def test_small_objects_take_one_put_and_large_ones_multipart(s3_client, s3_store):
    with api_calls(s3_client, "PutObject") as puts, \
            api_calls(s3_client, "UploadPart") as parts:
        s3_store.put("small", b"x" * (DEFAULT_MULTIPART_THRESHOLD - 1))
        s3_store.put("large", b"y" * DEFAULT_MULTIPART_THRESHOLD)  # in default 8 MiB parts
    assert (len(puts), len(parts)) == (1, DEFAULT_MULTIPART_THRESHOLD // DEFAULT_PART_SIZE)
    assert s3_store.get("large") == b"y" * DEFAULT_MULTIPART_THRESHOLD


def test_parts_below_the_s3_minimum_are_refused():
    with pytest.raises(ValueError, match="at least"):
        TransferPlan(part_size=MIB)


@sandbox_only
def test_a_missing_bucket_is_a_permanent_failure_naming_it(s3_client):
    bucket = f"no-such-bucket-{uuid.uuid4().hex[:8]}"
    with pytest.raises(S3Unavailable, match=f"'{bucket}'.*create it") as info:
        S3Store(bucket, "", s3_client).put("keys/r", b"x")
    assert is_permanent(info.value) and info.value.name == "keys/r"


@sandbox_only
def test_a_missing_object_is_missing_not_unavailable(s3_store):
    with pytest.raises(ObjectMissing):
        s3_store.get("keys/never")
    assert not s3_store.exists("keys/never")


def client_error(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "m"},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")


@pytest.mark.parametrize("error, expected, permanent, hint", [
    (client_error("NoSuchKey", 404), ObjectMissing, None, "does not exist"),
    (client_error("404", 404), ObjectMissing, None, "does not exist"),
    (client_error("SlowDown", 503), S3Unavailable, False, "retry later"),
    (client_error("InternalError", 500), S3Unavailable, False, "retry later"),
    (client_error("", 502), S3Unavailable, False, "retry later"),
    (client_error("TooManyRequests", 429), S3Unavailable, False, "retry later"),
    (client_error("BadDigest", 400), S3Unavailable, False, "retry later"),
    (client_error("AccessDenied", 403), S3Unavailable, True, "AWS_ACCESS_KEY_ID"),
    (client_error("InvalidAccessKeyId", 403), S3Unavailable, True, "AWS_ENDPOINT_URL"),
    (client_error("NoSuchBucket", 404), S3Unavailable, True, "create it"),
    (client_error("PermanentRedirect", 301), S3Unavailable, True, "AWS_DEFAULT_REGION"),
    (client_error("InvalidArgument", 400), S3Unavailable, True, "refused"),
    (EndpointConnectionError(endpoint_url="http://x"), S3Unavailable, False, "endpoint URL"),
    (ReadTimeoutError(endpoint_url="http://x"), S3Unavailable, False, "network"),
    (NoCredentialsError(), S3Unavailable, True, "AWS_PROFILE"),
])
def test_botocore_failures_are_classified(error, expected, permanent, hint):
    classified = classify_s3_error(error, "bkt", "packs/ab/cd")
    assert type(classified) is expected and classified.name == "packs/ab/cd"
    assert hint in str(classified)
    if permanent is not None:
        assert is_permanent(classified) is permanent and "'bkt'" in str(classified)


@contextmanager
def silent_server() -> Iterator[str]:
    """An endpoint that accepts connections and never answers."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"


@pytest.mark.parametrize("endpoint", ["refused", "silent"])
def test_an_unreachable_endpoint_fails_once_within_its_timeout(endpoint):
    with silent_server() as silent:
        url = silent if endpoint == "silent" else "http://127.0.0.1:9"
        client = make_s3_client(url, "us-east-1", access_key_id="a", secret_access_key="b",
                                connect_timeout_s=0.5, read_timeout_s=0.5)
        sends: list[str] = []
        client.meta.events.register("before-send.s3.GetObject", lambda **_kw: sends.append("x"))
        start = time.monotonic()
        with pytest.raises(StoreUnavailable) as info:
            S3Store(S3_BUCKET, "p", client).get("keys/r")
    assert time.monotonic() - start < 3 and len(sends) == 1  # botocore did not retry
    assert not is_permanent(info.value) and "endpoint URL" in str(info.value)


@pytest.fixture
def sandbox_env(monkeypatch, s3_endpoint, s3_env):
    """The variables `slurm-geo sandbox env` exports: boto3 finds endpoint and credentials."""
    for variable, value in {"AWS_ENDPOINT_URL": s3_endpoint, **s3_env}.items():
        monkeypatch.setenv(variable, value)


@sandbox_only
def test_a_repository_on_s3_round_trips_and_names_a_damaged_pack(s3_prefix, sandbox_env):
    store = open_store(f"s3://{S3_BUCKET}/{s3_prefix}")
    assert isinstance(store, RetryingStore) and isinstance(store.inner, S3Store)
    master, rng = random.Random(7).randbytes(32), random.Random(8)
    tensors = [Tensor(f"layer{i}.w", "uint8", (40_000,), rng.randbytes(40_000)) for i in range(4)]
    step = Metadata(10, 10, 1, 2.5, "2026-11-29T15:02:11Z", "onprem", "4711")
    Repository(store, master, WriteOptions(pack_size=64 * 1024)).write_checkpoint(
        "run-1", tensors, b"extra", step)
    repo = Repository(store, master)
    assert repo.read_checkpoint("run-1", 10).tensors == tensors
    assert repo.verify("run-1", 10) == []

    packs = stored_packs(store)
    damaged = bytearray(store.get(packs[1]))
    damaged[len(damaged) // 2] ^= 0x01
    store.put(packs[1], damaged)
    assert len(packs) > 1
    assert [fault.name for fault in Repository(store, master).verify("run-1", 10)] == [packs[1]]


# --- RetryingStore --------------------------------------------------------------------------

TRANSIENT = StoreUnavailable("packs/ab/cd", "connection reset")
PERMANENT = S3Unavailable("packs/ab/cd", "bkt", "403: denied", "fix it", permanent=True)
MISSING = ObjectMissing("packs/ab/cd")
UNSAFE = UnsafeObjectName("../x", "no")


class FlakyStore:
    """Fails each call with the next queued error until none is left, then answers."""

    def __init__(self, failures):
        self.failures = list(failures)
        self.calls = 0

    def _answer(self, result):
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        return result

    def put(self, name, data):
        return self._answer(None)

    def get(self, name):
        return self._answer(b"bytes of " + name.encode())

    def list(self, prefix):
        return self._answer([prefix + "a"])

    def delete(self, name):
        return self._answer(None)

    def exists(self, name):
        return self._answer(True)

    def sizes(self, prefix):
        return self._answer({prefix + "a": 1})


@pytest.mark.parametrize("failures, raised, calls, sleeps", [
    ([], None, 1, []),
    ([TRANSIENT] * 2, None, 3, [0.2, 0.4]),
    ([TRANSIENT] * 4, None, 5, [0.2, 0.4, 0.8, 1.6]),
    ([TRANSIENT] * 5, StoreUnavailable, 5, [0.2, 0.4, 0.8, 1.6]),  # gives up at `attempts`
    ([PERMANENT], S3Unavailable, 1, []),
    ([MISSING], ObjectMissing, 1, []),
    ([UNSAFE], UnsafeObjectName, 1, []),
    ([TRANSIENT, MISSING], ObjectMissing, 2, [0.2]),
    ([TRANSIENT, PERMANENT], S3Unavailable, 2, [0.2]),
])
def test_only_transient_failures_are_retried(failures, raised, calls, sleeps):
    inner, slept = FlakyStore(failures), []
    store = RetryingStore(inner, attempts=5, sleep=slept.append, random=lambda: 1.0)
    if raised is None:
        assert store.get("k") == b"bytes of k"
    else:
        with pytest.raises(raised):
            store.get("k")
    assert (inner.calls, slept) == (calls, pytest.approx(sleeps))


def test_delays_are_capped_and_jittered():
    slept: list[float] = []
    store = RetryingStore(FlakyStore([TRANSIENT] * 6), attempts=7, base_delay_s=0.5,
                          max_delay_s=3, sleep=slept.append, random=lambda: 0.5)
    store.exists("k")
    assert slept == pytest.approx([0.25, 0.5, 1, 1.5, 1.5, 1.5])


@pytest.mark.parametrize("operation, args, result", [
    ("put", ("k", b"x"), None), ("get", ("k",), b"bytes of k"), ("list", ("p/",), ["p/a"]),
    ("delete", ("k",), None), ("exists", ("k",), True), ("sizes", ("p/",), {"p/a": 1}),
])
def test_every_operation_is_retried(operation, args, result):
    inner = FlakyStore([TRANSIENT])
    store = RetryingStore(inner, sleep=lambda _s: None)
    assert getattr(store, operation)(*args) == result and inner.calls == 2


# --- open_store -----------------------------------------------------------------------------

def test_a_file_url_opens_the_directory(tmp_path):
    store = open_store(f"file://{tmp_path}")
    assert isinstance(store, LocalDirStore) and store.root == Path(tmp_path).resolve()


def test_an_s3_url_opens_a_retrying_s3_store():
    store = open_store("s3://slurm-geo/site/checkpoints/", "http://127.0.0.1:9", "us-east-1")
    assert isinstance(store, RetryingStore) and isinstance(store.inner, S3Store)
    assert (store.inner.bucket, store.inner.prefix) == ("slurm-geo", "site/checkpoints/")


def test_keys_given_to_open_store_sign_its_requests_whatever_the_environment(monkeypatch):
    """A process holding keys for several stores (the drill: the daemons') passes them, not
    its environment: boto3 must take them over AWS_* variables, which it reads otherwise."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "from-the-environment")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "its-secret")
    given = open_store("s3://slurm-geo/x", "http://127.0.0.1:9", "us-east-1",
                       access_key_id="daemons-key", secret_access_key="daemons-secret")
    ambient = open_store("s3://slurm-geo/x", "http://127.0.0.1:9", "us-east-1")
    keys_of = [store.inner._client._request_signer._credentials
               for store in (given, ambient)]
    assert [(k.access_key, k.secret_key) for k in keys_of] == [
        ("daemons-key", "daemons-secret"), ("from-the-environment", "its-secret")]


@pytest.mark.parametrize("url", [
    "", "/plain/path", "file://relative/path", "http://host/x", "s3://", "s3:/bucket",
    "s3://Bad_Bucket/x", "s3://bucket/../x", "s3://bucket/a b", "s3://bucket/x?versionId=1",
])
def test_a_bad_url_is_one_config_error_naming_it(url):
    with pytest.raises(ConfigError) as info:
        open_store(url)
    assert repr(url) in str(info.value) and ACCEPTED_FORMS in str(info.value)


@pytest.mark.parametrize("endpoint, region", [("no-scheme", None), ("http://x", "bad region!")])
def test_a_bad_endpoint_or_region_is_a_config_error(endpoint, region):
    with pytest.raises(ConfigError, match="check the endpoint URL"):
        open_store("s3://slurm-geo/x", endpoint, region)
