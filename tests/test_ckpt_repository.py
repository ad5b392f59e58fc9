"""Checkpoints end to end on a LocalDirStore: round trips, dedup, delta, and damage."""

from __future__ import annotations

import dataclasses
import os
import random
import struct
from concurrent.futures import Future
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import pytest

from slurm_geo.ckpt import (
    CorruptObject,
    LocalDirStore,
    Metadata,
    ObjectMissing,
    Repository,
    StepMismatch,
    StoreUnavailable,
    Tensor,
    UnsafeObjectName,
    UnsupportedFormat,
    WriteOptions,
    WrongKey,
)
from slurm_geo.ckpt.format.chunking import CdcParams
from slurm_geo.ckpt.format.codec import Method, encode
from slurm_geo.ckpt.format.keys import SALT_SIZE, RunKeys, chunk_id
from slurm_geo.ckpt.format.manifest import FORMAT_VERSION, ChunkRef
from slurm_geo.ckpt.format.names import PACK_PREFIXES, pack_name
from slurm_geo.ckpt.format.pack import HEADER_SIZE, Entry, PackReader, PackWriter
from slurm_geo.ckpt.format.seal import Kind, open_sealed, seal
from slurm_geo.ckpt.repo.reader import ChunkReader
from slurm_geo.ckpt.repo.writer import DELTA_LAG, DELTA_PROBES, DeltaProbe, delta_kind
from tests.helpers import pack_files, stored_packs

RUN = "run-1"
CHUNK = 4096
OPTIONS = WriteOptions(chunk_size=CHUNK, pack_size=32 * 1024, max_delta_depth=2,
                       cdc=CdcParams(min_size=1024, mask_bits=10, max_size=4096))


def metadata(step: int, optimizer_step: int | None = None) -> Metadata:
    return Metadata(step, step if optimizer_step is None else optimizer_step, 0, 2.5,
                    "2026-11-29T15:02:11Z", "onprem", "4711")


def floats(count: int, seed: int) -> bytes:
    rng = random.Random(seed)
    return struct.pack(f"<{count}f", *(rng.gauss(0, 1) for _ in range(count)))


def noise(count: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(count)


def state(seed: int = 0) -> list[Tensor]:
    return [
        Tensor("model.w", "float32", (3000,), floats(3000, seed)),  # three chunks
        Tensor("model.b", "bfloat16", (7,), noise(14, seed)),
        Tensor("optimizer.step", "int64", (), struct.pack("<q", 42)),
        Tensor("model.empty", "float16", (0, 4), b""),
        Tensor("model.mask", "bool", (2, 2), bytes([1, 0, 0, 1])),
    ]


EXTRA = noise(20_000, 99)


@pytest.fixture
def store(tmp_path) -> LocalDirStore:
    return LocalDirStore(tmp_path)


@pytest.fixture
def master() -> bytes:
    return os.urandom(32)


@pytest.fixture
def repo(store, master) -> Repository:
    return Repository(store, master, OPTIONS)


def pack_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in pack_files(root))


def object_path(store: LocalDirStore, prefix: str) -> Path:
    (name,) = store.list(prefix)
    return store.root / name


def flip_bit(path: Path, position: int) -> None:
    data = bytearray(path.read_bytes())
    data[position] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_checkpoint_round_trips(repo):
    saved = repo.write_checkpoint(RUN, state(), EXTRA, metadata(10))
    loaded = repo.read_checkpoint(RUN, 10)
    assert loaded.tensors == state()
    assert loaded.extra_state == EXTRA
    assert loaded.manifest == saved
    assert len(saved.extra_state.chunks) > 1  # content-defined chunks
    assert (repo.latest(RUN), repo.steps(RUN), repo.verify(RUN, 10)) == (10, [10], [])


def test_a_fresh_repository_reads_what_another_wrote(store, master, repo):
    repo.write_checkpoint(RUN, state(), EXTRA, metadata(10))
    assert Repository(store, master).read_checkpoint(RUN, 10).tensors == state()


def test_the_store_sees_neither_plaintext_nor_keys(store, master, repo):
    repo.write_checkpoint(RUN, [Tensor("secret.name", "uint8", (64,), b"P" * 64)], b"", metadata(1))
    for name in store.list(""):
        blob = store.get(name)
        assert b"secret" not in blob and b"PPPP" not in blob and master not in blob


def test_weights_and_optimizer_from_different_steps_are_refused_before_writing(store, repo):
    with pytest.raises(StepMismatch, match="step 10 but the optimizer state is from step 9"):
        repo.write_checkpoint(RUN, state(), EXTRA, metadata(10, optimizer_step=9))
    assert store.list("") == []


