"""Packs (docs/format.md §6): many encrypted blobs in one object, pure over bytes.

Each pack derives its own key from a fresh salt and uses each entry's offset as its
nonce, so nonces never repeat under a key without relying on random nonces.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import blake3
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from slurm_geo.ckpt.errors import CorruptObject, UnsupportedFormat
from slurm_geo.ckpt.keys import INFO_PACK, SALT_SIZE, derive_key
from slurm_geo.ckpt.store import Bytes

MAGIC = b"SGEOPACK"
# All pack versions have the same layout. Version 2 packs may hold zstd patches (method 4);
# version 3 packs may also hold sparse byte planes (method 5) and are named by BLAKE3, not
# SHA-256. Writers write version 3; older readers report its packs as an unsupported
# format, not as damage.
PATCH_VERSION = 2
BLAKE3_VERSION = 3
VERSION = BLAKE3_VERSION  # what writers write
VERSIONS = (1, PATCH_VERSION, BLAKE3_VERSION)
_HEADER = struct.Struct(f"<8sB{SALT_SIZE}s")
_ENTRY_HEAD = struct.Struct("<32sI")
HEADER_SIZE = _HEADER.size
TAG_SIZE = 16
ENTRY_OVERHEAD = _ENTRY_HEAD.size + TAG_SIZE  # id, length, GCM tag


@dataclass(frozen=True)
class Entry:
    """Where one blob sits in a pack: the range [offset, offset + length)."""

    chunk_id: bytes
    offset: int
    length: int


def _nonce(offset: int) -> bytes:
    return offset.to_bytes(12, "big")


class PackWriter:
    """Appends blobs one by one; the pack's name is known only once it is finished.

    Blobs are encrypted straight into `buffer` (grown when short), which a caller may
    reuse for the next pack once the previous one is stored: no per-blob copies.
    """

    def __init__(self, data_key: bytes, salt: bytes, buffer: bytearray | None = None):
        self._key = derive_key(data_key, salt, INFO_PACK)
        self._buffer = bytearray() if buffer is None else buffer
        self._size = 0
        with self._reserve(HEADER_SIZE) as header:
            _HEADER.pack_into(header, 0, MAGIC, VERSION, salt)

    @property
    def size(self) -> int:
        return self._size

    def add(self, chunk_id: bytes, blob: Bytes) -> Entry:
        return self.add_parts(chunk_id, [blob])

    def add_parts(self, chunk_id: bytes, parts: Sequence[Bytes]) -> Entry:
        """Add the blob that is the concatenation of `parts`, without concatenating them."""
        offset = self._size
        sealed_length = sum(len(p) for p in parts) + TAG_SIZE
        length = _ENTRY_HEAD.size + sealed_length
        encryptor = Cipher(algorithms.AES(self._key), modes.GCM(_nonce(offset))).encryptor()
        encryptor.authenticate_additional_data(chunk_id)
        with self._reserve(length) as entry:
            _ENTRY_HEAD.pack_into(entry, 0, chunk_id, sealed_length)
            position = _ENTRY_HEAD.size
            for part in parts:
                # GCM output is never held back, but the API wants a block of slack.
                position += encryptor.update_into(part, entry[position:])
            encryptor.finalize()
            entry[position:] = encryptor.tag
        return Entry(chunk_id, offset, length)

    def finish(self) -> tuple[str, bytes]:
        """The pack id (its SHA-256) and its bytes."""
        data = bytes(self.release())
        return pack_id_of(data), data

    def release(self) -> memoryview:
        """The pack's bytes, a view of the buffer; name them with `pack_id_of`."""
        return memoryview(self._buffer)[:self._size]

    def _reserve(self, length: int) -> memoryview:
        """The next `length` bytes of the buffer, to be filled in."""
        end = self._size + length
        if end > len(self._buffer):
            self._buffer += bytes(end - len(self._buffer))
        view = memoryview(self._buffer)[self._size:end]
        self._size = end
        return view


def pack_id_of(data: Bytes) -> str:
    """A pack's name: the hash of all its bytes, BLAKE3 from version 3 on, else SHA-256.

    A pack's own version byte picks the hash, so a pack altered to claim another version
    no longer matches its name.
    """
    if len(data) > len(MAGIC) and data[len(MAGIC)] >= BLAKE3_VERSION:
        return blake3.blake3(data).hexdigest()
    return hashlib.sha256(data).hexdigest()


def check_pack_id(name: str, pack_id: str, data: Bytes) -> None:
    """Catch any flipped bit or truncation anywhere in a pack read whole."""
    if pack_id_of(data) != pack_id:
        raise CorruptObject(name, "content does not match its name: altered or truncated")


class PackReader:
    """Opens blobs of one pack (whole, or at least its header and the entries asked for)."""

    def __init__(self, data_key: bytes, name: str, data: Bytes):
        if len(data) < HEADER_SIZE or bytes(data[:len(MAGIC)]) != MAGIC:
            raise CorruptObject(name, "not a pack: short or bad magic")
        _magic, version, salt = _HEADER.unpack_from(data)
        if version not in VERSIONS:
            raise UnsupportedFormat(name, version, " or ".join(map(str, VERSIONS)))
        self.version = version
        self._cipher = AESGCM(derive_key(data_key, salt, INFO_PACK))
        self._name = name
        self._data = memoryview(data)  # entries are sliced out without copies

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
