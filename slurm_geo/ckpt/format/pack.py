"""Packs (docs/format.md §6): many encrypted blobs in one object, pure over bytes.

Each pack derives its own key from a fresh salt and uses each entry's offset as its
nonce, so nonces never repeat under a key without relying on random nonces.
"""

from __future__ import annotations

import hashlib
import mmap
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import blake3
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from slurm_geo.ckpt.errors import CkptError, CorruptObject, UnsupportedFormat
from slurm_geo.ckpt.format.keys import INFO_PACK, SALT_SIZE, derive_key

# Any buffer a pack is built from or read out of (a store hands out the same kinds).
Bytes = bytes | bytearray | memoryview

MAGIC = b"SGEOPACK"
# All pack versions have the same layout. Version 2 packs may hold zstd patches (method 4);
# version 3 packs may also hold sparse byte planes (method 5) and are named by BLAKE3, not
# SHA-256. Writers write version 3; older readers report its packs as an unsupported
# format, not as damage.
PATCH_VERSION = 2
BLAKE3_VERSION = 3
VERSION = BLAKE3_VERSION  # what writers write unless told an older version
VERSIONS = (1, PATCH_VERSION, BLAKE3_VERSION)
_HEADER = struct.Struct(f"<8sB{SALT_SIZE}s")
_ENTRY_HEAD = struct.Struct("<32sI")
HEADER_SIZE = _HEADER.size
TAG_SIZE = 16
ENTRY_OVERHEAD = _ENTRY_HEAD.size + TAG_SIZE  # id, length, GCM tag
ALTERED = "content does not match its name: altered or truncated"



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

    def __init__(self, data_key: bytes, salt: bytes, buffer: mmap.mmap | None = None, *,
                 version: int = VERSION):
        if version not in VERSIONS:
            raise ValueError(f"pack version {version} is not one of {VERSIONS}")
        self._key = derive_key(data_key, salt, INFO_PACK)
        self._buffer = pack_buffer(HEADER_SIZE) if buffer is None else buffer
        self._size = 0
        with self._reserve(HEADER_SIZE) as header:
            _HEADER.pack_into(header, 0, MAGIC, version, salt)

    @property
    def size(self) -> int:
        return self._size

    @property
    def buffer(self) -> mmap.mmap:
        return self._buffer

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
            self._buffer.resize(end)
        view = memoryview(self._buffer)[self._size:end]
        self._size = end
        return view


def pack_buffer(size: int) -> mmap.mmap:
    """Zeroed memory for a pack whose pages are faulted in only as blobs fill them. A
    bytearray is zeroed whole up front: 55 ms for a 24 MiB pack buffer on the 2-core VM
    (fresh pages cost about 2 ms a MiB there), the most of a push of a frozen-base step
    that stores 2.5 MB. Private: a shared anonymous map is a file of its own size, which
    growing the map does not grow (touching the new pages raises SIGBUS)."""
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


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
        raise CorruptObject(name, ALTERED)


class PackReader:
    """Opens blobs of one pack (whole, or at least its header and the entries asked for).

    Given the pack's id (a pack read whole), it hashes the pack only when something in it
    fails, so that the error says the pack was altered or truncated rather than naming a
    newer version or one entry: readers that decode rely on the entries' tags (§6 of
    docs/format.md) and need not hash every pack they read.
    """

    def __init__(self, data_key: bytes, name: str, data: Bytes, pack_id: str | None = None):
        self._name, self._id = name, pack_id
        self._data = memoryview(data)  # entries are sliced out without copies
        if len(data) < HEADER_SIZE or bytes(data[:len(MAGIC)]) != MAGIC:
            raise self._damage(CorruptObject(name, "not a pack: short or bad magic"))
        _magic, version, salt = _HEADER.unpack_from(data)
        if version not in VERSIONS:
            raise self._damage(UnsupportedFormat(name, version, " or ".join(map(str, VERSIONS))))
        self.version = version
        self._cipher = AESGCM(derive_key(data_key, salt, INFO_PACK))

    def blob(self, entry: Entry) -> bytes:
        start, end = entry.offset, entry.offset + entry.length
        if end > len(self._data):
            raise self._damage(CorruptObject(self._name,
                                             f"entry [{start}, {end}) is outside the pack"))
        return self.open_entry(entry, self._data[start:end])

    def open_entry(self, entry: Entry, raw: Bytes) -> bytes:
        """The blob of `entry`, given the entry's bytes as read from the pack (`blob`, or a
        read of that range alone, for which this reader needs only the pack's header)."""
        start, end = entry.offset, entry.offset + entry.length
        if start < HEADER_SIZE or entry.length < ENTRY_OVERHEAD or len(raw) != entry.length:
            raise self._damage(CorruptObject(self._name,
                                             f"entry [{start}, {end}) is outside the pack"))
        found_id, length = _ENTRY_HEAD.unpack_from(raw, 0)
        if found_id != entry.chunk_id or _ENTRY_HEAD.size + length != entry.length:
            raise self._damage(CorruptObject(
                self._name, f"entry at {start} is not chunk {entry.chunk_id.hex()}"))
        sealed = memoryview(raw)[_ENTRY_HEAD.size:]
        try:
            return self._cipher.decrypt(_nonce(start), sealed, found_id)
        except InvalidTag:
            raise self._damage(CorruptObject(
                self._name, f"chunk {entry.chunk_id.hex()} at {start} failed authentication"
            )) from None

    def _damage(self, error: CkptError) -> CkptError:
        """`error`, or the pack's own damage where its bytes no longer match its name."""
        if self._id is not None and pack_id_of(self._data) != self._id:
            return CorruptObject(self._name, ALTERED)
        return error
