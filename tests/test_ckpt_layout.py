"""The multi-rank layout of a format 3 manifest (docs/format.md §7.5), pure and table-driven:
the §10 vector byte for byte, round trips, and every rule a reader checks, each broken
through `parse_manifest`, which must refuse the manifest as corrupt, naming it."""

from __future__ import annotations

import copy
import hashlib
import json
import re
import struct
from dataclasses import replace
from pathlib import Path

import pytest

from slurm_geo.ckpt.errors import CorruptObject
from slurm_geo.ckpt.format.keys import RunKeys, chunk_id
from slurm_geo.ckpt.format.layout import Item, Layout, Shard, shard_path
from slurm_geo.ckpt.format.manifest import (
    BlobEntry,
    ChunkRef,
    Manifest,
    Metadata,
    TensorEntry,
    manifest_to_json,
    parse_manifest,
)

FORMAT_MD = Path(__file__).resolve().parent.parent / "docs" / "format.md"
NAME = "manifests/r/00000000000000000001"
DATA_KEY = bytes(range(32, 64))  # D of §10
ROWS = (struct.pack("<2f", 1.0, 2.0), struct.pack("<2f", 3.0, 4.0))
RANK_0_PACK, RANK_1_PACK = "a0" * 32, "a1" * 32


def chunk(data: bytes, pack: str, offset: int) -> ChunkRef:
    entry_length = 36 + 5 + len(data) + 16  # header, raw blob (§6.1), tag
    return ChunkRef(chunk_id(RunKeys(DATA_KEY).id_key, data, 2).hex(), pack, offset,
                    entry_length, len(data))


VECTOR = Manifest(
    run="r",
    metadata=Metadata(1, 1, 0, None, "2026-11-29T12:00:00Z", "onprem", "4711"),
    parent_step=None, chunk_size=16,
    tensors=(
        TensorEntry("model.w@0,0", "float32", (1, 2), (chunk(ROWS[0], RANK_0_PACK, 25),)),
        TensorEntry("model.w@1,0", "float32", (1, 2), (chunk(ROWS[1], RANK_1_PACK, 25),)),
        TensorEntry("step", "uint8", (5,), (chunk(b"hello", RANK_1_PACK, 90),)),
    ),
    extra_state=BlobEntry(0, ()), format=3,
    sharded=Layout(
        items=(Item("model.w", "tensor", "float32", (2, 2), False,
                    (Shard((0, 0), (1, 2), "model.w@0,0"), Shard((1, 0), (1, 2), "model.w@1,0"))),
               Item("step", "bytes", tensor="step")),
        planner_data={"model.w": ["model", "w"], "step": ["step"]},
        dcp_version="1.0.0", ranks=2),
)


def documented_vector() -> bytes:
    """The vector's JSON as docs/format.md §10 shows it, written without whitespace."""
    text = FORMAT_MD.read_text()
    block = re.search(r"<!-- multi-rank manifest vector -->\n```json\n(.*?)```", text, re.S)
    assert block, "the multi-rank manifest vector is gone from docs/format.md"
    return json.dumps(json.loads(block.group(1)), separators=(",", ":")).encode()


def test_the_documented_vector_is_what_the_writer_writes_and_reads_back():
    payload = manifest_to_json(VECTOR)
    assert payload == documented_vector()
    assert len(payload) == 1378
    assert hashlib.sha256(payload).hexdigest() == \
        "0e39ab3ea1f5ac38b9713f48b620b8127d625455813c84baa18d63dd711b31fe"
    assert f"`{hashlib.sha256(payload).hexdigest()}`" in FORMAT_MD.read_text()
    assert parse_manifest(payload, NAME, "r", 1) == VECTOR
    assert VECTOR.tensors[2].chunks[0].id == \
        "2606749848cbc3ce63e1ade2a43cbd42cc17c820b3d29af60152ab6e417a8c62"  # "hello", §10


