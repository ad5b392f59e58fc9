"""Sealed objects (docs/format.md §5): wrapped data keys, manifests, latest pointers,
promotion markers, fences, and the federation state's values in etcd.

Each object gets its own key, derived from a fresh salt, so the fixed all-zero nonce is
used once per key. The header and the object name are associated data: a sealed object
cannot be altered or moved to another name without failing to open.

Fences, promotion markers and verification records are sealed objects of version 2: the
same layout, sealed under the fence or promotion key (docs/format.md §4), which no job
holds. Their version 1 form
was sealed under the run's data key, which every job of the run holds; it is refused.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from enum import IntEnum

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from slurm_geo.ckpt.errors import CorruptObject, LegacyObject, UnsupportedFormat, WrongKey
from slurm_geo.ckpt.format.keys import (
    FINGERPRINT_SIZE,
    INFO_SEAL,
    SALT_SIZE,
    derive_key,
    fingerprint,
)

MAGIC = b"SGEOSEAL"
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
    FEDERATION_STATE = 6
    VERIFIED = 7


# The version each kind is written in; a reader accepts that one only.
VERSION_OF_KIND = {Kind.DATA_KEY: 1, Kind.MANIFEST: 1, Kind.LATEST: 1, Kind.PROMOTED: 2,
                   Kind.FENCE: 2, Kind.FEDERATION_STATE: 1, Kind.VERIFIED: 2}
_VERSIONS = frozenset(VERSION_OF_KIND.values())
_LEGACY = {
    Kind.PROMOTED: ("promotion marker", "if it was promoted before the upgrade, run "
                    "`slurm-geo ckpt reseal` once (docs/install.md), else promote it again"),
    Kind.FENCE: ("fence", "the federation daemon rewrites the fences its state knows; "
                 "one it does not know can be deleted"),
}


def seal(key: bytes, kind: Kind, salt: bytes, payload: bytes, name: str) -> bytes:
    header = _HEADER.pack(MAGIC, VERSION_OF_KIND[kind], kind, fingerprint(key), salt)
    cipher = AESGCM(derive_key(key, salt, INFO_SEAL))
    return header + cipher.encrypt(_NONCE, payload, header + name.encode())


def open_sealed(key: bytes, kind: Kind, sealed: bytes, name: str) -> bytes:
    """The payload of `sealed`, read from object `name`; checks in the order of §5."""
    return _open(key, kind, sealed, name, VERSION_OF_KIND[kind])


def open_with_ring(keys: Sequence[bytes], kind: Kind, sealed: bytes, name: str) -> bytes:
    """`open_sealed` under the one of `keys` whose fingerprint the header names: during a
    rotation (§8.5) an object may be sealed under the new key or the one it replaces.
    Under the first key when none matches, so that the error names that one."""
    found = sealing_fingerprint(sealed)
    key = next((k for k in keys if fingerprint(k) == found), keys[0])
    return open_sealed(key, kind, sealed, name)


def sealing_fingerprint(sealed: bytes) -> bytes | None:
    """The fingerprint of the key `sealed` names as its sealing key; None without a header."""
    if len(sealed) < HEADER_SIZE or not sealed.startswith(MAGIC):
        return None
    return bytes(_HEADER.unpack_from(sealed)[3])


def open_legacy(key: bytes, kind: Kind, sealed: bytes, name: str) -> bytes:
    """A version 1 promotion marker or fence, under the run's data key it was sealed with:
    the old rule, for `slurm-geo ckpt reseal` to read once at the upgrade (§8.4)."""
    if kind not in _LEGACY:
        raise ValueError(f"kind {kind:d} has no older version")
    return _open(key, kind, sealed, name, 1)


def _open(key: bytes, kind: Kind, sealed: bytes, name: str, wanted: int) -> bytes:
    if len(sealed) < HEADER_SIZE + TAG_SIZE or not sealed.startswith(MAGIC):
        raise CorruptObject(name, "not a sealed object: short or bad magic")
    _magic, version, found_kind, found_print, salt = _HEADER.unpack_from(sealed)
    if version not in _VERSIONS:
        raise UnsupportedFormat(name, version, "1 and 2")
    if found_kind != kind:
        raise CorruptObject(name, f"holds a sealed object of kind {found_kind}, not {kind:d}")
    if version != wanted:
        if kind in _LEGACY and version == 1:
            raise LegacyObject(name, *_LEGACY[kind])
        raise UnsupportedFormat(name, version, f"{wanted} for this kind")
    if found_print != fingerprint(key):
        raise WrongKey(name, found_print.hex(), fingerprint(key).hex())
    cipher = AESGCM(derive_key(key, salt, INFO_SEAL))
    header = sealed[:HEADER_SIZE]
    try:
        return cipher.decrypt(_NONCE, sealed[HEADER_SIZE:], header + name.encode())
    except InvalidTag:
        raise CorruptObject(name, "authentication failed: altered or truncated") from None
