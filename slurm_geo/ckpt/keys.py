"""Key material (docs/format.md §4): the site master key file and per-run derived keys."""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import blake3
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from slurm_geo.ckpt.errors import KeyFileError

KEY_SIZE = 32
SALT_SIZE = 16
FINGERPRINT_SIZE = 8

INFO_CHUNK_ID = b"slurm-geo/v1/chunk-id"
INFO_PACK = b"slurm-geo/v1/pack"
INFO_SEAL = b"slurm-geo/v1/seal"
# Fences and promotion markers are sealed under keys only the master key yields, which the
# daemons hold and no job does (a job holds its run's data key): docs/format.md §4, §8.4.
INFO_FENCE = b"slurm-geo/v1/fence"
INFO_PROMOTION = b"slurm-geo/v1/promotion"
# The federation state's values in etcd, where the rented site's member must read nothing.
INFO_FEDERATION_STATE = b"slurm-geo/v1/federation-state"
_FINGERPRINT_MESSAGE = b"slurm-geo/v1/fingerprint"

RandomBytes = Callable[[int], bytes]


def derive_key(ikm: bytes, salt: bytes | None, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=KEY_SIZE, salt=salt, info=info).derive(ikm)


def fence_key(master_key: bytes) -> bytes:
    """`F`: seals every fence of the site (the object name binds it to its run)."""
    return derive_key(master_key, None, INFO_FENCE)


def promotion_key(master_key: bytes) -> bytes:
    """`P`: seals every promotion marker of the site."""
    return derive_key(master_key, None, INFO_PROMOTION)


def federation_state_key(master_key: bytes) -> bytes:
    """`S`: seals every value the federation daemon keeps in etcd (the etcd key binds it)."""
    return derive_key(master_key, None, INFO_FEDERATION_STATE)


def fingerprint(key: bytes) -> bytes:
    return hmac.digest(key, _FINGERPRINT_MESSAGE, hashlib.sha256)[:FINGERPRINT_SIZE]


# The manifest format from which chunk ids are keyed BLAKE3 (docs/format.md §4): at
# 3-4 GB/s a core it costs a quarter of HMAC-SHA256, which was a fifth of a push's CPU.
BLAKE3_IDS_FROM = 2


def chunk_id(id_key: bytes, plaintext: bytes | bytearray | memoryview,
             manifest_format: int) -> bytes:
    """Keyed, so equal ids show the store only that two chunks of one run are equal."""
    if manifest_format >= BLAKE3_IDS_FROM:
        return blake3.blake3(plaintext, key=id_key).digest()
    return hmac.digest(id_key, plaintext, hashlib.sha256)


@dataclass(frozen=True)
class RunKeys:
    """A run's data key and what is derived from it once per run."""

    data_key: bytes = field(repr=False)
    id_key: bytes = field(repr=False, init=False)
    fingerprint: bytes = field(init=False)

    def __post_init__(self) -> None:
        if len(self.data_key) != KEY_SIZE:
            raise ValueError(f"a data key is {KEY_SIZE} bytes, not {len(self.data_key)}")
        object.__setattr__(self, "id_key", derive_key(self.data_key, None, INFO_CHUNK_ID))
        object.__setattr__(self, "fingerprint", fingerprint(self.data_key))


def create_master_key_file(path: Path, random_bytes: RandomBytes = os.urandom) -> bytes:
    """Write a new 0600 master key file; refuse to overwrite one (that would orphan runs)."""
    key = random_bytes(KEY_SIZE)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise KeyFileError(str(path), "already exists; refusing to replace a master key") from None
    except OSError as exc:
        raise KeyFileError(str(path), f"cannot create it ({exc.strerror})") from None
    try:
        os.write(fd, key)
        os.fsync(fd)
    finally:
        os.close(fd)
    return key


def load_master_key(path: Path) -> bytes:
    try:
        with open(path, "rb") as handle:
            info = os.fstat(handle.fileno())
            key = handle.read(KEY_SIZE + 1)
    except OSError as exc:
        raise KeyFileError(str(path), f"cannot read it ({exc.strerror})") from None
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(
            str(path), f"mode {stat.S_IMODE(info.st_mode):04o} lets others in; chmod 600 it"
        )
    if len(key) != KEY_SIZE:
        raise KeyFileError(str(path), f"holds {info.st_size} bytes, a master key is {KEY_SIZE}")
    return key
