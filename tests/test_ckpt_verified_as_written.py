"""Verified as written (issue 32): a copy is checked against the digest the destination
keeps of each object, never by reading the replica back; a byte changed on the way is
never counted as written. Local stores, and a real SeaweedFS (tests.seaweed_server)."""

from __future__ import annotations

import random
from datetime import UTC, datetime

import pytest

from slurm_geo.ckpt import LocalDirStore, Metadata, Repository, Tensor, WriteOptions
from slurm_geo.ckpt.errors import CorruptObject, StoreUnavailable, WrongKey
from slurm_geo.ckpt.format.keys import load_master_key
from slurm_geo.ckpt.format.names import PACK_PREFIXES, verified_name
from slurm_geo.ckpt.ops.replicate import copy_checkpoint, needed_objects, sizes_of
from slurm_geo.ckpt.ops.verified import absent, read_record, record_of, write_record
from slurm_geo.ckpt.stores.digests import CheckedWrites, expected_digest, stored_digest
from slurm_geo.ckpt.stores.s3store import S3Store
from slurm_geo.ckpt.stores.store import Bytes, Store
from slurm_geo.ckpt.stores.sums import composite_b64, sha256_b64
from slurm_geo.ckpt.stores.transfer_plan import MIN_PART_SIZE, TransferPlan
from slurm_geo.sandbox.layout import S3_BUCKET, S3_PREFIX
from tests.seaweed_server import DAEMONS, needs_weed

KEY = bytes(range(32))
OPTIONS = WriteOptions(chunk_size=4096, pack_size=16 * 1024)
NOW = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)


def metadata(step: int) -> Metadata:
    return Metadata(step, step, 0, 1.0, "2026-12-06T12:00:00+00:00", "onprem", "1")


def tensors(seed: int) -> list[Tensor]:
    rng = random.Random(seed)
    return [Tensor(f"w{i}", "uint8", (20000,), rng.randbytes(20000)) for i in range(3)]


def source_repo(tmp_path) -> tuple[LocalDirStore, Repository]:
    (tmp_path / "src").mkdir()
    store = LocalDirStore(tmp_path / "src")
    repository = Repository(store, KEY, options=OPTIONS, clock=lambda: NOW)
    return store, repository


