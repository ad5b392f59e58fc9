"""An owner gets her weights out: a `Checkpointer` checkpoint (numpy's RNG state in it)
pulls to FILE.pt, which `torch.load(weights_only=True)` reads, and to FILE.safetensors,
which holds the model's weights and says in one line what it leaves out (issue 29)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
import torch
import torch.distributed.checkpoint as dcp

from slurm_geo.ckpt import LocalDirStore, Repository, create_master_key_file, load_master_key
from slurm_geo.torch.checkpointer import Checkpointer
from slurm_geo.torch.distributed import StorageWriter

RUN = "weights-out"


def slurm_geo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slurm_geo", *args], capture_output=True,
                          text=True, timeout=120, check=False, env=dict(os.environ))


@pytest.fixture
def saved(tmp_path):
    """Run RUN at step 3, saved by a Checkpointer after two Adam steps; the model."""
    key_file = tmp_path / "master.key"
    create_master_key_file(key_file)
    (tmp_path / "store").mkdir()
    repository = Repository(LocalDirStore(tmp_path / "store"), load_master_key(key_file))
    torch.manual_seed(0)
    numpy.random.seed(7)
    random.seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    optimizer = torch.optim.Adam(model.parameters())
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(4, 6)).sum().backward()
        optimizer.step()
    with Checkpointer(repository, RUN) as checkpointer:
        checkpointer.save(3, model, optimizer, data_position={"epoch": 0, "batch": 3},
                          loss=torch.tensor(0.25))
    return key_file, model


def pull(tmp_path, key_file, to: Path, *extra: str) -> subprocess.CompletedProcess:
    return slurm_geo("ckpt", "pull", RUN, "--from", f"file://{tmp_path / 'store'}", "--to",
                     str(to), "--key-file", str(key_file), *extra)


def test_a_checkpointer_checkpoint_pulls_to_a_pt_that_loads_with_weights_only(tmp_path, saved):
    key_file, model = saved
    pulled = pull(tmp_path, key_file, tmp_path / "w.pt")
    assert pulled.returncode == 0, pulled.stderr
    assert pulled.stderr == ""

    state = torch.load(tmp_path / "w.pt", weights_only=True)
    assert set(state) == {"model", "optimizer", "scheduler", "rng", "data_position", "extra"}
    fresh = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    fresh.load_state_dict(state["model"])
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name
    optimizer = torch.optim.Adam(fresh.parameters())
    optimizer.load_state_dict(state["optimizer"])
    assert state["data_position"] == {"epoch": 0, "batch": 3}

    # numpy's RNG state is a uint32 tensor now: `.numpy()` gives numpy its state back.
    name, keys, position, has_gauss, cached = state["rng"]["numpy"]
    assert keys.dtype == torch.uint32 and type(position) is int
    numpy.random.seed(7)
    expected = numpy.random.get_state()
    numpy.random.set_state((name, keys.numpy(), position, has_gauss, cached))
    after = numpy.random.get_state()
    assert after[0] == expected[0] and numpy.array_equal(after[1], expected[1])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])


def test_a_checkpointer_checkpoint_pulls_to_safetensors_as_the_models_weights(tmp_path, saved):
    from safetensors.torch import load_file

    key_file, model = saved
    pulled = pull(tmp_path, key_file, tmp_path / "w.safetensors")
    assert pulled.returncode == 0, pulled.stderr
    note = pulled.stderr.strip()
    assert "\n" not in note and note.startswith("slurm-geo: note: w.safetensors holds the "
                                                "model's weights only")
    assert "left out: optimizer, rng, data_position" in note and "FILE.pt" in note

    weights = load_file(tmp_path / "w.safetensors")
    assert weights.keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        assert torch.equal(weights[name], value), name

    as_json = pull(tmp_path, key_file, tmp_path / "j.safetensors", "--json")
    assert as_json.returncode == 0 and as_json.stderr == "", as_json.stderr
    assert json.loads(as_json.stdout)["left_out"] == ["optimizer", "rng", "data_position"]


def test_numpy_state_through_dcp_pulls_to_a_pt_that_loads_with_weights_only(tmp_path):
    key_file = tmp_path / "master.key"
    create_master_key_file(key_file)
    (tmp_path / "store").mkdir()
    numpy.random.seed(3)
    state = {"w": torch.arange(6.0), "rng": {"numpy": numpy.random.get_state()},
             "scale": numpy.float32(0.5)}
    writer = StorageWriter(f"file://{tmp_path / 'store'}", run=RUN, step=1, key_file=key_file)
    dcp.save(state, storage_writer=writer, no_dist=True)

    pulled = pull(tmp_path, key_file, tmp_path / "d.pt")
    assert pulled.returncode == 0, pulled.stderr
    back = torch.load(tmp_path / "d.pt", weights_only=True)
    assert torch.equal(back["w"], state["w"])
    keys = back["rng"]["numpy"][1]
    assert isinstance(keys, torch.Tensor) and numpy.array_equal(keys.numpy(),
                                                                state["rng"]["numpy"][1])
    assert back["scale"] == 0.5