@pytest.mark.parametrize(
    "tensors, match",
    [
        ([Tensor("w", "float32", (2,), b"1234")], "do not hold"),
        ([Tensor("w", "float128", (1,), bytes(16))], "unknown dtype"),
        ([Tensor("w", "uint8", (1,), b"1"), Tensor("w", "uint8", (1,), b"1")], "twice"),
        ([Tensor("w", "uint8", (1.0,), b"1")], "shape"),
    ],
)
def test_bad_tensors_are_refused_before_writing(store, repo, tensors, match):
    with pytest.raises(ValueError, match=match):
        repo.write_checkpoint(RUN, tensors, b"", metadata(1))
    assert store.list("") == []


@pytest.mark.parametrize(
    "options",
    [{"chunk_size": 100}, {"chunk_size": 0}, {"max_delta_depth": 17}, {"workers": -1},
     {"format_version": 3}, {"format_version": 5}, {"format_version": 6}],
)
def test_write_options_are_checked(options):
    with pytest.raises(ValueError):
        WriteOptions(**options)


def test_metadata_a_manifest_cannot_hold_is_refused_before_writing(store, repo):
    bad = dataclasses.replace(metadata(1), job_id=4711)
    with pytest.raises(ValueError, match="job_id"):
        repo.write_checkpoint(RUN, state(), b"", bad)
    assert store.list("") == []


@pytest.mark.parametrize("run", ["../x", "a/b", "my run"])
def test_hostile_run_ids_are_refused(repo, run):
    with pytest.raises(UnsafeObjectName):
        repo.write_checkpoint(run, state(), b"", metadata(1))


def test_latest_follows_saves_and_falls_back_to_listing(store, repo):
    assert repo.latest(RUN) is None
    for step in (5, 20, 15):
        repo.write_checkpoint(RUN, state(step), EXTRA, metadata(step))
    assert repo.latest(RUN) == 15  # saved last, e.g. after a rollback
    assert repo.steps(RUN) == [5, 15, 20]
    store.delete(f"latest/{RUN}")  # a crash between manifest and pointer
    assert repo.latest(RUN) == 20


def test_identical_tensors_are_stored_once_across_checkpoints(store, repo):
    repo.write_checkpoint(RUN, state(), EXTRA, metadata(1))
    first = pack_bytes(store.root)
    changed = state()
    changed[1] = Tensor("model.b", "bfloat16", (7,), noise(14, seed=5))
    repo.write_checkpoint(RUN, changed, EXTRA, metadata(2), parent=1)
    assert pack_bytes(store.root) - first < 200  # one 14-byte chunk, one pack header
    assert repo.read_checkpoint(RUN, 2).tensors == changed


def test_identical_tensors_within_a_checkpoint_are_stored_once(store, repo):
    weights = noise(8192, 1)
    tied = [Tensor(path, "uint8", (8192,), weights) for path in ("embed", "lm_head")]
    manifest = repo.write_checkpoint(RUN, tied, b"", metadata(1))
    assert manifest.tensors[0].chunks == manifest.tensors[1].chunks
    assert 8192 < pack_bytes(store.root) < 8192 + 300


def fine_tune_step(weights: bytes, step: int) -> bytes:
    """Change one float in the first chunk, as a fine-tuning step changes few values."""
    changed = bytearray(weights)
    changed[40:44] = struct.pack("<f", float(step))
    return bytes(changed)


