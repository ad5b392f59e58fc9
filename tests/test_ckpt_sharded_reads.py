"""Reading parts of stored tensors straight into caller buffers (sharded.StoredReader),
and which DCP read boxes are one contiguous run of a shard's bytes (distributed._byte_span).
Tiny chunks, so fills cross chunk edges in every way."""

from __future__ import annotations

import itertools
import os
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch

from slurm_geo.ckpt import LocalDirStore, Metadata, Repository, Tensor
from slurm_geo.ckpt.errors import CorruptObject
from slurm_geo.ckpt.format.layout import Item, Layout, Shard
from slurm_geo.ckpt.repo.sharded import Fill, StoredReader, commit_sharded, write_shards
from slurm_geo.ckpt.repo.writer import WriteOptions
from slurm_geo.torch.distributed import _byte_span

RUN = "reads"
CHUNK = 64  # bytes: a 200-byte tensor is cut 64, 64, 64, 8


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Repository, dict[str, bytes]]:
    repository = Repository(LocalDirStore(tmp_path), os.urandom(32),
                            WriteOptions(chunk_size=CHUNK, workers=2))
    data = {"a": os.urandom(200), "b": os.urandom(48), "empty": b""}
    repository.create_run_key(RUN)
    entries = write_shards(repository, RUN, [Tensor(p, "uint8", (len(d),), d)
                                             for p, d in data.items()], None)
    layout = Layout(tuple(Item(p, "tensor", "uint8", (len(d),), False,
                               (Shard((0,), (len(d),), p),)) for p, d in data.items()),
                    None, "1.0.0", 1)
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    commit_sharded(repository, RUN, entries, layout, Metadata(1, 1, 0, None, now, "", ""),
                   None)
    return repository, data


def test_every_range_of_a_stored_tensor_is_read_exactly_into_its_buffer(saved):
    repository, data = saved
    manifest = repository.manifest(RUN, 1)
    ranges = [(0, 200), (0, 64), (10, 20), (60, 70), (63, 129), (64, 128), (190, 200),
              (199, 200), (5, 5)]
    buffers = [bytearray(end - start) for start, end in ranges]
    fills = [Fill("a", start, memoryview(buffer))
             for (start, _end), buffer in zip(ranges, buffers, strict=True)]
    whole_b, empty = bytearray(48), bytearray()
    fills += [Fill("b", 0, memoryview(whole_b)), Fill("empty", 0, memoryview(empty))]
    with StoredReader(repository, manifest) as reader:
        reader.fill(fills[:3])
        reader.fill(fills[3:])
    for (start, end), buffer in zip(ranges, buffers, strict=True):
        assert buffer == data["a"][start:end], (start, end)
    assert whole_b == data["b"] and empty == b""


def test_a_range_outside_the_stored_tensor_is_refused(saved):
    repository, _data = saved
    with pytest.raises(ValueError, match="outside stored tensor 'b'"):
        with StoredReader(repository, repository.manifest(RUN, 1)) as reader:
            reader.fill([Fill("b", 40, memoryview(bytearray(9)))])


def test_a_damaged_chunk_fails_the_read_naming_its_pack(saved):
    repository, _data = saved
    manifest = repository.manifest(RUN, 1)
    ref = next(t for t in manifest.tensors if t.path == "a").chunks[1]
    name = manifest.pack_object(ref.pack)
    damaged = bytearray(repository.store.get(name))
    damaged[ref.offset + 40] ^= 1
    repository.store.put(name, damaged)
    with pytest.raises(CorruptObject, match=ref.pack):
        with StoredReader(repository, manifest) as reader:
            reader.fill([Fill("a", 70, memoryview(bytearray(10)))])


def test_a_box_has_a_byte_span_exactly_when_it_is_one_contiguous_run():
    shape = (3, 2, 4)
    numbered = torch.arange(24).reshape(shape)
    for offsets in itertools.product(*(range(n) for n in shape)):
        for lengths in itertools.product(*(range(1, n - o + 1)
                                           for n, o in zip(shape, offsets, strict=True))):
            box = numbered[tuple(slice(o, o + n)
                                 for o, n in zip(offsets, lengths, strict=True))].reshape(-1)
            run = bool((box == torch.arange(int(box[0]), int(box[0]) + len(box))).all())
            span = _byte_span(shape, offsets, lengths, element_size=4)
            assert (span is not None) == run, (offsets, lengths)
            if span is not None:
                assert span == 4 * int(box[0])
    assert _byte_span((), (), (), element_size=8) == 0
