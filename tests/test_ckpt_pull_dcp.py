"""A multi-rank checkpoint through DCP in one process: `slurm-geo ckpt pull` writes what
torch reads without slurm-geo (a DCP directory for FileSystemReader, or a torch.save
file), and the coordinator's push lock keeps gc off a save in flight."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from slurm_geo.ckpt.errors import StoreBusy
from slurm_geo.ckpt.format.names import manifest_name
from slurm_geo.ckpt.ops.gc import collect_garbage
from slurm_geo.torch.distributed import StorageWriter
from tests.helpers import stored_packs
from tests.kit.sharded import COLUMNS, KEY, ROWS, RUN, half, repo, save_on_two_ranks

NOTE = "resumed at step 10; it's fine"  # DCP stores a value that is no container as bytes


def slurm_geo(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slurm_geo", *args], capture_output=True,
                          text=True, timeout=120, check=False, env={**os.environ, **(env or {})})


@pytest.fixture
def key_file(tmp_path) -> Path:
    path = tmp_path / "master.key"
    path.write_bytes(KEY)
    path.chmod(0o600)
    return path


def training_state() -> dict:
    generator = torch.Generator().manual_seed(0)
    return {
        "model": {"layer.weight": torch.randn(24, 16, generator=generator),
                  "layer.bias": torch.randn(24, generator=generator).to(torch.bfloat16),
                  "empty": torch.zeros(0, 4), "scale": torch.tensor(2.5, dtype=torch.float64)},
        "optimizer": {"state": {0: {"step": torch.tensor(7), "exp_avg": torch.ones(24, 16)}},
                      "param_groups": [{"lr": 0.001, "params": [0]}]},
        "step": 7, "note": NOTE, "schedule": [0.1, 0.01],
    }


def like(state):
    """A state of the same structure with every tensor zeroed: what dcp.load fills."""
    if isinstance(state, dict):
        return {k: like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [like(v) for v in state]
    return torch.zeros_like(state) if isinstance(state, torch.Tensor) else None


def assert_same(loaded, saved, where: str = "") -> None:
    if isinstance(saved, dict):
        assert loaded.keys() == saved.keys(), where
        for key, value in saved.items():
            assert_same(loaded[key], value, f"{where}.{key}")
    elif isinstance(saved, list):
        assert len(loaded) == len(saved), where
        for i, value in enumerate(saved):
            assert_same(loaded[i], value, f"{where}[{i}]")
    elif isinstance(saved, torch.Tensor):
        assert loaded.dtype == saved.dtype and torch.equal(loaded, saved), where
    else:
        assert loaded == saved, where


def save_through_dcp(store: Path, key_file: Path, state: dict, step: int,
                     before_commit=None) -> None:
    writer = StorageWriter(f"file://{store}", run=RUN, step=step, key_file=key_file,
                           before_commit=before_commit)
    dcp.save(state, storage_writer=writer, no_dist=True)


def pull(tmp_path, key_file, target: str, to: Path, **env: str) -> subprocess.CompletedProcess:
    return slurm_geo("ckpt", "pull", target, "--from", f"file://{tmp_path / 'store'}", "--to",
                     str(to), "--json", "--key-file", str(key_file), env=env)


def test_a_dcp_save_pulls_to_a_directory_dcp_loads_and_to_a_torch_file(tmp_path, key_file):
    store, repository = repo(tmp_path)
    saved = training_state()
    save_through_dcp(tmp_path / "store", key_file, saved, 10)
    assert repository.manifest(RUN, 10).sharded is not None

    pulled = pull(tmp_path, key_file, RUN, tmp_path / "dcp")
    assert pulled.returncode == 0, pulled.stderr
    summary = json.loads(pulled.stdout)
    written = sum(f.stat().st_size for f in (tmp_path / "dcp").rglob("*") if f.is_file())
    assert summary.pop("bytes") == written and isinstance(summary.pop("seconds"), float)
    assert summary == {"run": RUN, "step": 10, "to": str(tmp_path / "dcp"), "as": "dcp"}
    assert pulled.stderr == ""
    loaded = like(saved)
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(tmp_path / "dcp"), no_dist=True)
    assert_same(loaded, saved)

    as_file = pull(tmp_path, key_file, f"{RUN}@10", tmp_path / "state.pt")
    assert as_file.returncode == 0, as_file.stderr
    # What torch makes of a DCP directory (its flattening turns dict keys into strings).
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "reference.pt")
    assert_same(torch.load(tmp_path / "state.pt", weights_only=True),
                torch.load(tmp_path / "reference.pt", weights_only=True))


def test_a_two_rank_save_pulls_whole(tmp_path, key_file):
    _, repository = repo(tmp_path)
    note = io.BytesIO()
    torch.save(NOTE, note)  # a bytes item is what DCP serialises a value to
    save_on_two_ranks(repository, 10, extra=note.getvalue())

    pulled = pull(tmp_path, key_file, f"{RUN}@10", tmp_path / "dcp")
    assert pulled.returncode == 0, pulled.stderr
    loaded = {"w": torch.zeros(2 * ROWS, COLUMNS), "extra": None}
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(tmp_path / "dcp"), no_dist=True)

    rows = [torch.frombuffer(bytearray(half(rank, 10, False)), dtype=torch.float32)
            for rank in (0, 1)]
    assert torch.equal(loaded["w"], torch.cat(rows).reshape(2 * ROWS, COLUMNS))
    assert loaded["extra"] == NOTE


def test_a_damaged_pack_fails_the_pull_naming_it_and_writes_no_checkpoint(tmp_path, key_file):
    store, repository = repo(tmp_path)
    save_through_dcp(tmp_path / "store", key_file, training_state(), 10)
    damaged = stored_packs(store)[0]
    data = bytearray((tmp_path / "store" / damaged).read_bytes())
    data[len(data) // 2] ^= 0x01
    (tmp_path / "store" / damaged).write_bytes(bytes(data))

    pulled = pull(tmp_path, key_file, RUN, tmp_path / "dcp")

    assert pulled.returncode == 21  # CorruptObject
    assert damaged in pulled.stderr and "Traceback" not in pulled.stderr
    assert not (tmp_path / "dcp" / ".metadata").exists()


def without_torch(tmp_path: Path) -> dict[str, str]:
    """An environment in which `import torch` fails, as where PyTorch is not installed."""
    shadow = tmp_path / "no-torch" / "torch"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n")
    return {"PYTHONPATH": os.pathsep.join([str(shadow.parent), *sys.path])}


def test_without_torch_a_multi_rank_pull_is_one_clear_line_and_other_commands_work(
        tmp_path, key_file):
    _, repository = repo(tmp_path)
    save_on_two_ranks(repository, 10)
    env = without_torch(tmp_path)

    pulled = pull(tmp_path, key_file, RUN, tmp_path / "dcp", **env)
    assert pulled.returncode == 3
    assert pulled.stderr.strip().count("\n") == 0 and "Traceback" not in pulled.stderr
    assert "multi-rank checkpoint" in pulled.stderr and "pip install torch" in pulled.stderr
    for command in (["ls"], ["verify", RUN]):
        done = slurm_geo("ckpt", *command, "--store", f"file://{tmp_path / 'store'}",
                         "--key-file", str(key_file), env=env)
        assert done.returncode == 0, done.stderr


def test_gc_waits_while_the_coordinator_holds_its_push_lock(tmp_path, key_file):
    store, repository = repo(tmp_path)
    refused = []

    def collect_before_the_commit() -> None:
        with pytest.raises(StoreBusy, match="locks/") as busy:
            collect_garbage(store, repository, datetime.now(UTC))
        refused.append(busy.value)

    save_through_dcp(tmp_path / "store", key_file, training_state(), 10,
                     before_commit=collect_before_the_commit)

    assert refused and store.list("locks/") == []
    assert store.exists(manifest_name(RUN, 10))
    report = collect_garbage(store, repository, datetime.now(UTC))
    assert report.deleted_packs == [] and report.kept_packs == len(stored_packs(store))
    assert repository.verify(RUN, 10) == []
