"""Sealed objects (docs/format.md §5): wrapped data keys, manifests and latest pointers.

Each object gets its own key, derived from a fresh salt, so the fixed all-zero nonce is
used once per key. The header and the object name are associated data: a sealed object
cannot be altered or moved to another name without failing to open.
"""

from __future__ import annotations

import struct
from enum import IntEnum

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from slurm_geo.ckpt.errors import CorruptObject, UnsupportedFormat, WrongKey
from slurm_geo.ckpt.keys import FINGERPRINT_SIZE, INFO_SEAL, SALT_SIZE, derive_key, fingerprint

MAGIC = b"SGEOSEAL"
VERSION = 1
_HEADER = struct.Struct(f"<8sBB{FINGERPRINT_SIZE}s{SALT_SIZE}s")
HEADER_SIZE = _HEADER.size
TAG_SIZE = 16
_NONCE = bytes(12)


class Kind(IntEnum):
    DATA_KEY = 1
    MANIFEST = 2
    LATEST = 3
    PROMOTED = 4
    FENCE = 5


def seal(key: bytes, kind: Kind, salt: bytes, payload: bytes, name: str) -> bytes:
    header = _HEADER.pack(MAGIC, VERSION, kind, fingerprint(key), salt)
    cipher = AESGCM(derive_key(key, salt, INFO_SEAL))
    return header + cipher.encrypt(_NONCE, payload, header + name.encode())


def open_sealed(key: bytes, kind: Kind, sealed: bytes, name: str) -> bytes:
    """The payload of `sealed`, read from object `name`; checks in the order of §5."""
    if len(sealed) < HEADER_SIZE + TAG_SIZE or not sealed.startswith(MAGIC):
        raise CorruptObject(name, "not a sealed object: short or bad magic")
    _magic, version, found_kind, found_print, salt = _HEADER.unpack_from(sealed)
    if version != VERSION:
        raise UnsupportedFormat(name, version)
    if found_kind != kind:
        raise CorruptObject(name, f"holds a sealed object of kind {found_kind}, not {kind:d}")
    if found_print != fingerprint(key):
        raise WrongKey(name, found_print.hex(), fingerprint(key).hex())
    cipher = AESGCM(derive_key(key, salt, INFO_SEAL))
    header = sealed[:HEADER_SIZE]
    try:
        return cipher.decrypt(_NONCE, sealed[HEADER_SIZE:], header + name.encode())
    except InvalidTag:
        raise CorruptObject(name, "authentication failed: altered or truncated") from None
