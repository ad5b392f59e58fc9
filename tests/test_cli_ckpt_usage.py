"""`slurm-geo ckpt ls` (sizes, bytes added, dedup, off-site) and `ckpt stats` over a store
written by the library, with the off-site status from a checkpoint-sync state database."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from slurm_geo.ckpt import LocalDirStore, Metadata, Repository, Tensor
from slurm_geo.ckpt.format.keys import KeyFile, write_key_file
from slurm_geo.ckpt.ops.usage import pack_sizes
from slurm_geo.cli import cli
from slurm_geo.sync.state import StateDB, Status

KEY = bytes(range(32))
OLD_KEYS = ["run", "step", "epoch", "loss", "created_at", "cluster", "job_id", "latest",
            "promoted"]
FROZEN = Tensor("frozen", "float32", (16384,), random.Random(1).randbytes(65536))
EXTRA = b'{"epoch": 1}'


def head(seed: int) -> Tensor:
    return Tensor("head", "float32", (1024,), random.Random(seed).randbytes(4096))


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "master.key"
    write_key_file(path, KeyFile(KEY))
    return path


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Run `r`: step 10, then step 20 sharing its frozen tensor; run `s`: one step; and
    the packs of a deleted run `gone`, which no checkpoint references any more. Only
    read by the tests."""
    root = tmp_path_factory.mktemp("pfs")
    repository = Repository(LocalDirStore(root), KEY)
    for step, parent in ((10, None), (20, 10)):
        repository.write_checkpoint("r", [FROZEN, head(step)], EXTRA, metadata(step),
                                    parent=parent)
    repository.write_checkpoint("s", [head(5)], b"", metadata(5))
    repository.write_checkpoint("gone", [head(7)], b"", metadata(7))
    repository.delete_checkpoint("gone", 7)
    return root


def metadata(step: int) -> Metadata:
    return Metadata(step, step, 1, 0.5, "2026-12-01T00:00:00Z", "onprem", "42")


def invoke(*args: str, env: dict[str, str] | None = None):
    result = CliRunner(env=env).invoke(cli, list(args))
    assert result.exit_code == 0, (result.output, result.exception)
    return result


@pytest.fixture
def no_config(tmp_path):
    return {"SLURM_GEO_CONFIG": str(tmp_path / "absent.toml")}


def test_ls_json_keeps_its_keys_and_adds_exact_sizes(store, key_file, no_config):
    rows = json.loads(invoke("ckpt", "ls", "--store", f"file://{store}", "--json",
                             "--key-file", str(key_file), env=no_config).stdout)
    assert [(r["run"], r["step"]) for r in rows] == [("r", 10), ("r", 20), ("s", 5)]
    first, second, other = rows
    assert set(OLD_KEYS) <= set(first) and first["latest"] is False and second["latest"]
    logical = 65536 + 4096 + len(EXTRA)
    assert first["logical_bytes"] == second["logical_bytes"] == logical
    assert first["added_bytes"] == first["referenced_bytes"]
    # step 20 re-uses the frozen tensor's chunk: it adds only its head and extra state
    assert second["added_bytes"] < 4096 + len(EXTRA) + 200 < second["referenced_bytes"]
    assert second["dedup_ratio"] == logical / second["added_bytes"] > 10
    assert all(isinstance(r["added_bytes"], int) and r["offsite"] is None for r in rows)
    assert other["logical_bytes"] == 4096


def test_ls_table_shows_humanised_sizes_and_no_offsite_without_sync_state(store, key_file,
                                                                          no_config):
    lines = invoke("ckpt", "ls", "r", "--store", f"file://{store}", "--key-file",
                   str(key_file), env=no_config).stdout.splitlines()
    assert lines[0].split()[-4:] == ["SIZE", "ADDED", "DEDUP", "OFF-SITE"]
    size, added, dedup, offsite = zip(*(_last_columns(line) for line in lines[1:]),
                                      strict=True)
    assert size == ("68.0 KiB", "68.0 KiB") and offsite == ("-", "-")
    assert added[0].endswith(" KiB") and float(added[0].split()[0]) > 64
    assert added[1].endswith(" KiB") and float(added[1].split()[0]) < 5
    assert dedup[0] == "1.0x" and float(dedup[1].removesuffix("x")) > 10  # random bytes


def _last_columns(line: str) -> tuple[str, str, str, str]:
    """SIZE, ADDED, DEDUP and OFF-SITE of a line of the table."""
    *_, size, size_unit, added, added_unit, dedup, offsite = line.split()
    return f"{size} {size_unit}", f"{added} {added_unit}", dedup, offsite


@pytest.fixture
def synced(tmp_path, store):
    """A site whose checkpoint-sync replicates root `pfs` (the store): step 10 verified,
    step 20 uploading; run `s` not seen yet."""
    state = StateDB(tmp_path / "sync.db")
    now = time.time()
    ids = state.add([{"root": "pfs", "run": "r", "step": step, "destination": "offsite",
                      "sequence": i, "status": "pending"} for i, step in enumerate((10, 20))],
                    now)
    state.move(ids[0], Status.PENDING, Status.UPLOADING, now)
    state.move(ids[0], Status.UPLOADING, Status.REPLICATED, now)
    state.move(ids[0], Status.REPLICATED, Status.VERIFIED, now)
    state.move(ids[1], Status.PENDING, Status.UPLOADING, now)
    state.close()
    config = tmp_path / "site.toml"
    config.write_text(f"""
[stores.pfs]
url = "file://{store}"
region = "home"
[stores.offsite]
url = "file://{tmp_path / 'offsite'}"
region = "remote"
[sync]
roots = ["pfs"]
destination = "offsite"
state = "{tmp_path / 'sync.db'}"
""")
    return config


