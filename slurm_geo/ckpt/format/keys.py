"""Key material (docs/format.md §4): the site master key file, the key ring a rotation
leaves in it meanwhile, and per-run derived keys."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import blake3
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from slurm_geo.atomic import write_if_changed
from slurm_geo.ckpt.errors import CorruptObject, KeyFileError, WrongKey

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
INFO_TREE_RESIDENCY = b"slurm-geo/v1/tree-residency"
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


def residency_key(master_key: bytes) -> bytes:
    """`R`: seals every staged tree domain's residency (format.md §11.10); no job holds it."""
    return derive_key(master_key, None, INFO_TREE_RESIDENCY)


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


# A run rotates its data key when it leaves a rented cluster (docs/format.md §4.2): a
# handful of times in its life. The ring keeps every key its checkpoints may be sealed under.
MAX_RUN_KEYS = 64


@dataclass(frozen=True)
class RunKeyRing:
    """A run's data keys (docs/format.md §4.2): the one new objects are sealed under first,
    then the ones it replaced, newest first, under which older checkpoints stay readable.
    `keys/<run>` holds their concatenation: one key (32 bytes) until the first rotation."""

    keys: tuple[RunKeys, ...]

    def __post_init__(self) -> None:
        if not 1 <= len(self.keys) <= MAX_RUN_KEYS:
            raise ValueError(f"a run key ring holds 1 to {MAX_RUN_KEYS} keys, "
                             f"not {len(self.keys)}")
        if len({k.fingerprint for k in self.keys}) != len(self.keys):
            raise ValueError("a run key ring holds each key once")

    @classmethod
    def of(cls, data_keys: bytes | tuple[bytes, ...] | list[bytes]) -> RunKeyRing:
        """The ring of `data_keys`, newest first (a bare key: a ring of one)."""
        if isinstance(data_keys, bytes):
            data_keys = (data_keys,)
        return cls(tuple(RunKeys(k) for k in data_keys))

    @property
    def current(self) -> RunKeys:
        """The key every new manifest, pack and latest pointer of the run is sealed under."""
        return self.keys[0]

    @property
    def data_keys(self) -> tuple[bytes, ...]:
        return tuple(k.data_key for k in self.keys)

    def sealed_under(self, found: bytes | None, name: str) -> RunKeys:
        """The key whose fingerprint an object's header names; WrongKey if none is."""
        for keys in self.keys:
            if keys.fingerprint == found:
                return keys
        raise WrongKey(name, found.hex() if found else "(none)",
                       self.current.fingerprint.hex())

    def opening(self, found: bytes | None) -> RunKeys:
        """The key a sealed object's header names (`found`), or the current one when it
        names none of the ring's (opening under it then fails with the error §5 gives)."""
        return next((k for k in self.keys if k.fingerprint == found), self.current)

    def holds(self, other: RunKeyRing) -> bool:
        """Every key of `other` is in this ring."""
        mine = {k.fingerprint for k in self.keys}
        return all(k.fingerprint in mine for k in other.keys)

    def rotated(self, new_key: bytes) -> RunKeyRing:
        """`new_key` in front: what is sealed from now on is sealed under it."""
        return RunKeyRing((RunKeys(new_key), *self.keys))

    def merged(self, other: RunKeyRing) -> RunKeyRing:
        """This ring, then the keys of `other` it lacks (in `other`'s order): two copies of
        one run's ring that diverged (a store missed a rotation) lose no key."""
        mine = {k.fingerprint for k in self.keys}
        return RunKeyRing((*self.keys, *(k for k in other.keys if k.fingerprint not in mine)))

    def to_payload(self) -> bytes:
        return b"".join(self.data_keys)

    @classmethod
    def from_payload(cls, payload: bytes, name: str) -> RunKeyRing:
        count, rest = divmod(len(payload), KEY_SIZE)
        if rest or not 1 <= count <= MAX_RUN_KEYS:
            raise CorruptObject(name, f"holds {len(payload)} bytes, not 1 to {MAX_RUN_KEYS} "
                                f"{KEY_SIZE}-byte data keys")
        try:
            return cls.of([payload[i * KEY_SIZE:(i + 1) * KEY_SIZE] for i in range(count)])
        except ValueError as exc:
            raise CorruptObject(name, str(exc)) from None


# --- the master key file (docs/format.md §4.1) -------------------------------------------

KEY_RING_VERSION = 2
_MAX_KEY_FILE_SIZE = 64 * 1024  # a key ring is a few hundred bytes; anything larger is not one


class MasterKeys(Protocol):
    """Where a repository takes the site master key from: a key file read once, or one
    followed as a rotation rewrites it (`LiveKeyFile`)."""

    def keys(self) -> tuple[bytes, ...]:
        """The key that seals, then the one a rotation in progress replaces (if any)."""
        ...


