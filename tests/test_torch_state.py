"""Training state <-> checkpoint tensors and skeleton: every dtype, nesting, no pickle."""

from __future__ import annotations

import json
import math
import random
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch

from slurm_geo.ckpt.format.manifest import DTYPE_SIZES
from slurm_geo.torch.rng import capture_rng, restore_rng
from slurm_geo.torch.state import (
    TORCH_DTYPE_NAMES,
    StateFormatError,
    flatten_state,
    tensors_from_torch_file,
    unflatten_state,
)

DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128,
    torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2,
]


def sample(dtype: torch.dtype, shape: tuple[int, ...] = (3, 5)) -> torch.Tensor:
    """Random bytes reinterpreted, so every bit pattern (NaN payloads too) must survive."""
    count = math.prod(shape) * dtype.itemsize
    raw = torch.randint(0, 256, (count,), dtype=torch.uint8, generator=torch.Generator())
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def assert_same(a: Any, b: Any) -> None:
    """Equal structure, types and tensor bits."""
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert same_bits(a, b)
    elif isinstance(a, numpy.ndarray):
        assert a.dtype == b.dtype and numpy.array_equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    else:
        assert a == b


def round_trip(state: Any) -> Any:
    tensors, extra = flatten_state(state)
    return unflatten_state(tensors, extra)


def test_every_format_dtype_with_a_torch_equivalent_is_covered() -> None:
    assert set(TORCH_DTYPE_NAMES) == set(DTYPES)
    assert set(TORCH_DTYPE_NAMES.values()) == set(DTYPE_SIZES)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 5), (), (0, 4)], ids=["matrix", "scalar", "empty"])
def test_every_dtype_round_trips_bit_for_bit(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    tensor = sample(dtype, shape)
    tensors, _ = flatten_state({"w": tensor})
    (record,) = tensors
    assert record.dtype == TORCH_DTYPE_NAMES[dtype] and record.shape == shape
    assert len(record.data) == DTYPE_SIZES[record.dtype] * math.prod(shape)
    assert_same(unflatten_state(tensors, flatten_state({"w": tensor})[1]), {"w": tensor})


def test_views_store_only_their_elements_and_without_copy_share_memory() -> None:
    base = torch.arange(100, dtype=torch.float32)
    sliced, transposed = base[10:20], base[:20].reshape(4, 5).t()
    expected = transposed.clone()
    tensors, extra = flatten_state({"slice": sliced, "t": transposed})
    assert [len(t.data) for t in tensors] == [40, 80]
    base[10] = -1.0  # the contiguous slice was not copied, the transposed one was
    back = unflatten_state(tensors, extra)
    assert back["slice"][0] == -1.0
    assert torch.equal(back["t"], expected) and back["t"].is_contiguous()


def test_copy_snapshots_tensors() -> None:
    tensor = torch.ones(4)
    tensors, extra = flatten_state({"w": tensor}, copy=True)
    tensor.add_(1)
    assert torch.equal(unflatten_state(tensors, extra)["w"], torch.ones(4))


def test_optimizer_and_scheduler_state_round_trip_with_int_keys_and_tuples() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    for _ in range(3):
        model(torch.randn(2, 3)).sum().backward()
        optimizer.step()
        scheduler.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "scheduler": scheduler.state_dict()}
    back = round_trip(state)
    assert_same(back["optimizer"], state["optimizer"])  # int keys, betas tuple, step tensors
    assert_same(back["scheduler"], state["scheduler"])
    assert back["model"]._metadata == state["model"]._metadata  # type: ignore[attr-defined]
    assert_same(dict(back["model"]), dict(state["model"]))
    fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
    fresh.load_state_dict(back["optimizer"])
    assert_same(fresh.state_dict(), optimizer.state_dict())


def test_tensor_paths_are_dotted_stable_and_unique() -> None:
    state = {"model": {"fc.weight": torch.ones(1)},
             "optimizer": {"state": {0: {"m": torch.ones(1)}}},
             "a.b": torch.zeros(1), "a": {"b": torch.ones(1)}}
    paths = [t.path for t in flatten_state(state)[0]]
    assert paths == ["model.fc.weight", "optimizer.state.0.m", "a.b", "a.b~1"]
    assert [t.path for t in flatten_state(state)[0]] == paths
    assert_same(round_trip(state), state)


def test_plain_values_keep_their_types() -> None:
    state = {
        "floats": [0.1, -0.0, float("inf"), float("-inf"), float("nan"), 1e308],
        "ints": [0, -1, 2**70], "flags": (True, False, None), "text": "ünï\n\"$",
        "nested": ([1, (2, 3)], {"x": []}), "tagged": {"$": "not a tag", "k": 1},
        "keys": {1: "one", (2, 3): "pair", None: "none", 1.5: "float"},
        "bytes": b"\x00\xff", "dtype": torch.bfloat16, "device": torch.device("cpu"),
        "size": torch.Size([2, 3]), "np": numpy.float32(1.25), "npi": numpy.int64(7),
        "array": numpy.arange(6, dtype=numpy.uint32).reshape(2, 3),
        "odict": OrderedDict([("b", 1), ("a", 2)]),
    }
    back = round_trip(state)
    assert_same({k: v for k, v in back.items() if k != "odict"},
                {k: v for k, v in state.items() if k != "odict"})
    assert list(back["odict"].items()) == [("b", 1), ("a", 2)]


def test_skeleton_is_json_and_holds_no_tensor_bytes() -> None:
    tensors, extra = flatten_state({"w": torch.full((1000,), 7.0), "step": 3})
    document = json.loads(extra)
    assert document["state"] == {"w": {"$": "tensor", "path": "w"}, "step": 3}
    assert len(extra) < 200 and len(tensors[0].data) == 4000


def test_rng_states_round_trip() -> None:
    states = capture_rng()
    expected = (torch.rand(3), random.random(), numpy.random.random())
    torch.manual_seed(99), random.seed(99), numpy.random.seed(99)
    restore_rng(round_trip(states))
    assert_same((torch.rand(3), random.random(), numpy.random.random()), expected)


def test_unsupported_objects_are_refused_naming_their_path() -> None:
    with pytest.raises(TypeError, match="'extra.hook'.*function"):
        flatten_state({"extra": {"hook": lambda: None}})
    with pytest.raises(TypeError, match="sparse"):
        flatten_state({"s": torch.eye(2).to_sparse()})


def test_mismatched_tensors_and_skeleton_are_refused() -> None:
    tensors, extra = flatten_state({"a": torch.ones(1), "b": torch.ones(1)})
    with pytest.raises(StateFormatError, match="'b'.*missing"):
        unflatten_state(tensors[:1], extra)
    with pytest.raises(StateFormatError, match="not in the skeleton"):
        unflatten_state(tensors, flatten_state({"a": torch.ones(1)})[1])
    with pytest.raises(StateFormatError, match="not a training-state skeleton"):
        unflatten_state([], b"\x80pickle")
    with pytest.raises(StateFormatError, match="unknown skeleton entry"):
        unflatten_state([], b'{"format":"slurm-geo-torch/1","state":{"$":"pickle","v":""}}')


def test_torch_save_files_load_into_checkpoint_form(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 2).to(torch.bfloat16)
    path = tmp_path / "model.pt"
    torch.save(model.state_dict(), path)
    tensors, extra = tensors_from_torch_file(path)
    assert [(t.path, t.dtype, t.shape) for t in tensors] == [
        ("weight", "bfloat16", (2, 4)), ("bias", "bfloat16", (2,))]
    back = unflatten_state(tensors, extra)
    assert_same(dict(back), dict(model.state_dict()))