def test_delta_mode_stores_a_changed_chunk_as_a_small_patch(store, repo):
    weights = noise(3 * CHUNK, 3)
    repo.write_checkpoint(RUN, [Tensor("w", "float32", (3 * CHUNK // 4,), weights)], b"",
                          metadata(1))
    before = pack_bytes(store.root)
    tuned = fine_tune_step(weights, 2)
    manifest = repo.write_checkpoint(RUN, [Tensor("w", "float32", (3 * CHUNK // 4,), tuned)], b"",
                                     metadata(2), parent=1, delta=True)
    assert pack_bytes(store.root) - before < CHUNK // 10  # a full chunk would be > CHUNK
    assert [c.depth for c in manifest.tensors[0].chunks] == [1, 0, 0]
    assert repo.read_checkpoint(RUN, 2).tensors[0].data == tuned
    assert repo.read_checkpoint(RUN, 1).tensors[0].data == weights


def test_small_dense_changes_are_stored_as_an_xor_delta(store, repo):
    """An optimizer step nudges every value: no patch helps, but the xor of the two
    versions has zero high bytes, which its planes compress."""
    count = CHUNK // 4
    weights = floats(count, 7)
    nudged = struct.pack(f"<{count}f", *(w * 1.0001 for w in struct.unpack(f"<{count}f", weights)))
    for step, data in ((1, weights), (2, nudged)):
        manifest = repo.write_checkpoint(RUN, [Tensor("w", "float32", (count,), data)], b"",
                                         metadata(step), parent=step - 1 or None, delta=True)
    (ref,) = manifest.tensors[0].chunks
    assert ref.depth == 1 and _plain_blob(store, repo, ref)[0] == Method.XOR_DELTA
    assert len(_plain_blob(store, repo, ref)) < 0.7 * len(_plain_blob(store, repo, ref.base))
    assert repo.read_checkpoint(RUN, 2).tensors[0].data == nudged


@pytest.mark.parametrize(
    "changed, element_size, method",
    [
        (0.01, 4, Method.ZSTD_PATCH),
        (0.4, 4, Method.ZSTD_PATCH),
        (0.41, 4, Method.XOR_DELTA),
        (1.0, 4, Method.XOR_DELTA),
        (0.01, 2, Method.ZSTD_PATCH),
        (0.1, 2, Method.ZSTD_PATCH),
        (0.2, 2, Method.XOR_DELTA),
        (0.5, 1, Method.XOR_DELTA),
    ],
)
def test_the_delta_kind_follows_the_share_of_changed_elements(changed, element_size, method):
    assert delta_kind(changed, element_size) == method


def test_a_tensor_changed_beyond_recognition_is_stored_on_its_own_in_delta_mode(store, repo):
    """Re-initialised weights: an xor with the old ones is noise, so no delta is kept."""
    count = CHUNK // 4
    for step in (1, 2):
        weights = Tensor("w", "float32", (count,), floats(count, step))
        manifest = repo.write_checkpoint(RUN, [weights], b"", metadata(step),
                                         parent=step - 1 or None, delta=True)
    (ref,) = manifest.tensors[0].chunks
    assert ref.base is None
    assert repo.read_checkpoint(RUN, 2).tensors[0].data == floats(count, 2)


def tensors_of_chunks(count: int, make) -> list[Tensor]:
    """`count` one-chunk float32 tensors, the i-th of `make(i)`'s bytes."""
    return [Tensor(f"w{i}", "float32", (CHUNK // 4,), make(i)) for i in range(count)]


def test_deltas_stop_once_the_first_probes_show_they_do_not_pay(repo, monkeypatch):
    """Re-initialised weights throughout: past DELTA_PROBES attempts (decided DELTA_LAG
    chunks later), chunks are no longer read against their parents at all."""
    count = DELTA_PROBES + DELTA_LAG + 6
    reads: list[str] = []
    repo.write_checkpoint(RUN, tensors_of_chunks(count, lambda i: floats(CHUNK // 4, i)), b"",
                          metadata(1))
    read = ChunkReader.read
    monkeypatch.setattr(ChunkReader, "read",
                        lambda self, ref: reads.append(ref.id) or read(self, ref))
    manifest = repo.write_checkpoint(
        RUN, tensors_of_chunks(count, lambda i: floats(CHUNK // 4, 1000 + i)), b"",
        metadata(2), parent=1, delta=True)
    assert DELTA_PROBES <= len(reads) <= DELTA_PROBES + DELTA_LAG
    assert all(t.chunks[0].base is None for t in manifest.tensors)


def test_deltas_go_on_for_every_chunk_when_the_probes_pay(repo):
    count = DELTA_PROBES + DELTA_LAG + 6
    weights = [noise(CHUNK, i) for i in range(count)]
    repo.write_checkpoint(RUN, tensors_of_chunks(count, weights.__getitem__), b"", metadata(1))
    tuned = [fine_tune_step(w, 2) for w in weights]
    manifest = repo.write_checkpoint(RUN, tensors_of_chunks(count, tuned.__getitem__), b"",
                                     metadata(2), parent=1, delta=True)
    assert all(t.chunks[0].depth == 1 for t in manifest.tensors)
    assert [t.data for t in repo.read_checkpoint(RUN, 2).tensors] == tuned


@pytest.mark.parametrize("tried, pays", [
    ([(3600, 4000)] * 2, False),  # deltas saving 10 %: not worth a read and two encodings
    ([(3000, 4000)] * 2, True),
    ([None, (100, 4096), None, (3600, 4000)], True),  # by bytes: half of the attempts pay
    ([None] * 9, None),  # unchanged chunks (no delta tried) decide nothing
    ([(100, 4096)], None),  # too few bytes tried yet
])
def test_the_delta_probe_decides_on_the_bytes_of_its_first_attempts(tried, pays):
    probe = DeltaProbe(chunk_size=4096)
    for position, attempt in enumerate(tried):
        assert probe.offer(position)
        done: Future = Future()
        done.set_result(SimpleNamespace(size=4096, delta_tried=attempt))
        probe.probing(position, done)
    probe.offer(len(tried) + DELTA_LAG)
    assert probe.deltas_pay is pays


def test_a_sparse_blob_in_a_pack_older_than_version_3_is_corrupt(store):
    keys, chunk = RunKeys(os.urandom(32)), bytes(4096)
    blob = encode(chunk, element_size=4)
    assert blob[0] == Method.SPARSE_PLANES
    writer = PackWriter(keys.data_key, os.urandom(SALT_SIZE), version=2)
    cid = chunk_id(keys.id_key, chunk, 2)
    entry = writer.add(cid, blob)
    pack_id, data = writer.finish()
    store.put(pack_name(pack_id), data)
    ref = ChunkRef(cid.hex(), pack_id, entry.offset, entry.length, len(chunk))
    with pytest.raises(CorruptObject, match="SPARSE_PLANES blob in a version 2 pack"):
        ChunkReader(store, keys, 2, RUN).read(ref)


@pytest.mark.parametrize("format_version, pack_version", [(1, 1), (2, 3), (FORMAT_VERSION, 3)])
def test_a_writer_told_a_format_writes_its_packs_and_manifest(store, master, format_version,
                                                                pack_version):
    options = dataclasses.replace(OPTIONS, format_version=format_version)
    assert options.pack_version == pack_version
    manifest = Repository(store, master, options).write_checkpoint(RUN, state(1), EXTRA,
                                                                   metadata(1))
    assert manifest.format == format_version
    assert {p.read_bytes()[8] for p in pack_files(store.root)} == {pack_version}


def test_checkpoints_of_format_1_writers_still_read(store, repo, master):
    """Byte-identical, verified, including over a chain of xor deltas; a save of today on
    top of them shares none of their chunks (they are named another way) but reads back.
    A format 1 writer is what those writers were: HMAC-SHA256 chunk ids, version 1 packs
    named by SHA-256, xor blobs (method 3) for every delta."""
    old_writer = Repository(store, master, dataclasses.replace(OPTIONS, format_version=1))
    weights, saved = noise(3 * CHUNK, 3), []
    for step in (1, 2, 3):
        weights = fine_tune_step(weights, step)
        saved.append(weights)
        old_writer.write_checkpoint(RUN, [Tensor("w", "uint8", (3 * CHUNK,), weights)], b"",
                                    metadata(step), parent=step - 1 if step > 1 else None,
                                    delta=True)
    assert {p.read_bytes()[8] for p in pack_files(store.root)} == {1}
    changed = repo.manifest(RUN, 3).tensors[0].chunks[0]
    assert repo.manifest(RUN, 3).format == 1
    assert changed.depth == 2 and changed.base is not None
    assert [_plain_blob(store, repo, r)[0] for r in (changed, changed.base)] == [
        Method.XOR_DELTA, Method.XOR_DELTA]
    for step, expected in enumerate(saved, start=1):
        assert repo.read_checkpoint(RUN, step).tensors[0].data == expected
        assert repo.verify(RUN, step) == []

    before = pack_bytes(store.root)
    manifest = repo.write_checkpoint(RUN, [Tensor("w", "uint8", (3 * CHUNK,), weights)], b"",
                                     metadata(4), parent=3, delta=True)
    assert manifest.format == FORMAT_VERSION and all(r.base is None for r in manifest.refs())
    assert pack_bytes(store.root) - before > 3 * CHUNK  # nothing shared with format 1
    assert repo.read_checkpoint(RUN, 4).tensors[0].data == weights
    assert repo.verify(RUN, 4) == []


def test_packs_of_format_2_checkpoints_stay_shared_and_new_ones_go_under_the_run(
        store, repo, master):
    """A store written before format 4: its packs stay in packs/, read, checked and kept
    by gc; the next save goes under run-packs/<run>/, in full, and everything reads."""
    old_writer = Repository(store, master, dataclasses.replace(OPTIONS, format_version=2))
    old = old_writer.write_checkpoint(RUN, state(1), EXTRA, metadata(1))
    assert old.format == 2 and all(n.startswith("packs/") for n in stored_packs(store))
    new = repo.write_checkpoint(RUN, state(1), EXTRA, metadata(2), parent=1)
    assert new.format == FORMAT_VERSION
    assert {new.pack_object(r.pack) for r in new.refs()} <= set(stored_packs(store))
    assert all(new.pack_object(r.pack).startswith(f"run-packs/{RUN}/") for r in new.refs())
    assert not {r.pack for r in new.refs()} & {r.pack for r in old.refs()}  # shares none
    for step in (1, 2):
        assert repo.read_checkpoint(RUN, step).tensors == state(1)
        assert repo.verify(RUN, step) == []
    from slurm_geo.ckpt.ops.check import READ_ALL, check_store
    from slurm_geo.ckpt.ops.gc import collect_garbage

    assert check_store(store, master, READ_ALL).ok
    kept = collect_garbage(store, repo, datetime.now(UTC), dry_run=True)
    assert kept.deleted_packs == [] and kept.kept_packs == len(stored_packs(store))


def _plain_blob(store: LocalDirStore, repo: Repository, ref) -> bytes:
    keys = repo._keys(RUN).current  # noqa: SLF001  # a test looking inside a pack
    (name,) = [n for n in stored_packs(store) if n.endswith(ref.pack)]
    reader = PackReader(keys.data_key, "p", store.get(name))
    return reader.blob(Entry(bytes.fromhex(ref.id), ref.offset, ref.length))


def test_a_damaged_delta_base_is_named_when_its_delta_is_read(store, repo):
    weights = noise(3 * CHUNK, 3)
    repo.write_checkpoint(RUN, [Tensor("w", "uint8", (3 * CHUNK,), weights)], b"", metadata(1))
    (base_pack,) = [store.root / n for n in stored_packs(store)]
    tuned = fine_tune_step(weights, 2)
    manifest = repo.write_checkpoint(RUN, [Tensor("w", "uint8", (3 * CHUNK,), tuned)], b"",
                                     metadata(2), parent=1, delta=True)
    assert manifest.tensors[0].chunks[0].depth == 1
    flip_bit(base_pack, 100)
    fresh = Repository(store, repo.master_keys, OPTIONS)
    with pytest.raises(CorruptObject) as info:
        fresh.read_checkpoint(RUN, 2)
    assert info.value.name == base_pack.relative_to(store.root).as_posix()


def test_delta_chains_are_bounded(repo):
    weights = noise(CHUNK, 4)
    depths = []
    for step in range(1, 8):
        weights = fine_tune_step(weights, step)
        manifest = repo.write_checkpoint(
            RUN, [Tensor("w", "uint8", (CHUNK,), weights)], b"", metadata(step),
            parent=step - 1 if step > 1 else None, delta=True)
        depths.append(manifest.tensors[0].chunks[0].depth)
        assert repo.read_checkpoint(RUN, step).tensors[0].data == weights
    # OPTIONS.max_delta_depth is 2: past it, a chunk is a delta on its chain's root.
    assert depths == [0, 1, 2, 1, 2, 1, 2]


def save_two(repo: Repository, store: LocalDirStore) -> Path:
    """Checkpoints 1 and 2 in separate packs; return the path of checkpoint 2's pack."""
    repo.write_checkpoint(RUN, state(1), EXTRA, metadata(1))
    old = set(stored_packs(store))
    repo.write_checkpoint(RUN, state(2), noise(100, 2), metadata(2))
    (new,) = set(stored_packs(store)) - old
    return store.root / new


@pytest.mark.parametrize("position", [0, 8, 20, 30, 60, 100, 5000, -1])
def test_a_flipped_bit_in_a_pack_is_named_and_spares_the_previous_checkpoint(store, repo,
                                                                             position):
    pack = save_two(repo, store)
    flip_bit(pack, position)
    name = pack.relative_to(store.root).as_posix()
    with pytest.raises(CorruptObject) as info:
        repo.read_checkpoint(RUN, 2)
    assert info.value.name == name
    assert [f.name for f in repo.verify(RUN, 2)] == [name]
    assert repo.read_checkpoint(RUN, 1).tensors == state(1)
    assert repo.verify(RUN, 1) == []


class CountingDirStore(LocalDirStore):
    """A local store that records which objects were read whole and which by ranges."""

    def __init__(self, root: Path):
        super().__init__(root)
        self.whole: list[str] = []
        self.ranged: list[tuple[str, int]] = []

    def get(self, name: str) -> bytes:
        self.whole.append(name)
        return super().get(name)

    def get_range(self, name: str, start: int, length: int) -> bytes:
        self.ranged.append((name, length))
        return super().get_range(name, start, length)


def test_a_local_store_is_read_blob_by_blob_not_pack_by_pack(tmp_path, master):
    """A reader needs the blobs of its chunks and of their delta bases: a local store gives
    exactly those (and each pack's header once), never a whole pack."""
    store = CountingDirStore(tmp_path)
    repo = Repository(store, master, OPTIONS)
    weights = noise(3 * CHUNK, 3)
    tuned = fine_tune_step(weights, 2)
    for step, data in ((1, weights), (2, tuned)):
        repo.write_checkpoint(RUN, [Tensor("w", "float32", (3 * CHUNK // 4,), data)], EXTRA,
                              metadata(step), parent=step - 1 or None, delta=True)
    manifest = repo.manifest(RUN, 2)
    refs = [*(ref for entry in manifest.tensors for ref in entry.chunks),
            *manifest.extra_state.chunks]
    assert any(ref.base is not None for ref in refs)  # a delta: its base is read too
    store.whole.clear()
    store.ranged.clear()
    assert repo.read_checkpoint(RUN, 2).tensors[0].data == tuned
    assert not [name for name in store.whole if name.startswith("packs/")]
    blobs = [length for _name, length in store.ranged if length != HEADER_SIZE]
    headers = {name for name, length in store.ranged if length == HEADER_SIZE}
    assert sum(blobs) <= sum(ref.length + (ref.base.length if ref.base else 0) for ref in refs)
    assert len(headers) == len({name for name, _length in store.ranged})


def test_a_truncated_pack_is_named(store, repo):
    pack = save_two(repo, store)
    pack.write_bytes(pack.read_bytes()[:-7])
    with pytest.raises(CorruptObject, match="altered or truncated") as info:
        repo.read_checkpoint(RUN, 2)
    assert info.value.name == pack.relative_to(store.root).as_posix()


def test_bytes_appended_to_a_pack_spare_reads_but_not_verify(store, repo):
    """A read decodes only authenticated entries, so bytes past them change nothing it
    returns; verify (and so checkpoint-sync's verification and scrub) hashes the pack."""
    pack = save_two(repo, store)
    pack.write_bytes(pack.read_bytes() + b"trailing")
    assert repo.read_checkpoint(RUN, 2).tensors == state(2)
    faults = repo.verify(RUN, 2)
    assert [f.name for f in faults] == [pack.relative_to(store.root).as_posix()]
    assert "altered or truncated" in str(faults[0])


def test_a_missing_pack_is_named(store, repo):
    pack = save_two(repo, store)
    pack.unlink()
    with pytest.raises(ObjectMissing) as info:
        repo.read_checkpoint(RUN, 2)
    assert info.value.name == pack.relative_to(store.root).as_posix()


@pytest.mark.parametrize("position", [0, 8, 12, 20, 40, 200, -1])
def test_a_flipped_bit_in_a_manifest_is_named(store, repo, position):
    repo.write_checkpoint(RUN, state(), EXTRA, metadata(3))
    manifest = object_path(store, "manifests/")
    flip_bit(manifest, position)
    faults = repo.verify(RUN, 3)
    assert [f.name for f in faults] == [f"manifests/{RUN}/{3:020d}"]
    with pytest.raises(type(faults[0])):
        repo.read_checkpoint(RUN, 3)


@pytest.mark.parametrize("prefix", ["latest/", "keys/"])
def test_a_damaged_pointer_or_key_is_named(store, master, repo, prefix):
    repo.write_checkpoint(RUN, state(), EXTRA, metadata(3))
    path = object_path(store, prefix)
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(CorruptObject) as info:
        Repository(store, master).latest(RUN)
    assert info.value.name == f"{prefix}{RUN}"


def data_key(store: LocalDirStore, master: bytes) -> bytes:
    return open_sealed(master, Kind.DATA_KEY, store.get(f"keys/{RUN}"), f"keys/{RUN}")


def replace_manifest(store, master, step: int, edit) -> None:
    """Re-seal a manifest after `edit`: what a buggy or hostile key holder could write."""
    name = f"manifests/{RUN}/{step:020d}"
    key = data_key(store, master)
    payload = edit(open_sealed(key, Kind.MANIFEST, store.get(name), name).decode())
    store.put(name, seal(key, Kind.MANIFEST, os.urandom(SALT_SIZE), payload.encode(), name))


def test_a_manifest_naming_an_object_outside_the_store_is_refused(store, master, repo):
    manifest = repo.write_checkpoint(RUN, state(), EXTRA, metadata(3))
    pack = manifest.tensors[0].chunks[0].pack
    replace_manifest(store, master, 3, lambda text: text.replace(pack, "../x", 1))
    with pytest.raises(UnsafeObjectName, match="'../x'"):
        repo.read_checkpoint(RUN, 3)


def test_a_manifest_of_an_unknown_version_is_refused(store, master, repo):
    repo.write_checkpoint(RUN, state(), EXTRA, metadata(3))
    replace_manifest(store, master, 3, lambda text: text.replace('"format":4', '"format":6'))
    with pytest.raises(UnsupportedFormat, match="version 6"):
        repo.read_checkpoint(RUN, 3)


def test_an_old_manifest_put_under_a_newer_name_is_refused(store, repo):
    repo.write_checkpoint(RUN, state(1), EXTRA, metadata(1))
    repo.write_checkpoint(RUN, state(2), EXTRA, metadata(2))
    store.put(f"manifests/{RUN}/{2:020d}", store.get(f"manifests/{RUN}/{1:020d}"))
    with pytest.raises(CorruptObject, match="authentication failed"):
        repo.read_checkpoint(RUN, 2)


def test_a_wrong_master_key_is_named(store, repo):
    repo.write_checkpoint(RUN, state(), EXTRA, metadata(3))
    with pytest.raises(WrongKey) as info:
        Repository(store, os.urandom(32)).read_checkpoint(RUN, 3)
    assert info.value.name == f"keys/{RUN}"


class CrashBeforeManifest:
    """A store whose process dies as the manifest is about to be renamed into place."""

    def __init__(self, inner: LocalDirStore):
        self.inner = inner

    def put(self, name, data):
        if name.startswith("manifests/"):
            raise StoreUnavailable(name, "simulated crash")
        self.inner.put(name, data)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_crash_between_packs_and_manifest_keeps_the_previous_checkpoint(store, master, repo):
    repo.write_checkpoint(RUN, state(1), EXTRA, metadata(1))
    packs_before = stored_packs(store)
    crashing = Repository(CrashBeforeManifest(store), master, OPTIONS)
    with pytest.raises(StoreUnavailable):
        crashing.write_checkpoint(RUN, state(2), EXTRA, metadata(2), parent=1)
    assert len(stored_packs(store)) > len(packs_before)  # data went first
    fresh = Repository(store, master, OPTIONS)
    assert (fresh.latest(RUN), fresh.steps(RUN)) == (1, [1])
    assert fresh.read_checkpoint(RUN, 1).tensors == state(1)
    fresh.write_checkpoint(RUN, state(2), EXTRA, metadata(2), parent=1)
    assert fresh.read_checkpoint(RUN, 2).tensors == state(2)


def test_a_resaved_step_replaces_its_manifest(repo):
    repo.write_checkpoint(RUN, state(1), EXTRA, metadata(7))
    repo.write_checkpoint(RUN, state(2), EXTRA, metadata(7))
    assert repo.read_checkpoint(RUN, 7).tensors == state(2)
    assert repo.steps(RUN) == [7]


# Parallel pipeline, unchanged hints and streaming reads.


def seeded_random(seed: int):
    rng = random.Random(seed)
    return rng.randbytes


def all_objects(store: LocalDirStore) -> dict[str, bytes]:
    return {name: store.get(name) for name in store.list("")}


def busy_history() -> list[tuple[list[Tensor], bytes]]:
    """Three checkpoints: tied weights, multi-chunk tensors, changes small and large."""
    tied = noise(3 * CHUNK, 7)
    history = []
    for step in range(3):
        tensors = state(step) + [
            Tensor("embed", "uint8", (len(tied),), tied),
            Tensor("lm_head", "uint8", (len(tied),), tied),
            Tensor("big", "float32", (5000,), floats(5000, 0 if step < 2 else 9)),
            Tensor("tuned", "bfloat16", (4 * CHUNK,), fine_tune_step(noise(8 * CHUNK, 1), step)),
        ]
        history.append((tensors, noise(20_000, 99 + step)))
    return history


def write_history(root: Path, master: bytes, workers: int, delta: bool) -> dict[str, bytes]:
    store = LocalDirStore(root)
    options = dataclasses.replace(OPTIONS, workers=workers)
    repo = Repository(store, master, options, random_bytes=seeded_random(5))
    for step, (tensors, extra) in enumerate(busy_history(), start=1):
        repo.write_checkpoint(RUN, tensors, extra, metadata(step),
                              parent=step - 1 if step > 1 else None, delta=delta)
    return all_objects(store)


@pytest.mark.parametrize("delta", [False, True])
def test_the_parallel_writer_writes_the_same_bytes_as_the_sequential_one(tmp_path, master,
                                                                         delta):
    roots = [tmp_path / name for name in ("one", "four")]
    for root in roots:
        root.mkdir()
    sequential = write_history(roots[0], master, workers=1, delta=delta)
    parallel = write_history(roots[1], master, workers=4, delta=delta)
    assert len([n for n in sequential if n.startswith(PACK_PREFIXES)]) > 3  # several packs
    assert sequential == parallel


def test_a_tensor_hinted_unchanged_gets_the_manifest_hashing_gives(tmp_path, master):
    first = state(1) + [Tensor("frozen", "float32", (3000,), floats(3000, 5))]
    second = [Tensor("model.w", "float32", (3000,), floats(3000, 2))] + first[1:]
    saved = []
    for name, hint in (("hashed", set()), ("hinted", {"frozen", "model.b", "model.empty"})):
        (tmp_path / name).mkdir()
        store = LocalDirStore(tmp_path / name)
        repo = Repository(store, master, OPTIONS, random_bytes=seeded_random(3))
        repo.write_checkpoint(RUN, first, EXTRA, metadata(1))
        manifest = repo.write_checkpoint(RUN, second, EXTRA, metadata(2), parent=1,
                                         delta=True, unchanged=hint)
        assert repo.read_checkpoint(RUN, 2).tensors == second
        saved.append((manifest, all_objects(store)))
    assert saved[0] == saved[1]


def test_a_tensor_hinted_unchanged_is_not_read(store, repo):
    repo.write_checkpoint(RUN, state(1), EXTRA, metadata(1))
    packs = stored_packs(store)
    stale = state(2)  # the hint is trusted: its data is never looked at
    manifest = repo.write_checkpoint(RUN, stale, EXTRA, metadata(2), parent=1,
                                     unchanged={t.path for t in stale})
    assert stored_packs(store) == packs
    assert repo.read_checkpoint(RUN, 2).tensors == state(1)
    assert manifest.tensors == repo.manifest(RUN, 1).tensors


@pytest.mark.parametrize(
    "tensor",
    [
        Tensor("model.w", "float32", (1000, 3), floats(3000, 1)),  # another shape
        Tensor("model.w", "int32", (3000,), floats(3000, 1)),  # another dtype
        Tensor("model.new", "float32", (3000,), floats(3000, 1)),  # not in the parent
    ],
    ids=["shape", "dtype", "absent"],
)
def test_a_hint_the_parent_cannot_satisfy_falls_back_to_hashing(repo, tensor):
    repo.write_checkpoint(RUN, state(1), EXTRA, metadata(1))
    repo.write_checkpoint(RUN, [tensor], b"", metadata(2), parent=1, unchanged={tensor.path})
    assert repo.read_checkpoint(RUN, 2).tensors == [tensor]


def test_tensors_stream_one_at_a_time(store, master, repo):
    repo.write_checkpoint(RUN, state(), EXTRA, metadata(4))
    fresh = Repository(store, master, dataclasses.replace(OPTIONS, workers=3))
    stream = fresh.iter_tensors(RUN, 4)
    first = next(stream)
    assert first == state()[0] and isinstance(first.data, bytearray)
    assert list(stream) == state()[1:]
    assert fresh.read_extra_state(RUN, 4) == EXTRA
    stream = fresh.iter_tensors(RUN, 4)
    next(stream)
    stream.close()  # abandoning a stream stops its read-ahead


def test_a_stream_of_a_missing_checkpoint_fails_at_once(repo):
    repo.write_checkpoint(RUN, state(), EXTRA, metadata(4))
    with pytest.raises(ObjectMissing):
        repo.iter_tensors(RUN, 5)


def test_a_stream_stops_at_a_damaged_pack_before_yielding_its_tensor(store, repo):
    pack = save_two(repo, store)
    flip_bit(pack, 5000)
    stream = repo.iter_tensors(RUN, 2)
    with pytest.raises(CorruptObject):
        list(stream)


def test_writes_and_reads_agree_for_any_number_of_workers(store, master):
    for workers in (1, 2, 5):
        options = dataclasses.replace(OPTIONS, workers=workers)
        repo = Repository(store, master, options)
        repo.write_checkpoint(RUN, state(workers), EXTRA, metadata(workers))
        for step in repo.steps(RUN):
            assert repo.read_checkpoint(RUN, step).tensors == state(step)
            assert repo.verify(RUN, step) == []


def test_a_failed_pack_upload_fails_the_save_and_commits_nothing(store, master):
    class FailingPacks(CrashBeforeManifest):
        def put(self, name, data):
            if name.startswith(PACK_PREFIXES):
                raise StoreUnavailable(name, "disk full")
            self.inner.put(name, data)

    repo = Repository(FailingPacks(store), master, dataclasses.replace(OPTIONS, workers=3))
    with pytest.raises(StoreUnavailable, match="disk full"):
        repo.write_checkpoint(RUN, state(), EXTRA, metadata(1))
    assert store.list("manifests/") == [] and store.list("locks/") == []


def test_a_repository_on_another_store_has_the_same_keys(tmp_path, repo):
    written = repo.write_checkpoint(RUN, state(1), EXTRA, metadata(1))
    (tmp_path / "other").mkdir()
    other = LocalDirStore(tmp_path / "other")
    for name in repo.store.list(""):
        other.put(name, repo.store.get(name))
    there = repo.on(other)
    assert there.store is other and there.master_keys.keys() == repo.master_keys.keys()
    assert there.manifest(RUN, 1) == written and there.verify(RUN, 1) == []
