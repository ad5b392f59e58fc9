"""The FSDP2 + DCP example (slurm_geo.examples.dcp_train) end to end under torchrun on
CPU: two ranks save, one rank resumes from their checkpoint (resharded) and goes on."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slurm_geo.ckpt import LocalDirStore, Repository, create_master_key_file
from slurm_geo.examples.dcp_train import BATCH, local_batch, parse_args

REPO_ROOT = Path(__file__).resolve().parent.parent
RUN = "dcp-run"


def torchrun(ranks: int, store: Path, key: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(ranks), "-m", "slurm_geo.examples.dcp_train", "--",
               "--store", f"file://{store}", "--run", RUN, "--key-file", str(key), *args]
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, text=True, capture_output=True,
                          timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def weights(out: str, event: str, step: int) -> str:
    match = re.search(rf"^{event} {step} weights ([0-9a-f]{{64}})$", out, re.MULTILINE)
    assert match, out
    return match.group(1)


def frozen_chunks(repo: Repository, step: int) -> dict[str, tuple[object, ...]]:
    return {t.path: t.chunks for t in repo.manifest(RUN, step).tensors
            if t.path.startswith("app.model.0.")}


def test_the_global_batch_does_not_depend_on_the_number_of_ranks() -> None:
    data = (torch.arange(4 * BATCH * 2.0).reshape(4 * BATCH, 2),) * 2
    whole = local_batch(data, 3, 0, 1)[0]
    for world in (2, 4):
        parts = [local_batch(data, 3, rank, world)[0] for rank in range(world)]
        assert sorted(map(tuple, whole.tolist())) == \
            sorted(tuple(row) for part in parts for row in part.tolist())


def test_help_names_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert all(flag in out for flag in ("--store", "--run", "--key-file", "--steps", "--every"))


@pytest.mark.slow
def test_two_ranks_save_and_one_rank_resumes_from_their_checkpoint(tmp_path: Path) -> None:
    key, store = tmp_path / "master.key", tmp_path / "store with space"
    store.mkdir()
    repo = Repository(LocalDirStore(store), create_master_key_file(key))

    first = torchrun(2, store, key, "--steps", "4", "--every", "2")
    assert "world size 2, starting at step 0" in first
    assert "committed step 4" in first
    saved = weights(first, "saving step", 4)
    assert repo.steps(RUN) == [2, 4]
    assert repo.manifest(RUN, 4).sharded.ranks == 2  # type: ignore[union-attr]
    # The frozen layer's shards (weight and bias, one of each per rank) did not change:
    # step 4 references the very chunks step 2 stored.
    assert len(frozen_chunks(repo, 2)) == 4
    assert frozen_chunks(repo, 4) == frozen_chunks(repo, 2)

    second = torchrun(1, store, key, "--steps", "6", "--every", "2")
    # The one rank loaded exactly the state the two ranks saved, and went on from there.
    assert weights(second, "resumed from step", 4) == saved
    assert "world size 1, starting at step 4" in second
    assert "saving step 2 " not in second and "committed step 6" in second
    assert repo.steps(RUN) == [2, 4, 6]
    latest = repo.manifest(RUN, 6)
    assert (latest.parent_step, latest.sharded.ranks) == (4, 1)  # type: ignore[union-attr]