@dataclass(frozen=True)
class KeyFile:
    """What a master key file holds: the site master key and, while a rotation is in
    progress, the key it replaces and the stores that rotation re-seals."""

    current: bytes = field(repr=False)
    previous: bytes | None = field(default=None, repr=False)
    rotating: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for key in (self.current, self.previous):
            if key is not None and len(key) != KEY_SIZE:
                raise ValueError(f"a master key is {KEY_SIZE} bytes, not {len(key)}")
        if self.current == self.previous:
            raise ValueError("a rotation replaces a key by another one")
        if (self.previous is None) != (not self.rotating):
            raise ValueError("a rotation in progress names its previous key and its stores")

    def keys(self) -> tuple[bytes, ...]:
        return (self.current,) if self.previous is None else (self.current, self.previous)

    def to_bytes(self) -> bytes:
        """Version 1 (the 32 bytes, which every release reads) unless a rotation is in
        progress; then version 2, the key ring."""
        if self.previous is None:
            return self.current
        ring = {"version": KEY_RING_VERSION, "keys": [self.current.hex(), self.previous.hex()],
                "rotating": list(self.rotating)}
        return (json.dumps(ring) + "\n").encode()


def parse_key_file(data: bytes, name: str) -> KeyFile:
    """The key file `name` holding `data`: 32 raw bytes (version 1) or a key ring (2)."""
    if len(data) == KEY_SIZE:
        return KeyFile(data)
    not_a_key_file = KeyFileError(name, f"holds {len(data)} bytes, neither a {KEY_SIZE}-byte "
                                  "master key nor a key ring (docs/format.md §4.1)")
    try:
        ring = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise not_a_key_file from None
    if not isinstance(ring, dict) or "version" not in ring:
        raise not_a_key_file
    if ring["version"] != KEY_RING_VERSION:
        raise KeyFileError(name, f"is a key ring of version {ring['version']!r}; this "
                           f"slurm-geo reads version {KEY_RING_VERSION}: upgrade slurm-geo")
    try:
        current, previous = (_key_of_hex(k) for k in ring["keys"])
        rotating = tuple(ring["rotating"])
        if set(ring) != {"version", "keys", "rotating"} or not all(
                isinstance(s, str) and s for s in rotating):
            raise ValueError("unknown members, or a store that is not a name")
        return KeyFile(current, previous, rotating)
    except (KeyError, TypeError, ValueError) as exc:
        raise KeyFileError(name, f"is not a valid key ring ({exc})") from None


def _key_of_hex(text: object) -> bytes:
    if not isinstance(text, str) or len(text) != 2 * KEY_SIZE:
        raise ValueError(f"a key is {2 * KEY_SIZE} hex digits")
    return bytes.fromhex(text)


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


def write_key_file(path: Path, key_file: KeyFile) -> None:
    """Replace the key file atomically (a crash leaves the old one or the new one), 0600
    and owned as the file it replaces, so that the daemons' account still reads it; a
    symbolic link is followed, and its target replaced."""
    target = path.resolve()
    try:
        info = target.stat()
    except FileNotFoundError:
        owner = None
    except OSError as exc:
        raise KeyFileError(str(path), f"cannot read it ({exc.strerror})") from None
    else:
        owner = (info.st_uid, info.st_gid)
    try:
        write_if_changed(target, key_file.to_bytes(), mode=0o600, owner=owner)
    except OSError as exc:
        raise KeyFileError(str(path), f"cannot write it ({exc.strerror})") from None


def load_master_key(path: Path) -> KeyFile:
    """The master key file at `path` as it is now; refused if group or others may use it."""
    return _read_key_file(path)[0]


# Device, inode, size, and the change and modification times (ns): replacing the file
# changes the inode, and a chmod the change time, after which the mode is checked again.
_Signature = tuple[int, int, int, int, int]


def _read_key_file(path: Path) -> tuple[KeyFile, _Signature]:
    try:
        with open(path, "rb") as handle:
            info = os.fstat(handle.fileno())
            data = handle.read(_MAX_KEY_FILE_SIZE + 1)
    except OSError as exc:
        raise KeyFileError(str(path), f"cannot read it ({exc.strerror})") from None
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(
            str(path), f"mode {stat.S_IMODE(info.st_mode):04o} lets others in; chmod 600 it"
        )
    return parse_key_file(data, str(path)), _signature(info)


def _signature(info: os.stat_result) -> _Signature:
    return info.st_dev, info.st_ino, info.st_size, info.st_ctime_ns, info.st_mtime_ns


class LiveKeyFile:
    """The key file at `path`, read again whenever it has been replaced: a rotation
    rewrites it (docs/format.md §8.5), and a daemon follows without a restart. Each use
    costs a stat; a file that no longer reads is an error, never the keys held before."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()
        self._held, self._seen = _read_key_file(path)

    def keys(self) -> tuple[bytes, ...]:
        with self._lock:
            try:
                now = _signature(os.stat(self.path))
            except OSError as exc:
                raise KeyFileError(str(self.path), f"cannot read it ({exc.strerror})") from None
            if now != self._seen:
                self._held, self._seen = _read_key_file(self.path)
            return self._held.keys()


def as_master_keys(key: bytes | MasterKeys) -> MasterKeys:
    """A bare 32-byte key as the one-key file that holds it."""
    return KeyFile(key) if isinstance(key, bytes) else key
