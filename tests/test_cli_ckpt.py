"""`slurm-geo ckpt` and `keys` end to end, as a user types them."""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from slurm_geo.ckpt import LocalDirStore, Metadata, Repository, Tensor, load_master_key
from tests.helpers import pack_files


def slurm_geo(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slurm_geo", *args], capture_output=True,
                          text=True, timeout=120, check=False, env={**os.environ, **(env or {})})


@pytest.fixture
def key_file(tmp_path) -> Path:
    path = tmp_path / "master.key"
    assert slurm_geo("keys", "init", str(path)).returncode == 0
    return path


def weights(seed: int) -> list[Tensor]:
    rng = random.Random(seed)
    return [Tensor("w", "float32", (4096,),
                   struct.pack("<4096f", *(rng.gauss(0, 1) for _ in range(4096))))]


@pytest.fixture
def local_run(tmp_path, key_file) -> Path:
    """A directory holding run `r` at steps 10 and 20, written by the library."""
    root = tmp_path / "pfs"
    root.mkdir()
    repository = Repository(LocalDirStore(root), load_master_key(key_file))
    for step in (10, 20):
        repository.write_checkpoint(
            "r", weights(step), b"{}", Metadata(step, step, 1, 0.5, "2026-11-29T12:00:00Z",
                                                "onprem", "42"))
    return root


def test_keys_init_makes_a_private_key_and_never_overwrites(tmp_path, key_file):
    assert key_file.stat().st_mode & 0o777 == 0o600
    again = slurm_geo("keys", "init", str(key_file))
    assert again.returncode == 3
    assert "already exists" in again.stderr and "Traceback" not in again.stderr


def test_push_ls_verify_pull_round_trip(tmp_path, key_file, local_run):
    dest = tmp_path / "offsite"
    dest.mkdir()
    url = f"file://{dest}"
    key = ["--key-file", str(key_file)]

    pushed = slurm_geo("ckpt", "push", str(local_run), "--to", url, "--json", *key)
    assert pushed.returncode == 0, pushed.stderr
    assert json.loads(pushed.stdout)["step"] == 20

    listed = json.loads(slurm_geo("ckpt", "ls", "--store", url, "--json", *key).stdout)
    assert [(row["run"], row["step"], row["latest"]) for row in listed] == [("r", 20, True)]

    assert slurm_geo("ckpt", "verify", "r", "--store", url, *key).returncode == 0

    pulled = slurm_geo("ckpt", "pull", "r@20", "--from", url, "--to", str(tmp_path / "back"),
                       *key)
    assert pulled.returncode == 0, pulled.stderr
    back = Repository(LocalDirStore(tmp_path / "back"), load_master_key(key_file))
    assert back.read_checkpoint("r", 20).tensors == weights(20)


