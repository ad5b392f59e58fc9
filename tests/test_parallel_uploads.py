"""Transfers `streams` at once: an S3 multipart upload's parts against a real S3 server of
the module's own (the `weed` fixture), a checkpoint copy's packs, and checkpoint-sync's
attempt recording what its copy's threads put. docs/stores.md, docs/checkpoint-sync.md."""

from __future__ import annotations

import random
import threading
import time

import pytest
from botocore.exceptions import ClientError

from slurm_geo.ckpt import LocalDirStore, Metadata, Repository, Tensor, WriteOptions
from slurm_geo.ckpt.errors import StoreUnavailable
from slurm_geo.ckpt.format.names import PACK_PREFIXES, key_name, manifest_name
from slurm_geo.ckpt.ops.replicate import copy_checkpoint
from slurm_geo.ckpt.stores.open_store import paced
from slurm_geo.ckpt.stores.pacing import TokenBucket
from slurm_geo.ckpt.stores.retry import is_permanent
from slurm_geo.ckpt.stores.s3store import S3Store, S3Unavailable
from slurm_geo.ckpt.stores.transfer_plan import MIB, TransferPlan
from slurm_geo.sandbox.layout import S3_BUCKET, S3_PREFIX
from slurm_geo.sync.state import StateDB, Status
from slurm_geo.sync.worker import Attempt, Guard, Interrupted, Limits, Outcome, Route
from tests.helpers import stored_packs
from tests.seaweed_server import DAEMONS, needs_weed

PART = 5 * MIB
FOUR_STREAMS = TransferPlan(streams=4, part_size=PART, multipart_threshold=PART)
KEY = bytes(range(32))
RUN = "run"
STEP = 10


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
    assert not store.exists("packs/ab/big") and stored_packs(store) == []  # nothing half-seen
    stored = stored_parts(store._client, key)
    assert {1, 2, 4} <= stored and 3 not in stored  # the three beside it finished

    resumed = PartCountingClient(weed.client(DAEMONS))
    S3Store(S3_BUCKET, prefix, resumed, plan=FOUR_STREAMS).put("packs/ab/big", data)
    assert sorted(resumed.sent) == sorted(set(range(1, 8)) - stored)
    assert store.get("packs/ab/big") == data
    assert unfinished_uploads(store._client, key) == []


# --- copy_checkpoint, packs `streams` at once -------------------------------------------------

class RecordingStore:
    """`inner`, recording each put's start and end (name, thread) in order; the first
    `together` pack puts wait for one another, so they prove that many ran at once."""

    def __init__(self, inner, together: int = 0, on_pack_put=lambda count: None):
        self.inner = inner
        self.events: list[tuple[str, str, threading.Thread]] = []
        self._together = threading.Barrier(together, timeout=20) if together else None
        self._on_pack_put = on_pack_put
        self._lock = threading.Lock()
        self._pack_puts = 0

    def put(self, name, data):
        with self._lock:
            self.events.append(("start", name, threading.current_thread()))
            is_pack = name.startswith(PACK_PREFIXES)
            self._pack_puts += is_pack
            count = self._pack_puts
        if is_pack and self._together is not None and count <= self._together.parties:
            self._together.wait()
        self.inner.put(name, data)
        with self._lock:
            self.events.append(("end", name, threading.current_thread()))
        if is_pack:
            self._on_pack_put(count)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def moments(self, kind: str, prefix: str | tuple[str, ...]) -> list[int]:
        return [i for i, (k, name, _) in enumerate(self.events)
                if k == kind and name.startswith(prefix)]


def saved_run(tmp_path) -> tuple[LocalDirStore, Repository, set[str]]:
    """A checkpoint of ~10 packs (16 KiB each: random bytes do not compress)."""
    (tmp_path / "home").mkdir()
    store = LocalDirStore(tmp_path / "home")
    repository = Repository(store, KEY, WriteOptions(chunk_size=4096, pack_size=16 * 1024))
    rng = random.Random(3)
    tensors = [Tensor(f"layer{i}", "uint8", (80_000,), rng.randbytes(80_000)) for i in range(2)]
    repository.write_checkpoint(RUN, tensors, b"{}", Metadata(STEP, STEP, 0, None,
                                                              "2026-11-29T12:00:00Z", "o", "1"))
    return store, repository, set(stored_packs(store))


def assert_in_format_order(recording: RecordingStore) -> None:
    """docs/format.md §8: the key, then every pack, then the manifest, then the pointer."""
    key_end = recording.moments("end", key_name(RUN))
    packs_start = recording.moments("start", PACK_PREFIXES)
    packs_end = recording.moments("end", PACK_PREFIXES)
    manifest_start = recording.moments("start", manifest_name(RUN, STEP))
    manifest_end = recording.moments("end", manifest_name(RUN, STEP))
    latest_start = recording.moments("start", f"latest/{RUN}")
    assert key_end[0] < min(packs_start)
    assert max(packs_end) < manifest_start[0] and manifest_end[0] < latest_start[0]


@needs_weed
@pytest.mark.slow
def test_a_copy_with_four_streams_puts_every_pack_at_once_and_the_manifest_last(
        weed, tmp_path, prefix):
    home_store, home, packs = saved_run(tmp_path)
    destination = RecordingStore(S3Store(S3_BUCKET, prefix, weed.client(DAEMONS),
                                         plan=FOUR_STREAMS), together=4)
    progress: list[tuple[int, int, threading.Thread]] = []
    report = copy_checkpoint(home, home_store, destination, RUN, STEP, streams=4,
                             on_pack=lambda done, total: progress.append(
                                 (done, total, threading.current_thread())))
    assert len(packs) >= 8 and (report.packs_copied, report.packs_present) == (len(packs), 0)
    assert set(stored_packs(destination)) == packs
    assert_in_format_order(destination)
    pack_threads = {t for kind, name, t in destination.events if name.startswith(PACK_PREFIXES)}
    assert threading.current_thread() not in pack_threads
    assert progress == [(i, len(packs), threading.current_thread())
                        for i in range(1, len(packs) + 1)]
    replica = Repository(destination.inner, KEY)
    assert replica.verify(RUN, STEP) == []
    assert replica.read_checkpoint(RUN, STEP).tensors == home.read_checkpoint(RUN, STEP).tensors