class Flipping:
    """A store between the copier and the destination that flips one byte of the first
    put of a pack (or of `only`): what a faulty NIC, proxy or library would do in transit."""

    def __init__(self, inner: Store, only: str | None = None):
        self.inner = inner
        self.only = only
        self.flipped: list[str] = []

    def put(self, name: str, data: Bytes) -> None:
        wanted = name == self.only if self.only else name.startswith(PACK_PREFIXES)
        if wanted and not self.flipped:
            changed = bytearray(data)
            changed[len(changed) // 2] ^= 0x01
            self.flipped.append(name)
            data = changed
        self.inner.put(name, data)

    def __getattr__(self, attribute: str):
        return getattr(self.inner, attribute)


class NoDigests:
    """The Store protocol and nothing more: a store that keeps no digests."""

    def __init__(self, inner: Store):
        self.inner = inner

    def __getattr__(self, attribute: str):
        if attribute in ("digest", "digest_of"):
            raise AttributeError(attribute)
        return getattr(self.inner, attribute)


class Counting:
    """Counts the bytes read from `inner` (what would cross the WAN back)."""

    def __init__(self, inner: Store):
        self.inner = inner
        self.bytes_read = 0

    def get(self, name: str) -> bytes:
        data = self.inner.get(name)
        self.bytes_read += len(data)
        return data

    def __getattr__(self, attribute: str):
        return getattr(self.inner, attribute)


# --- digests ------------------------------------------------------------------------------

def test_a_local_store_hashes_an_object_where_it_lies(tmp_path):
    store = LocalDirStore(tmp_path)
    store.put("keys/r", b"abc")
    assert stored_digest(store, "keys/r") == sha256_b64(b"abc") == expected_digest(store, b"abc")


def test_a_store_without_digests_answers_none_and_writes_are_read_back(tmp_path):
    plain = NoDigests(LocalDirStore(tmp_path))
    assert stored_digest(plain, "x") is None
    checked = CheckedWrites(plain)
    checked.put("keys/r", b"abc")
    assert checked.read_back == {"keys/r"} and checked.bytes_read_back == 3
    with pytest.raises(CorruptObject, match="read back"):
        CheckedWrites(Flipping(plain, only="keys/s")).put("keys/s", b"abcdef")


def test_a_copy_to_a_store_without_digests_reads_each_object_back_once(tmp_path):
    source_store, source = source_repo(tmp_path)
    source.write_checkpoint("r", tensors(1), b"", metadata(1))
    (tmp_path / "dst").mkdir()
    destination = NoDigests(LocalDirStore(tmp_path / "dst"))

    first = copy_checkpoint(source, source_store, destination, "r", 1)
    again = copy_checkpoint(source, source_store, destination, "r", 1)

    stored = sum(size for name, size in first.objects.items() if name.startswith("run-packs/"))
    assert first.packs_copied >= 2 and first.bytes_read_back >= stored  # each put, read back
    assert again.packs_copied == 0 and again.bytes_read_back >= stored  # present: read, sound
    assert Repository(destination, KEY).verify("r", 1) == []


def test_a_byte_flipped_on_the_way_to_a_local_store_fails_the_put(tmp_path):
    checked = CheckedWrites(Flipping(LocalDirStore(tmp_path), only="keys/r"))
    with pytest.raises(CorruptObject, match="other bytes"):
        checked.put("keys/r", b"0123456789")
    assert "keys/r" not in checked.written


# --- copies -------------------------------------------------------------------------------

def test_a_copy_reads_nothing_back_and_records_what_the_destination_holds(tmp_path):
    source_store, source = source_repo(tmp_path)
    source.write_checkpoint("r", tensors(1), b"", metadata(1))
    (tmp_path / "dst").mkdir()
    destination = Counting(LocalDirStore(tmp_path / "dst"))

    report = copy_checkpoint(source, source_store, destination, "r", 1)

    assert destination.bytes_read < 4096  # the run key's and pointer's few bytes, no pack
    assert report.bytes_read_back == 0 and report.packs_copied >= 2
    manifest = source.manifest("r", 1)
    assert set(report.objects) == set(needed_objects(manifest))
    assert report.objects == sizes_of(source_store, needed_objects(manifest))
    assert report.manifest_digest == sha256_b64(source_store.get("manifests/r/" + "0" * 19 + "1"))
    assert Repository(destination, KEY).verify("r", 1) == []


def test_a_pack_flipped_in_transit_is_never_counted_and_the_next_copy_repairs_it(tmp_path):
    source_store, source = source_repo(tmp_path)
    source.write_checkpoint("r", tensors(1), b"", metadata(1))
    (tmp_path / "dst").mkdir()
    destination = LocalDirStore(tmp_path / "dst")
    flipping = Flipping(destination)

    with pytest.raises(CorruptObject, match="other bytes"):
        copy_checkpoint(source, source_store, flipping, "r", 1)
    assert Repository(destination, KEY).steps("r") == []  # no manifest: not committed

    report = copy_checkpoint(source, source_store, destination, "r", 1)  # the retry
    assert flipping.flipped[0] in report.objects  # the damaged pack was put again
    assert Repository(destination, KEY).verify("r", 1) == []


def test_a_pack_damaged_at_the_destination_is_put_again_not_trusted(tmp_path):
    source_store, source = source_repo(tmp_path)
    source.write_checkpoint("r", tensors(1), b"", metadata(1))
    (tmp_path / "dst").mkdir()
    destination = LocalDirStore(tmp_path / "dst")
    copy_checkpoint(source, source_store, destination, "r", 1)
    pack = next(n for n in destination.list("run-packs/"))
    path = tmp_path / "dst" / pack
    damaged = bytearray(path.read_bytes())
    damaged[100] ^= 0xFF
    path.write_bytes(bytes(damaged))

    report = copy_checkpoint(source, source_store, destination, "r", 1)

    assert report.packs_copied == 1
    assert Repository(destination, KEY).verify("r", 1) == []


def test_a_pack_damaged_at_the_source_is_never_sent(tmp_path):
    source_store, source = source_repo(tmp_path)
    source.write_checkpoint("r", tensors(1), b"", metadata(1))
    pack = source_store.list("run-packs/")[0]
    path = tmp_path / "src" / pack
    damaged = bytearray(path.read_bytes())
    damaged[-1] ^= 0x01
    path.write_bytes(bytes(damaged))
    (tmp_path / "dst").mkdir()
    destination = LocalDirStore(tmp_path / "dst")

    with pytest.raises(CorruptObject, match="at the source"):
        copy_checkpoint(source, source_store, destination, "r", 1)
    assert not destination.exists(pack)


# --- a real S3 server ---------------------------------------------------------------------

@pytest.fixture
def s3(weed, request):
    return S3Store(S3_BUCKET, f"{S3_PREFIX}/digests-{request.node.name[:40]}",
                   weed.client(DAEMONS),
                   plan=TransferPlan(streams=2, part_size=MIN_PART_SIZE,
                                     multipart_threshold=MIN_PART_SIZE + 1))


@needs_weed
@pytest.mark.slow
def test_s3_keeps_the_sha256_of_single_and_multipart_puts(s3):
    small, large = b"s" * 1000, random.Random(3).randbytes(2 * MIN_PART_SIZE + 17)
    s3.put("keys/small", small)
    s3.put("keys/large", large)

    assert s3.digest("keys/small") == sha256_b64(small) == s3.digest_of(small)
    parts = [large[:MIN_PART_SIZE], large[MIN_PART_SIZE:2 * MIN_PART_SIZE],
             large[2 * MIN_PART_SIZE:]]
    assert s3.digest("keys/large") == composite_b64(parts) == s3.digest_of(large)


@needs_weed
@pytest.mark.slow
def test_s3_refuses_a_body_changed_after_its_checksum_was_computed(s3):
    """In transit: the body changes after the client computed its headers. The server
    refuses it (BadDigest) and stores nothing."""
    client = s3._client

    def corrupt(request, **_kwargs):
        if request.method == "PUT" and request.body:
            sent = request.body
            body = bytearray(sent.read() if hasattr(sent, "read") else sent)
            body[0] ^= 0x01
            request.body = bytes(body)

    client.meta.events.register("before-send.s3.PutObject", corrupt)
    try:
        with pytest.raises(StoreUnavailable, match="BadDigest|Content-M|checksum"):
            s3.put("keys/r", b"0123456789" * 100)
    finally:
        client.meta.events.unregister("before-send.s3.PutObject", corrupt)
    assert not s3.exists("keys/r")


@needs_weed
@pytest.mark.slow
def test_a_copy_to_s3_is_verified_by_digest_and_a_flip_before_the_store_is_caught(tmp_path, s3):
    source_store, source = source_repo(tmp_path)
    source.write_checkpoint("r", tensors(1), b"", metadata(1))
    counting = Counting(s3)

    with pytest.raises(CorruptObject, match="other bytes"):
        copy_checkpoint(source, source_store, Flipping(counting), "r", 1)
    report = copy_checkpoint(source, source_store, counting, "r", 1)

    assert report.bytes_read_back == 0
    assert counting.bytes_read < 4096  # run key and pointer only: no pack came back
    assert Repository(s3, KEY).verify("r", 1) == []


# --- verification records -------------------------------------------------------------------

def test_a_record_names_what_a_resume_reads_and_the_presence_check_reads_none_of_it(tmp_path):
    source_store, source = source_repo(tmp_path)
    source.write_checkpoint("r", tensors(1), b"", metadata(1))
    (tmp_path / "dst").mkdir()
    destination = Counting(LocalDirStore(tmp_path / "dst"))
    report = copy_checkpoint(source, source_store, destination, "r", 1)
    replica = Repository(destination, KEY)
    write_record(replica, record_of(report, 5.0, "checkpoint-sync"))
    destination.bytes_read = 0

    record = read_record(replica, "r", 1)
    assert record is not None and record.objects == report.objects and record.by == \
        "checkpoint-sync"
    assert absent(replica, record) == []
    pack = next(n for n in record.objects if n.startswith("run-packs/"))
    assert destination.bytes_read < 1024  # the record; the manifest hashed where it lies
    destination.inner.put(pack, b"short")
    assert absent(replica, record) == [f"{pack} holds 5 bytes, not {record.objects[pack]}"]
    destination.inner.delete(pack)
    assert absent(replica, record) == [f"{pack} is missing"]


def test_a_record_opens_under_the_site_key_only_and_names_its_checkpoint(tmp_path):
    source_store, source = source_repo(tmp_path)
    source.write_checkpoint("r", tensors(1), b"", metadata(1))
    (tmp_path / "dst").mkdir()
    destination = LocalDirStore(tmp_path / "dst")
    report = copy_checkpoint(source, source_store, destination, "r", 1)
    write_record(Repository(destination, KEY), record_of(report, 5.0, "federation"))

    with pytest.raises(WrongKey):
        read_record(Repository(destination, bytes(32)), "r", 1)
    destination.put(verified_name("r", 2), destination.get(verified_name("r", 1)))
    with pytest.raises(CorruptObject):  # moved to another step's name: its seal says so
        read_record(Repository(destination, KEY), "r", 2)
    assert read_record(Repository(destination, KEY), "r", 3) is None


def test_a_master_key_rotation_seals_the_records_again(tmp_path):
    from tests.kit.rotate import key_file_of, rotate_fully

    source_store, source = source_repo(tmp_path)
    source.write_checkpoint("r", tensors(1), b"", metadata(1))
    (tmp_path / "dst").mkdir()
    destination = LocalDirStore(tmp_path / "dst")
    report = copy_checkpoint(source, source_store, destination, "r", 1)
    write_record(Repository(destination, KEY), record_of(report, 5.0, "checkpoint-sync"))
    key_file = key_file_of(tmp_path)

    rotated = rotate_fully({"dst": destination}, key_file)

    assert verified_name("r", 1) in rotated.stores[0].rewrapped
    new = load_master_key(key_file)
    assert read_record(Repository(destination, new.current), "r", 1) is not None
    with pytest.raises(WrongKey):
        read_record(Repository(destination, KEY), "r", 1)
