"""Checkpoints written under a fence (a run's generation, holder and resume step) and the
seals of the format before it, as the fence, rotation, reseal, sharded and sync tests write
them."""

from __future__ import annotations

import json
import random
import struct

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from slurm_geo.ckpt import LocalDirStore, Metadata, Repository, Tensor, WriteOptions
from slurm_geo.ckpt.format.keys import INFO_SEAL, derive_key, fingerprint
from slurm_geo.ckpt.format.seal import Kind
from slurm_geo.ckpt.repo.fence import (
    Fence,
)

KEY = bytes(range(32))
OPTIONS = WriteOptions(chunk_size=4096, pack_size=16 * 1024)


def save(repo: Repository, run: str, step: int, cluster: str, seed: int = 0) -> None:
    rng = random.Random(seed + step)
    data = struct.pack("<512f", *(rng.gauss(0, 1) for _ in range(512)))
    repo.write_checkpoint(run, [Tensor("w", "float32", (512,), data)], b"{}",
                          Metadata(step, step, 0, None, "2026-11-29T12:00:00Z", cluster, "1"))


def repo(tmp_path, name: str) -> tuple[LocalDirStore, Repository]:
    (tmp_path / name).mkdir()
    store = LocalDirStore(tmp_path / name)
    return store, Repository(store, KEY, OPTIONS)


def fence(generation=1, holder="rented", resume=20) -> Fence:
    return Fence("run", generation, holder, resume, "2026-11-29T12:00:00+00:00")


def legacy_seal(key: bytes, kind: Kind, payload: bytes, name: str) -> bytes:
    """A version 1 sealed object as writers before the fence key wrote kinds 4 and 5:
    the layout of §5 under the run's data key, written here from the spec alone."""
    header = b"SGEOSEAL" + bytes([1, kind]) + fingerprint(key) + SALT
    return header + AESGCM(derive_key(key, SALT, INFO_SEAL)).encrypt(
        bytes(12), payload, header + name.encode())


SALT = bytes(range(0xA0, 0xB0))
FORGED = (json.dumps({"run": "run", "generation": 999, "holder": "rented", "resume_step": None,
                      "set_at": "2026-11-29T12:00:00+00:00"}).encode())
