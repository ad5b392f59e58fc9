"""Safetensors files in and out of a store, without torch: round trips, refusals, imports."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy
import pytest

from slurm_geo.ckpt import (
    LocalDirStore,
    Metadata,
    Repository,
    create_master_key_file,
    load_master_key,
)
from slurm_geo.ckpt.files.pushpull import pull_tensor_file, push_tensor_file
from slurm_geo.ckpt.files.safetensors import is_safetensors_file, read_safetensors_file
from slurm_geo.ckpt.files.skeleton import TensorFileError

RUN = "ft"


def metadata(step: int) -> Metadata:
    return Metadata(step, step, 0, None, "2026-12-04T21:00:00Z", "onprem", "")


@pytest.fixture
def repository(tmp_path) -> Repository:
    root = tmp_path / "store"
    root.mkdir()
    return Repository(LocalDirStore(root), os.urandom(32))


def sections(path: Path) -> tuple[dict, dict[str, bytes]]:
    """The file's parsed header and each tensor's bytes, read by hand."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    body = data[8 + length:]
    return header, {name: body[slice(*info["data_offsets"])]
                    for name, info in header.items() if name != "__metadata__"}


def raw_file(path: Path, header: dict | bytes, data: bytes = b"",
             length: int | None = None) -> Path:
    encoded = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded) if length is None else length)
                     + encoded + data)
    return path


def test_a_safetensors_file_round_trips_through_the_store(tmp_path, repository):
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    tensors = {"model.w": torch.randn(16, 8), "model.b": torch.randn(9, dtype=torch.bfloat16),
               "empty": torch.zeros(0, 4), "mask": torch.tensor([True, False, True]),
               "step": torch.tensor(7, dtype=torch.int64)}
    source, back = tmp_path / "model.safetensors", tmp_path / "back.safetensors"
    save_file(tensors, source, metadata={"format": "pt", "note": "é"})

    manifest, nbytes = push_tensor_file(repository, source, RUN, metadata(3))
    pull_tensor_file(repository, RUN, 3, back)

    assert nbytes == sum(t.numel() * t.element_size() for t in tensors.values())
    assert sorted(e.path for e in manifest.tensors) == sorted(tensors)
    assert sections(back) == sections(source)
    loaded = load_file(back)
    assert loaded.keys() == tensors.keys()
    for name, value in tensors.items():
        assert loaded[name].dtype == value.dtype and torch.equal(loaded[name], value)
    with safe_open(back, framework="pt") as opened:
        assert opened.metadata() == {"format": "pt", "note": "é"}


def test_numpy_reads_what_a_pull_writes(tmp_path, repository):
    from safetensors.numpy import load_file, save_file

    arrays = {"a": numpy.arange(12, dtype=numpy.float64).reshape(3, 4),
              "b": numpy.array([1, 2, 3], dtype=numpy.uint8),  # leaves the next unaligned
              "c": numpy.array([-5, 6], dtype=numpy.int16),
              "d": numpy.linspace(0, 1, 5, dtype=numpy.float32)}
    source, back = tmp_path / "arrays.safetensors", tmp_path / "back.safetensors"
    save_file(arrays, source)

    push_tensor_file(repository, source, RUN, metadata(1))
    pull_tensor_file(repository, RUN, 1, back)

    assert sections(back) == sections(source)
    loaded = load_file(back)
    for name, value in arrays.items():
        assert loaded[name].dtype == value.dtype and numpy.array_equal(loaded[name], value)


def test_a_pushed_safetensors_file_pulls_as_a_pt_torch_loads_weights_only(tmp_path,
                                                                          repository):
    import torch
    from safetensors.torch import save_file

    tensors = {"w": torch.randn(4, 3), "b": torch.ones(3, dtype=torch.bfloat16)}
    save_file(tensors, tmp_path / "m.safetensors", metadata={"source": "hub"})
    push_tensor_file(repository, tmp_path / "m.safetensors", RUN, metadata(2))
    pull_tensor_file(repository, RUN, 2, tmp_path / "m.pt")

    back = torch.load(tmp_path / "m.pt", weights_only=True)
    assert back.pop("__metadata__") == {"source": "hub"}
    assert back.keys() == tensors.keys()
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in tensors.items())


