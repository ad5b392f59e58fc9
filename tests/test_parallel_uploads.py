"""An S3 multipart upload's parts `streams` at once, against a real S3 server of the
module's own (the `weed` fixture). docs/stores.md."""

from __future__ import annotations

import random
import threading

import pytest
from botocore.exceptions import ClientError

from slurm_geo.ckpt.retry import is_permanent
from slurm_geo.ckpt.s3store import S3Store, S3Unavailable
from slurm_geo.ckpt.transfer_plan import MIB, TransferPlan
from slurm_geo.sandbox.layout import S3_BUCKET, S3_PREFIX
from tests.seaweed_server import DAEMONS, needs_weed

PART = 5 * MIB
FOUR_STREAMS = TransferPlan(streams=4, part_size=PART, multipart_threshold=PART)


class PartCountingClient:
    """The real boto3 client, with its UploadPart calls counted and the most in flight at
    once; the first `together` calls wait for one another (so they prove that many ran at
    once), and part number `fail` then answers the S3 error `code`."""

    def __init__(self, client, together: int = 0, fail: int | None = None,
                 code: tuple[str, int] = ("InternalError", 500)):
        self._client = client
        self._together = threading.Barrier(together, timeout=20) if together else None
        self._fail = fail
        self._code = code
        self._lock = threading.Lock()
        self.sent: list[int] = []
        self.in_flight = self.most_in_flight = 0

    def upload_part(self, **params):
        with self._lock:
            self.sent.append(params["PartNumber"])
            among_first = self._together is not None and len(self.sent) <= self._together.parties
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if among_first:
                self._together.wait()  # type: ignore[union-attr]
            if params["PartNumber"] == self._fail:
                code, status = self._code
                raise ClientError({"Error": {"Code": code, "Message": "injected"},
                                   "ResponseMetadata": {"HTTPStatusCode": status}}, "UploadPart")
            return self._client.upload_part(**params)
        finally:
            with self._lock:
                self.in_flight -= 1

    def __getattr__(self, name):
        return getattr(self._client, name)


@pytest.fixture
def prefix() -> str:
    return f"{S3_PREFIX}/tests/{random.getrandbits(64):016x}"


def stored_parts(client, key: str) -> set[int]:
    (upload,) = [u for u in client.list_multipart_uploads(Bucket=S3_BUCKET, Prefix=key)
                 .get("Uploads", ()) if u["Key"] == key]
    parts = client.list_parts(Bucket=S3_BUCKET, Key=key, UploadId=upload["UploadId"])
    return {p["PartNumber"] for p in parts.get("Parts", ())}


def unfinished_uploads(client, key: str) -> list[dict]:
    uploads = client.list_multipart_uploads(Bucket=S3_BUCKET, Prefix=key).get("Uploads", ())
    return [u for u in uploads if u["Key"] == key]


@needs_weed
@pytest.mark.slow
def test_a_multipart_upload_sends_its_parts_four_at_once_and_makes_the_object(weed, prefix):
    client = PartCountingClient(weed.client(DAEMONS), together=4)
    store = S3Store(S3_BUCKET, prefix, client, plan=FOUR_STREAMS)
    data = random.Random(1).randbytes(6 * PART + 1000)  # 7 parts
    store.put("packs/ab/big", data)
    assert sorted(client.sent) == list(range(1, 8)) and client.most_in_flight == 4
    assert store.get("packs/ab/big") == data
    assert unfinished_uploads(client, f"{prefix}/packs/ab/big") == []


@needs_weed
@pytest.mark.slow
@pytest.mark.parametrize("code, permanent", [(("InternalError", 500), False),
                                             (("AccessDenied", 403), True)])
def test_a_failing_part_is_raised_classified_and_the_next_put_sends_only_what_is_missing(
        weed, prefix, code, permanent):
    key, data = f"{prefix}/packs/ab/big", random.Random(2).randbytes(6 * PART + 1000)
    failing = PartCountingClient(weed.client(DAEMONS), together=4, fail=3, code=code)
    with pytest.raises(S3Unavailable) as info:
        S3Store(S3_BUCKET, prefix, failing, plan=FOUR_STREAMS).put("packs/ab/big", data)
    assert is_permanent(info.value) is permanent and info.value.name == "packs/ab/big"
    assert code[0] in str(info.value)
    store = S3Store(S3_BUCKET, prefix, weed.client(DAEMONS), plan=FOUR_STREAMS)
    assert not store.exists("packs/ab/big") and store.list("packs/") == []  # nothing half-seen
    stored = stored_parts(store._client, key)
    assert {1, 2, 4} <= stored and 3 not in stored  # the three beside it finished

    resumed = PartCountingClient(weed.client(DAEMONS))
    S3Store(S3_BUCKET, prefix, resumed, plan=FOUR_STREAMS).put("packs/ab/big", data)
    assert sorted(resumed.sent) == sorted(set(range(1, 8)) - stored)
    assert store.get("packs/ab/big") == data
    assert unfinished_uploads(store._client, key) == []
