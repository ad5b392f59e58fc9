"""Pure tests of object names, manifest JSON and its validation, and the latest pointer."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from slurm_geo.ckpt.errors import CorruptObject, StepMismatch, UnsafeObjectName, UnsupportedFormat
from slurm_geo.ckpt.format.manifest import (
    BlobEntry,
    ChunkRef,
    Manifest,
    Metadata,
    TensorEntry,
    latest_to_json,
    manifest_to_json,
    parse_latest,
    parse_manifest,
)
from slurm_geo.ckpt.format.names import (
    check_object_name,
    check_run_id,
    manifest_name,
    pack_name,
    step_of_manifest_name,
)

NAME = "manifests/run-1/00000000000000000007"
HEX_A, HEX_B, HEX_C = "a" * 64, "b" * 64, "c" * 64


def ref(size: int, base: ChunkRef | None = None, pack: str = HEX_B) -> ChunkRef:
    return ChunkRef(HEX_A, pack, 25, 100, size, base)


MANIFEST = Manifest(
    run="run-1",
    metadata=Metadata(7, 7, 1, 0.25, "2026-11-29T15:02:11Z", "onprem", "4711"),
    parent_step=5,
    chunk_size=32,
    tensors=(
        TensorEntry("model.w", "float32", (3, 4), (ref(32), ref(16, base=ref(16)))),
        TensorEntry("step", "int64", (), (ref(8),)),
        TensorEntry("empty", "bfloat16", (0, 5), ()),
    ),
    extra_state=BlobEntry(10, (ref(4), ref(6))),
)


def document() -> dict:
    return json.loads(manifest_to_json(MANIFEST))


def parse(doc: dict):
    return parse_manifest(json.dumps(doc).encode(), NAME, "run-1", 7)


def test_manifest_round_trips_through_json():
    assert parse(document()) == MANIFEST
    assert MANIFEST.tensors[0].chunks[1].depth == 1
    assert len(list(MANIFEST.refs())) == 5


def test_a_non_finite_loss_is_stored_as_null():
    nan_loss = Metadata(7, 7, 1, float("nan"), "t", "c", "j")
    doc = json.loads(manifest_to_json(dataclasses.replace(MANIFEST, metadata=nan_loss)))
    assert doc["metadata"]["loss"] is None


def set_path(doc: dict, path: str, value) -> dict:
    doc = copy.deepcopy(doc)
    *parents, last = path.split(".")
    target = doc
    for part in parents:
        target = target[int(part)] if part.isdigit() else target[part]
    if value is DELETE:
        del target[last]
    else:
        target[int(last) if last.isdigit() else last] = value
    return doc


DELETE = object()
DEEP = None
for _ in range(18):
    DEEP = {"id": HEX_A, "pack": HEX_B, "offset": 25, "length": 100, "size": 16, "base": DEEP}


@pytest.mark.parametrize(
    "path, value, error, match",
    [
        ("format", 6, UnsupportedFormat, "version 6"),
        ("format", 5, CorruptObject, "'sharded' is missing"),
        ("format", 3, CorruptObject, "'sharded' is missing"),
        ("sharded", {"ranks": 1, "items": []}, CorruptObject, "needs format 3"),
        ("format", DELETE, UnsupportedFormat, "version None"),
        ("tensors.0.chunks.0.pack", "../x", UnsafeObjectName, "'../x'"),
        ("tensors.0.chunks.1.base.pack", "/etc/passwd", UnsafeObjectName, "/etc/passwd"),
        ("extra_state.chunks.0.pack", "packs/aa/" + HEX_A, UnsafeObjectName, "packs/aa"),
        ("metadata.optimizer_step", 6, StepMismatch, "optimizer state is from step 6"),
        ("run", "run-2", CorruptObject, "run-2"),
        ("metadata.global_step", 8, CorruptObject, "step 8"),
        ("metadata.loss", "low", CorruptObject, "loss"),
        ("metadata.epoch", True, CorruptObject, "epoch"),
        ("metadata.cluster", DELETE, CorruptObject, "cluster"),
        ("chunk_size", 30, CorruptObject, "chunk_size"),
        ("tensors.0.dtype", "float128", CorruptObject, "dtype"),
        ("tensors.0.shape", [3, 5], CorruptObject, "chunk sizes"),
        ("tensors.0.shape", [3, -4], CorruptObject, "shape"),
        ("tensors.1.path", "model.w", CorruptObject, "share a path"),
        ("tensors.1.chunks.0.size", 0, CorruptObject, "chunk size"),
        ("tensors.1.chunks.0.offset", 3, CorruptObject, "malformed"),
        ("tensors.1.chunks.0.id", "A" * 64, CorruptObject, "malformed"),
        ("tensors.1.chunks.0", DEEP, CorruptObject, "deeper than 16"),
        ("extra_state.size", 11, CorruptObject, "add up"),
        ("tensors", {}, CorruptObject, "not a list"),
    ],
)
def test_bad_manifests_are_refused_naming_the_object(path, value, error, match):
    with pytest.raises(error, match=match):
        parse(set_path(document(), path, value))


@pytest.mark.parametrize("payload", [b"", b"\xff", b"[]", b'{"format": 1'])
def test_a_manifest_that_is_not_a_json_object_is_corrupt(payload):
    with pytest.raises(CorruptObject) as info:
        parse_manifest(payload, NAME, "run-1", 7)
    assert info.value.name == NAME


def test_latest_pointer_round_trips_and_is_checked():
    assert parse_latest(latest_to_json("run-1", 9), "latest/run-1", "run-1") == 9
    with pytest.raises(CorruptObject):
        parse_latest(latest_to_json("run-2", 9), "latest/run-1", "run-1")
    with pytest.raises(UnsupportedFormat):
        parse_latest(b'{"format": 3, "run": "run-1", "step": 9}', "latest/run-1", "run-1")


@pytest.mark.parametrize(
    "name",
    ["keys/r", "packs/ab/" + HEX_A, "manifests/run-1/00000000000000000007", "a.b_c-d"],
)
def test_safe_object_names_are_accepted(name):
    assert check_object_name(name) == name


@pytest.mark.parametrize(
    "name",
    ["", "../x", "a/../../x", "/etc/passwd", "a//b", "a/", ".hidden", "a/.tmp", "a/./b",
     "sp ace", "quote'", "'; echo foo", "new\nline", "nul\x00", "back\\slash", "x" * 1025, None],
)
def test_unsafe_object_names_are_refused(name):
    with pytest.raises(UnsafeObjectName):
        check_object_name(name)


@pytest.mark.parametrize("run", ["my run", "a/b", "..", ".x", "'; echo foo", "x\n", "", "r" * 129])
def test_hostile_run_ids_are_refused(run):
    with pytest.raises(UnsafeObjectName):
        check_run_id(run)


def test_manifest_names_sort_by_step_and_parse_back():
    names = [manifest_name("r", s) for s in (10, 9, 100)]
    assert sorted(names) == [manifest_name("r", s) for s in (9, 10, 100)]
    assert step_of_manifest_name("r", names[0]) == 10
    assert step_of_manifest_name("r", "manifests/r/12") is None
    assert step_of_manifest_name("r", "manifests/other/" + "0" * 20) is None
    with pytest.raises(UnsafeObjectName):
        manifest_name("r", -1)
    assert pack_name(HEX_C) == f"packs/cc/{HEX_C}"