@pytest.mark.parametrize("spec", ["pfs", "url"])
def test_ls_offsite_from_the_configured_sync_state(synced, store, key_file, spec):
    target = "pfs" if spec == "pfs" else f"file://{store}"
    rows = json.loads(invoke("ckpt", "ls", "--store", target, "--config", str(synced),
                             "--json", "--key-file", str(key_file)).stdout)
    assert {(r["run"], r["step"]): r["offsite"] for r in rows} == {
        ("r", 10): "verified", ("r", 20): "uploading", ("s", 5): "pending"}
    table = invoke("ckpt", "ls", "r", "--store", target, "--config", str(synced),
                   "--key-file", str(key_file)).stdout.splitlines()
    assert [line.split()[-1] for line in table] == ["OFF-SITE", "verified", "uploading"]


def test_ls_offsite_of_a_store_checkpoint_sync_does_not_read_is_unknown(synced, tmp_path,
                                                                        key_file):
    (tmp_path / "offsite").mkdir()
    rows = json.loads(invoke("ckpt", "ls", "--store", "offsite", "--config", str(synced),
                             "--json", "--key-file", str(key_file)).stdout)
    assert rows == []
    other = tmp_path / "copy"
    Repository(LocalDirStore(other.mkdir() or other), KEY).write_checkpoint(
        "r", [head(1)], b"", metadata(10))
    rows = json.loads(invoke("ckpt", "ls", "--store", f"file://{other}", "--config",
                             str(synced), "--json", "--key-file", str(key_file)).stdout)
    assert [r["offsite"] for r in rows] == [None]


def test_ls_with_an_unreadable_configured_state_warns_and_lists(synced, tmp_path, store,
                                                                key_file):
    (tmp_path / "sync.db").write_bytes(b"not a database\n" * 100)
    result = invoke("ckpt", "ls", "--store", "pfs", "--config", str(synced), "--json",
                    "--key-file", str(key_file))
    assert [r["offsite"] for r in json.loads(result.stdout)] == [None, None, None]
    assert result.stderr.startswith("slurm-geo: warning: OFF-SITE not shown: sync state")
    assert result.stderr.count("\n") == 1


def test_ls_sync_state_flag_overrides_and_a_missing_one_is_one_line(synced, tmp_path, store,
                                                                    key_file, no_config):
    rows = json.loads(invoke("ckpt", "ls", "r", "--store", f"file://{store}", "--sync-state",
                             str(tmp_path / "sync.db"), "--json", "--key-file",
                             str(key_file), env=no_config).stdout)
    assert [r["offsite"] for r in rows] == [None, None]  # no config: `pfs` is not this store
    result = subprocess.run(
        [sys.executable, "-m", "slurm_geo", "ckpt", "ls", "--store", "pfs", "--config",
         str(synced), "--sync-state", str(tmp_path / "absent.db"), "--key-file",
         str(key_file)], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 40 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "no sync state database at" in result.stderr


def test_stats_per_run_and_the_store_total(store, key_file, no_config):
    document = json.loads(invoke("ckpt", "stats", "--store", f"file://{store}", "--json",
                                 "--key-file", str(key_file), env=no_config).stdout)
    r, s = document["runs"]
    assert (r["run"], r["checkpoints"], s["run"], s["checkpoints"]) == ("r", 2, "s", 1)
    assert r["logical_bytes"] == 2 * (65536 + 4096 + len(EXTRA))
    assert r["stored_bytes"] < r["pack_bytes"] and r["dedup_ratio"] > 1.5
    total = document["total"]
    sizes = pack_sizes(LocalDirStore(store))
    assert total["pack_bytes"] == sum(sizes.values())
    assert total["unreferenced_pack_bytes"] == (
        total["pack_bytes"] - r["pack_bytes"] - s["pack_bytes"]) > 0   # run `gone`'s
    assert (total["runs"], total["checkpoints"]) == (2, 3)
    assert total["stored_bytes"] == r["stored_bytes"] + s["stored_bytes"]
    assert total["dedup_ratio"] == total["logical_bytes"] / total["stored_bytes"]

    lines = invoke("ckpt", "stats", "--store", f"file://{store}", "--key-file",
                   str(key_file), env=no_config).stdout.splitlines()
    assert lines[0].split() == ["RUN", "CHECKPOINTS", "SIZE", "STORED", "PACKS", "DEDUP"]
    assert [line.split()[0] for line in lines[1:4]] == ["r", "s", "(store)"]
    assert "of packs no checkpoint references (`slurm-geo ckpt gc` deletes them)" in lines[4]


def test_stats_of_one_run_has_no_store_total_and_an_unknown_run_is_refused(store, key_file,
                                                                           no_config):
    document = json.loads(invoke("ckpt", "stats", "--store", f"file://{store}", "--run", "s",
                                 "--json", "--key-file", str(key_file), env=no_config).stdout)
    assert [r["run"] for r in document["runs"]] == ["s"] and document["total"] is None
    result = CliRunner(env=no_config).invoke(cli, ["ckpt", "stats", "--store",
                                                   f"file://{store}", "--run", "nope",
                                                   "--key-file", str(key_file)])
    assert "run 'nope' has no checkpoint in file://" in str(result.exception)