def test_verify_names_each_damaged_pack_and_fails(tmp_path, key_file, local_run):
    url = f"file://{local_run}"
    pack = pack_files(local_run)[0]
    data = bytearray(pack.read_bytes())
    data[len(data) // 2] ^= 0x01
    pack.write_bytes(bytes(data))

    results = [slurm_geo("ckpt", "verify", f"r@{s}", "--store", url, "--key-file",
                         str(key_file)) for s in (10, 20)]

    failed = [r for r in results if r.returncode == 1]
    assert failed, "a flipped bit went unnoticed"
    for result in failed:
        assert pack.name in result.stderr
        assert "Traceback" not in result.stderr


def test_wrong_key_is_one_clear_error(tmp_path, local_run):
    other = tmp_path / "other.key"
    slurm_geo("keys", "init", str(other))
    result = slurm_geo("ckpt", "verify", "r", "--store", f"file://{local_run}",
                       "--key-file", str(other))
    assert result.returncode != 0
    assert "key" in result.stderr.lower() and "Traceback" not in result.stderr


@pytest.mark.parametrize("store, message", [
    ("ftp://host/x", "ftp://host/x"),
    ("nowhere", "store 'nowhere' is neither a URL"),
])
def test_bad_store_is_one_line(tmp_path, key_file, store, message):
    config = tmp_path / "site.toml"
    config.write_text("[site]\n")
    result = slurm_geo("ckpt", "ls", "--store", store, "--key-file", str(key_file),
                       env={"SLURM_GEO_CONFIG": str(config)})
    assert result.returncode != 0
    assert message in result.stderr
    assert result.stderr.strip().count("\n") == 0


def test_gc_after_nothing_was_deleted_keeps_everything(key_file, local_run):
    result = slurm_geo("ckpt", "gc", "--store", f"file://{local_run}", "--json",
                       "--key-file", str(key_file))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["deleted_packs"] == [] and report["kept_packs"] >= 1


@pytest.mark.sandbox
def test_push_to_the_sandbox_object_store_by_config_name(sandbox, key_file, local_run):
    run_env = {"SLURM_GEO_CONFIG": str(sandbox.layout.site_config), **sandbox.s3_env()}
    run = f"cli-{uuid.uuid4().hex[:8]}"
    src = Repository(LocalDirStore(local_run), load_master_key(key_file))
    src.write_checkpoint(run, weights(1), b"", Metadata(5, 5, 0, None, "t", "onprem", "1"))
    key = ["--key-file", str(key_file)]

    pushed = slurm_geo("ckpt", "push", str(local_run), "--run", run, "--to", "offsite", *key,
                       env=run_env)
    assert pushed.returncode == 0, pushed.stderr
    verified = slurm_geo("ckpt", "verify", run, "--store", "offsite", *key, env=run_env)
    assert verified.returncode == 0, verified.stderr
    assert f"{run}@5: ok" in verified.stdout


def test_prune_keeps_what_is_not_yet_off_site_then_trims_tier_one(tmp_path, key_file):
    master = load_master_key(key_file)
    local_root, offsite_root = tmp_path / "local", tmp_path / "offsite"
    local_root.mkdir()
    offsite_root.mkdir()
    local = Repository(LocalDirStore(local_root), master)
    for step in (1, 2, 3, 4):
        local.write_checkpoint("r", weights(step), b"",
                               Metadata(step, step, 0, None, "2026-11-29T12:00:00Z", "o", "1"))
    args = ["ckpt", "prune", "r", "--store", f"file://{local_root}", "--offsite",
            f"file://{offsite_root}", "--keep-local", "2", "--json", "--key-file", str(key_file)]

    before = json.loads(slurm_geo(*args).stdout)
    assert before["local_deleted"] == []
    assert before["awaiting_replication"] == [4, 3, 2, 1]

    for step in (1, 2, 3, 4):
        slurm_geo("ckpt", "push", str(local_root), "--run", "r", "--step", str(step), "--to",
                  f"file://{offsite_root}", "--key-file", str(key_file))
    after = json.loads(slurm_geo(*args).stdout)

    assert after["local_deleted"] == [2, 1]
    assert local.steps("r") == [3, 4]
    assert Repository(LocalDirStore(offsite_root), master).steps("r") == [1, 2, 3, 4]


def test_push_and_pull_a_plain_torch_save_file(tmp_path, key_file):
    import torch

    state = {"layer.weight": torch.randn(64, 32),
             "layer.bias": torch.zeros(64, dtype=torch.bfloat16), "steps": 7, "note": "it's"}
    source = tmp_path / "model.pt"
    torch.save(state, source)
    store = tmp_path / "store"
    store.mkdir()
    key = ["--key-file", str(key_file)]

    pushed = slurm_geo("ckpt", "push", str(source), "--to", f"file://{store}", "--run", "ft",
                       "--step", "3", *key)
    assert pushed.returncode == 0, pushed.stderr
    pulled = slurm_geo("ckpt", "pull", "ft@3", "--from", f"file://{store}", "--to",
                       str(tmp_path / "back.pt"), *key)
    assert pulled.returncode == 0, pulled.stderr

    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert back.keys() == state.keys()
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(back[name], value) and back[name].dtype == value.dtype
        else:
            assert back[name] == value


def test_push_of_a_torch_file_needs_run_and_step(tmp_path, key_file):
    source = tmp_path / "model.pt"
    source.write_bytes(b"not really")
    result = slurm_geo("ckpt", "push", str(source), "--to", f"file://{tmp_path}",
                       "--key-file", str(key_file))
    assert result.returncode == 3
    assert "give --run RUN --step N" in result.stderr


def test_push_of_a_file_that_is_not_a_torch_save_is_one_clear_error(tmp_path, key_file):
    source = tmp_path / "notes.txt"
    source.write_text("just text")
    result = slurm_geo("ckpt", "push", str(source), "--to", f"file://{tmp_path}", "--run", "r",
                       "--step", "1", "--key-file", str(key_file))
    assert result.returncode != 0
    assert "notes.txt" in result.stderr and "torch.save" in result.stderr
    assert "Traceback" not in result.stderr