@pytest.mark.parametrize("fqn, offsets, path", [
    ("model.w", (0, 0), "model.w@0,0"),
    ("opt.state.0.exp_avg", (1024, 0, 16), "opt.state.0.exp_avg@1024,0,16"),
    ("scale", (), "scale@"),
    ("step", None, "step"),
])
def test_shard_paths_name_item_and_offsets(fqn, offsets, path):
    assert shard_path(fqn, offsets) == path


def entry(path: str, dtype: str, shape: tuple[int, ...], nbytes: int) -> TensorEntry:
    refs = (ChunkRef("c" * 64, RANK_0_PACK, 25, 52 + nbytes, nbytes),) if nbytes else ()
    return TensorEntry(path, dtype, shape, refs)


def test_every_kind_of_item_round_trips():
    items = (
        Item("cube", "tensor", "bfloat16", (4, 2, 2), True,
             (Shard((0, 0, 0), (4, 2, 1), "cube@0,0,0"),
              Shard((0, 0, 1), (4, 2, 1), "cube@0,0,1"))),
        Item("scale", "tensor", "float64", (), False, (Shard((), (), "scale@"),)),
        Item("empty", "tensor", "int64", (0, 3), False, (Shard((0, 0), (0, 3), "empty@0,0"),)),
        Item("note", "bytes", tensor="note"),
    )
    tensors = (entry("cube@0,0,0", "bfloat16", (4, 2, 1), 16),
               entry("cube@0,0,1", "bfloat16", (4, 2, 1), 16),
               entry("scale@", "float64", (), 8), entry("empty@0,0", "int64", (0, 3), 0),
               entry("note", "uint8", (3,), 3))
    for planner_data, version in (({"cube": ["cube"], "scale": ["opt", 0, "scale"]}, "1.0.0"),
                                  (None, None)):
        manifest = replace(VECTOR, tensors=tensors,
                           sharded=Layout(items, planner_data, version, ranks=3))
        assert parse_manifest(manifest_to_json(manifest), NAME, "r", 1) == manifest


def document() -> dict:
    return json.loads(manifest_to_json(VECTOR))


def changed(path: str, value) -> dict:
    """The vector with the value at a dotted path replaced (DELETE: removed)."""
    doc = copy.deepcopy(document())
    *parents, last = path.split(".")
    target = doc
    for part in parents:
        target = target[int(part)] if part.isdigit() else target[part]
    key = int(last) if last.isdigit() else last
    if value is DELETE:
        del target[key]
    else:
        target[key] = value
    return doc


DELETE = object()
ITEM_W, ITEM_STEP = "sharded.items.0", "sharded.items.1"
SHARD_0, SHARD_1 = f"{ITEM_W}.shards.0", f"{ITEM_W}.shards.1"
ORPHAN = {"path": "orphan", "dtype": "uint8", "shape": [0], "chunks": []}


def without_second_shard() -> dict:
    doc = changed(f"{ITEM_W}.shards", [document()["sharded"]["items"][0]["shards"][0]])
    doc["tensors"] = [t for t in doc["tensors"] if t["path"] != "model.w@1,0"]
    return doc


def with_orphan() -> dict:
    doc = document()
    doc["tensors"].append(ORPHAN)
    return doc