def test_a_pt_file_pulls_as_safetensors(tmp_path, repository):
    import torch
    from safetensors.torch import load_file

    state = torch.nn.Linear(5, 3).state_dict()  # an OrderedDict with module versions
    state["flags"] = torch.tensor([True, False, False])  # unaligns what follows
    state["scale"] = torch.tensor([0.5, 2.0], dtype=torch.float16)
    torch.save(state, tmp_path / "m.pt")
    push_tensor_file(repository, tmp_path / "m.pt", RUN, metadata(4))
    pull_tensor_file(repository, RUN, 4, tmp_path / "m.safetensors")

    loaded = load_file(tmp_path / "m.safetensors")
    assert list(loaded) == list(state)
    header_length = struct.unpack("<Q", (tmp_path / "m.safetensors").read_bytes()[:8])[0]
    assert header_length % 8 == 0  # padded with spaces, as the reference pads it
    assert all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in state.items())


@pytest.mark.parametrize("state, refusal", [
    ({"model": {"w": "T"}, "step": 3}, "entry 'model' is not a tensor"),
    ({"w": "T", "lr": 0.1}, "entry 'lr' is not a tensor"),
    (["T"], "its root is not a mapping"),
    ({"w": "T", "__metadata__": {"n": 1}}, "__metadata__ is not a mapping of strings"),
])
def test_a_state_safetensors_cannot_hold_is_refused_in_one_line(tmp_path, repository, state,
                                                                refusal):
    import torch

    def tensors_for(node):
        if node == "T":
            return torch.ones(2)
        if isinstance(node, dict):
            return {k: tensors_for(v) for k, v in node.items()}
        if isinstance(node, list):
            return [tensors_for(v) for v in node]
        return node

    torch.save(tensors_for(state), tmp_path / "s.pt")
    push_tensor_file(repository, tmp_path / "s.pt", RUN, metadata(5))
    target = tmp_path / "s.safetensors"
    with pytest.raises(TensorFileError) as refused:
        pull_tensor_file(repository, RUN, 5, target)
    message = str(refused.value)
    assert refusal in message and "pull it to FILE.pt or a directory" in message
    assert "\n" not in message
    assert not target.exists() and not (tmp_path / "s.safetensors.partial").exists()


def test_a_dtype_safetensors_lacks_is_refused_by_name(tmp_path, repository):
    import torch

    torch.save({"z": torch.zeros(2, dtype=torch.complex128)}, tmp_path / "c.pt")
    push_tensor_file(repository, tmp_path / "c.pt", RUN, metadata(6))
    with pytest.raises(TensorFileError, match="'z' is complex128, which safetensors cannot"):
        pull_tensor_file(repository, RUN, 6, tmp_path / "c.safetensors")


F32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize("header, data, length, refusal", [
    ({"w": F32}, bytes(8), 100_000_001, "over the 100000000-byte limit"),
    ({"w": F32}, bytes(8), 10_000, "truncated or not safetensors"),
    ({"w": {**F32, "data_offsets": [0, 8]}}, bytes(4), None, "cover 8 bytes of a 4-byte"),
    ({"w": F32}, bytes(12), None, "cover 8 bytes of a 12-byte"),
    ({"w": F32, "v": {**F32, "data_offsets": [4, 12]}}, bytes(12), None,
     "'v' at data_offsets [4, 12] overlaps"),
    ({"w": F32, "v": {**F32, "data_offsets": [12, 20]}}, bytes(20), None,
     "leaves bytes 8-12 of the data unclaimed"),
    ({"w": {**F32, "dtype": "F8_E8M0"}}, bytes(8), None, "has dtype F8_E8M0, which a"),
    ({"w": {**F32, "shape": [3]}}, bytes(8), None, "(12 bytes) but its data_offsets span 8"),
    ({"w": {**F32, "data_offsets": [8, 0]}}, bytes(8), None, "end before they start"),
    ({"w": {**F32, "shape": [-2]}}, bytes(8), None, "non-negative integers"),
    ({"w": {"dtype": "F32", "shape": [2]}}, bytes(8), None, "lacks its dtype, shape or"),
    ({"w": F32, "__metadata__": {"n": 1}}, bytes(8), None, "not a mapping of strings"),
    (b'{"w": 1, "w": 2}', b"", None, "'w' appears twice"),
    (b"{not json", b"", None, "header is not JSON"),
    (b"[]", b"", None, "header is not a JSON object"),
])
def test_a_malformed_header_is_refused_in_one_line(tmp_path, header, data, length, refusal):
    path = raw_file(tmp_path / "bad.safetensors", header, data, length)
    with pytest.raises(TensorFileError) as refused:
        read_safetensors_file(path)
    message = str(refused.value)
    assert refusal in message and str(path) in message and "\n" not in message


