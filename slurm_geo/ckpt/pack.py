"""Packs (docs/format.md §6): many encrypted blobs in one object, pure over bytes.

Each pack derives its own key from a fresh salt and uses each entry's offset as its
nonce, so nonces never repeat under a key without relying on random nonces.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from slurm_geo.ckpt.errors import CorruptObject, UnsupportedFormat
from slurm_geo.ckpt.keys import INFO_PACK, SALT_SIZE, derive_key

MAGIC = b"SGEOPACK"
VERSION = 1
_HEADER = struct.Struct(f"<8sB{SALT_SIZE}s")
_ENTRY_HEAD = struct.Struct("<32sI")
HEADER_SIZE = _HEADER.size
ENTRY_OVERHEAD = _ENTRY_HEAD.size + 16  # id, length, GCM tag


@dataclass(frozen=True)
class Entry:
    """Where one blob sits in a pack: the range [offset, offset + length)."""

    chunk_id: bytes
    offset: int
    length: int


def _nonce(offset: int) -> bytes:
    return offset.to_bytes(12, "big")


class PackWriter:
    """Appends blobs one by one; the pack's name is known only once it is finished."""

    def __init__(self, data_key: bytes, salt: bytes):
        self._cipher = AESGCM(derive_key(data_key, salt, INFO_PACK))
        self._buffer = bytearray(_HEADER.pack(MAGIC, VERSION, salt))

    @property
    def size(self) -> int:
        return len(self._buffer)

    def add(self, chunk_id: bytes, blob: bytes) -> Entry:
        offset = len(self._buffer)
        sealed = self._cipher.encrypt(_nonce(offset), blob, chunk_id)
        self._buffer += _ENTRY_HEAD.pack(chunk_id, len(sealed))
        self._buffer += sealed
        return Entry(chunk_id, offset, _ENTRY_HEAD.size + len(sealed))

    def finish(self) -> tuple[str, bytes]:
        """The pack id (its SHA-256) and its bytes."""
        data = bytes(self._buffer)
        return hashlib.sha256(data).hexdigest(), data


def check_pack_id(name: str, pack_id: str, data: bytes) -> None:
    """Catch any flipped bit or truncation anywhere in a pack read whole."""
    if hashlib.sha256(data).hexdigest() != pack_id:
        raise CorruptObject(name, "content does not match its name: altered or truncated")


class PackReader:
    """Opens blobs of one pack (whole, or at least its header and the entries asked for)."""

    def __init__(self, data_key: bytes, name: str, data: bytes):
        if len(data) < HEADER_SIZE or not data.startswith(MAGIC):
            raise CorruptObject(name, "not a pack: short or bad magic")
        _magic, version, salt = _HEADER.unpack_from(data)
        if version != VERSION:
            raise UnsupportedFormat(name, version)
        self._cipher = AESGCM(derive_key(data_key, salt, INFO_PACK))
        self._name = name
        self._data = data

    def blob(self, entry: Entry) -> bytes:
        start, end = entry.offset, entry.offset + entry.length
        if start < HEADER_SIZE or entry.length < ENTRY_OVERHEAD or end > len(self._data):
            raise CorruptObject(self._name, f"entry [{start}, {end}) is outside the pack")
        found_id, length = _ENTRY_HEAD.unpack_from(self._data, start)
        if found_id != entry.chunk_id or _ENTRY_HEAD.size + length != entry.length:
            raise CorruptObject(self._name, f"entry at {start} is not chunk {entry.chunk_id.hex()}")
        sealed = self._data[start + _ENTRY_HEAD.size:end]
        try:
            return self._cipher.decrypt(_nonce(start), sealed, found_id)
        except InvalidTag:
            raise CorruptObject(
                self._name, f"chunk {entry.chunk_id.hex()} at {start} failed authentication"
            ) from None