@pytest.mark.parametrize("doc, detail", [
    # the object itself
    (changed("sharded", []), "'sharded' is not a dict"),
    (changed("sharded", DELETE), "'sharded' is missing"),
    (changed("sharded.ranks", 0), "'ranks' is not a whole number"),
    (changed("sharded.ranks", True), "'ranks' is not a whole number"),
    (changed("sharded.ranks", DELETE), "'ranks' is not a whole number"),
    (changed("sharded.dcp_version", 1), "'dcp_version' is not a string"),
    (changed("sharded.items", {}), "'items' is not a list"),
    # planner_data: a map of key paths
    (changed("sharded.planner_data", []), "not a map of key paths"),
    (changed("sharded.planner_data.step", "step"), "not a map of key paths"),
    (changed("sharded.planner_data.step", []), "not a map of key paths"),
    (changed("sharded.planner_data.step", ["step", True]), "not a map of key paths"),
    (changed("sharded.planner_data.step", [["step"]]), "not a map of key paths"),
    # items
    (changed(ITEM_STEP, "step"), "an item is not an object with a 'fqn'"),
    (changed(f"{ITEM_STEP}.fqn", DELETE), "an item is not an object with a 'fqn'"),
    (changed(f"{ITEM_STEP}.kind", "object"), "item 'step' is of unknown kind 'object'"),
    (changed(f"{ITEM_STEP}.fqn", "model.w"), "two items are named 'model.w'"),
    (changed(f"{ITEM_W}.requires_grad", DELETE), "item 'model.w' lacks 'requires_grad'"),
    (changed(f"{ITEM_W}.shards", []), "tensor item 'model.w' has no shards"),
    (changed(f"{ITEM_W}.size", [2, -2]), "item 'model.w' has a malformed size"),
    # rule 1: a shard's stored tensor, its dtype and shape
    (changed(f"{SHARD_0}.tensor", "model.w@9,9"), "a shard of 'model.w' names no float32[1, 2]"),
    (changed(f"{SHARD_0}.tensor", 5), "a shard of 'model.w' names no float32[1, 2]"),
    (changed(f"{ITEM_W}.dtype", "float16"), "a shard of 'model.w' names no float16[1, 2]"),
    (changed(f"{SHARD_0}.sizes", [2, 1]), "a shard of 'model.w' names no float32[2, 1]"),
    (changed(SHARD_0, [0, 0]), "a shard of 'model.w' is not an object"),
    # rule 2: inside the item
    (changed(f"{SHARD_1}.offsets", [2, 0]), "shard 'model.w@1,0' lies outside model.w[2, 2]"),
    (changed(f"{SHARD_1}.offsets", [1]), "shard 'model.w@1,0' lies outside model.w[2, 2]"),
    (changed(f"{SHARD_1}.offsets", [1, -1]), "item 'model.w' has a malformed size or offset"),
    (changed(f"{SHARD_1}.offsets", [1, False]), "item 'model.w' has a malformed size or offset"),
    # rule 3: no shard missing
    (without_second_shard(), "the shards of 'model.w' do not cover model.w[2, 2]"),
    # rule 4: bytes items are uint8 vectors
    (changed("tensors.2.dtype", "int8"), "bytes item 'step' names no uint8 vector"),
    (changed("tensors.2.shape", [1, 5]), "bytes item 'step' names no uint8 vector"),
    (changed(f"{ITEM_STEP}.tensor", "nothing"), "bytes item 'step' names no uint8 vector"),
    (changed(f"{ITEM_STEP}.tensor", ["step"]), "bytes item 'step' names no uint8 vector"),
    # rule 6: each stored tensor holds exactly one shard or bytes item
    (with_orphan(), "tensor 'orphan' is no shard or bytes item"),
    (changed(f"{SHARD_1}.tensor", "model.w@0,0"), "tensor 'model.w@0,0' is named by two"),
    (changed(f"{ITEM_STEP}.tensor", "model.w@0,0"), "bytes item 'step' names no uint8 vector"),
])
def test_a_broken_layout_is_refused_naming_the_manifest(doc, detail):
    with pytest.raises(CorruptObject) as refused:
        parse_manifest(json.dumps(doc).encode(), NAME, "r", 1)
    assert refused.value.name == NAME
    assert refused.value.detail.startswith("invalid manifest: ")
    assert detail in refused.value.detail


def test_unknown_keys_are_ignored_as_everywhere_in_a_manifest():
    doc = changed("sharded.future", {"anything": 1})
    doc["sharded"]["items"][0]["shards"][0]["placement"] = "rank 0"
    assert parse_manifest(json.dumps(doc).encode(), NAME, "r", 1) == VECTOR