def test_a_safetensors_file_is_known_by_its_header_whatever_its_name(tmp_path, repository):
    import torch

    path = raw_file(tmp_path / "weights.bin", {"w": F32}, struct.pack("<2f", 1.5, -2))
    assert is_safetensors_file(path)
    push_tensor_file(repository, path, RUN, metadata(7))
    assert repository.read_checkpoint(RUN, 7).tensors[0].data == struct.pack("<2f", 1.5, -2)

    torch.save({"w": torch.ones(1)}, tmp_path / "m.pt")
    (tmp_path / "notes.txt").write_text("{ just text that starts with a brace }")
    assert not is_safetensors_file(tmp_path / "m.pt")
    assert not is_safetensors_file(tmp_path / "notes.txt")


NO_TORCH = """
import runpy, sys
for argv in ({push}, {pull}):
    sys.argv = ["slurm-geo", *argv]
    try:
        runpy.run_module("slurm_geo", run_name="__main__")
    except SystemExit as exit:
        assert not exit.code, exit.code
assert "torch" not in sys.modules, "torch was imported"
"""


def test_the_cli_pushes_and_pulls_a_safetensors_file_without_importing_torch(tmp_path):
    from safetensors.numpy import load_file, save_file

    key_file = tmp_path / "master.key"
    create_master_key_file(key_file)
    arrays = {"w": numpy.arange(6, dtype=numpy.float32).reshape(2, 3)}
    save_file(arrays, tmp_path / "m.safetensors", metadata={"k": "v"})
    store = f"file://{tmp_path / 'store'}"
    (tmp_path / "store").mkdir()
    key = ["--key-file", str(key_file)]
    push = ["ckpt", "push", str(tmp_path / "m.safetensors"), "--to", store, "--run", RUN,
            "--step", "1", *key]
    pull = ["ckpt", "pull", f"{RUN}@1", "--from", store, "--to",
            str(tmp_path / "back.safetensors"), *key]

    result = subprocess.run([sys.executable, "-c", NO_TORCH.format(push=push, pull=pull)],
                            capture_output=True, text=True, timeout=120, check=False)

    assert result.returncode == 0, result.stderr
    assert sections(tmp_path / "back.safetensors") == sections(tmp_path / "m.safetensors")
    assert numpy.array_equal(load_file(tmp_path / "back.safetensors")["w"], arrays["w"])


def test_a_multi_rank_checkpoint_is_not_pulled_as_safetensors(tmp_path):
    from tests.kit.sharded import RUN as SHARDED_RUN
    from tests.kit.sharded import save_on_two_ranks

    key_file = tmp_path / "master.key"
    create_master_key_file(key_file)
    (tmp_path / "store").mkdir()
    save_on_two_ranks(Repository(LocalDirStore(tmp_path / "store"), load_master_key(key_file)),
                      step=1)
    target = tmp_path / "m.safetensors"

    result = subprocess.run(
        [sys.executable, "-m", "slurm_geo", "ckpt", "pull", f"{SHARDED_RUN}@1", "--from",
         f"file://{tmp_path / 'store'}", "--to", str(target), "--key-file", str(key_file)],
        capture_output=True, text=True, timeout=120, check=False)

    assert result.returncode == 3, result.stderr
    assert "multi-rank checkpoint: pull it to FILE.pt or a directory" in result.stderr
    assert "Traceback" not in result.stderr and not target.exists()
