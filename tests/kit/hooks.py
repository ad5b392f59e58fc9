"""A job's prolog and epilog environment as Slurm gives it, and a checkpoint saved the way
a training job saves one (the hooks' tests and the checkpoint-places tests use them)."""

from __future__ import annotations

import os
import random
import struct
from pathlib import Path

from slurm_geo.ckpt import Metadata, Repository, Tensor

RUN = "train-1"


def env_for(ckpt_dir: Path | None, restart: int = 0, **extra: str) -> dict[str, str]:
    env = {"SLURM_JOB_ID": "42", "SLURM_CLUSTER_NAME": "onprem", "SLURMD_NODENAME": "n1",
           "SLURM_JOB_RESTART_COUNT": str(restart), "SLURM_JOB_UID": str(os.getuid()),
           "SLURM_JOB_GID": str(os.getgid()), "SLURM_JOB_USER": "alice",
           "SLURM_JOB_NAME": "train", "SLURM_JOB_NODELIST": "n1", **extra}
    if ckpt_dir is not None:
        env["SPANK_GEO_CKPT_DIR"] = str(ckpt_dir)
        env["SPANK_GEO_RESIDENCY"] = "home"
    return env


def save(repo: Repository, step: int) -> None:
    data = struct.pack("<512f", *(random.Random(step).gauss(0, 1) for _ in range(512)))
    repo.write_checkpoint(RUN, [Tensor("model.w", "float32", (512,), data)], b"{}",
                          Metadata(step, step, 0, 1.0, "2026-11-29T15:00:00Z", "onprem", "42"))