class FailingPuts:
    """`inner`, whose `fail_at`-th pack put raises a transient StoreUnavailable."""

    def __init__(self, inner, fail_at: int):
        self.inner = inner
        self.fail_at = fail_at
        self._lock = threading.Lock()
        self.pack_puts = 0

    def put(self, name, data):
        if name.startswith(PACK_PREFIXES):
            with self._lock:
                self.pack_puts += 1
                failing = self.pack_puts == self.fail_at
            if failing:
                raise StoreUnavailable(name, "connection reset")
            time.sleep(0.05)  # the failure lands while the others still run
        self.inner.put(name, data)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def away(tmp_path) -> LocalDirStore:
    (tmp_path / "away").mkdir()
    return LocalDirStore(tmp_path / "away")


def test_a_failed_pack_stops_the_copy_before_the_manifest_and_a_second_copy_ends_it(tmp_path):
    home_store, home, packs = saved_run(tmp_path)
    away_store = away(tmp_path)
    failing = FailingPuts(away_store, fail_at=3)
    with pytest.raises(StoreUnavailable, match="connection reset"):
        copy_checkpoint(home, home_store, failing, RUN, STEP, streams=4)
    assert not away_store.exists(manifest_name(RUN, STEP))
    assert not away_store.exists(f"latest/{RUN}")
    left = len(stored_packs(away_store))
    assert left < len(packs) and failing.pack_puts < len(packs)  # the rest never started

    report = copy_checkpoint(home, home_store, away_store, RUN, STEP, streams=4)
    assert (report.packs_copied, report.packs_present) == (len(packs) - left, left)
    assert Repository(away_store, KEY).verify(RUN, STEP) == []


def test_a_stop_during_a_parallel_copy_ends_it_before_the_next_object(tmp_path):
    home_store, home, packs = saved_run(tmp_path)
    away_store, stop = away(tmp_path), threading.Event()
    recording = RecordingStore(away_store,
                               on_pack_put=lambda count: stop.set() if count == 2 else None)
    destination = paced(recording, "destination", TokenBucket(0), guard=Guard(stop, 1e18))
    with pytest.raises(Interrupted):
        copy_checkpoint(home, home_store, destination, RUN, STEP, streams=4)
    assert not away_store.exists(manifest_name(RUN, STEP))
    assert len(recording.moments("start", PACK_PREFIXES)) <= 2 + 4  # those already under way


def test_an_attempt_with_four_streams_records_every_pack_its_threads_put(tmp_path):
    home_store, _, packs = saved_run(tmp_path)
    away_store = away(tmp_path)
    recording = RecordingStore(away_store, together=4)
    state = StateDB(tmp_path / "sync.db")
    (replica_id,) = state.add([{"root": "pfs", "run": RUN, "step": STEP,
                                "destination": "offsite", "sequence": 0,
                                "status": Status.PENDING.value}], now=0.0)
    state.move(replica_id, Status.PENDING, Status.UPLOADING, 0.0)
    route = Route("pfs", home_store, "home", "offsite", recording, "eu", streams=4)
    attempt = Attempt(state, KEY, route, Guard(threading.Event(), 1e18), TokenBucket(0),
                      Limits(max_attempts=3))
    assert attempt.run(state.replica(replica_id)).outcome is Outcome.VERIFIED
    transfers = state.transfers(replica_id)
    assert sorted(t["object"] for t in transfers if t["kind"] == "packs") == sorted(packs)
    # Verified as written: no read back ("verify"); the verification record goes last.
    assert {t["kind"] for t in transfers} == {"keys", "packs", "manifests", "latest",
                                              "verified"}
    replica = state.replica(replica_id)
    assert replica.bytes == sum(t["bytes"] for t in transfers if t["kind"] != "verified")


# --- pacing, with the packs' threads paying at once ----------------------------------------

def test_threads_paying_the_bucket_at_once_each_wait_for_the_debts_before_theirs():
    """100 bytes a second, one second of burst, a clock that stands still: eight payments of
    50 from eight threads at once leave the first two free and the others 0.5 s apart,
    whichever thread came when; no payment is lost to another."""
    bucket, slept, lock = TokenBucket(100, clock=lambda: 0.0), [], threading.Lock()
    together = threading.Barrier(8, timeout=10)

    def record(seconds: float) -> None:
        with lock:
            slept.append(seconds)

    def pay() -> None:
        together.wait()
        bucket.take(50, record)

    threads = [threading.Thread(target=pay) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(slept) == pytest.approx([0.5, 1.0, 1.5, 2.0, 2.5, 3.0])


def test_a_paced_store_counts_every_byte_its_threads_read(tmp_path):
    store = away(tmp_path)
    store.put("packs/ab/cd", b"x" * 1000)
    paced_store = paced(store, "destination", TokenBucket(0))
    readers = [threading.Thread(target=lambda: [paced_store.get("packs/ab/cd")
                                                for _ in range(200)]) for _ in range(4)]
    for thread in readers:
        thread.start()
    for thread in readers:
        thread.join()
    assert paced_store.bytes_read == 4 * 200 * 1000
