"""Where checkpoint objects live: one small interface, and a local-directory store.

Stores only move bytes and classify their own failures: a missing object raises
`ObjectMissing`, any other I/O failure `StoreUnavailable`, and a name that could leave
the store `UnsafeObjectName`. Everything else (crypto, formats) happens above them.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import NamedTuple, Protocol

from slurm_geo.accounts import service_uid
from slurm_geo.ckpt.errors import (
    CkptError,
    ObjectMissing,
    StoreUnavailable,
    UnsafeObjectName,
    UnsafeStoreDirectory,
)
from slurm_geo.ckpt.format.names import check_object_name
from slurm_geo.ckpt.stores.sums import sha256_b64

Bytes = bytes | bytearray | memoryview


class Store(Protocol):
    def put(self, name: str, data: Bytes) -> None:
        """Store `data` under `name`, replacing any object there, atomically and durably."""

    def get(self, name: str) -> bytes: ...

    def list(self, prefix: str) -> list[str]:
        """Names starting with `prefix`, sorted."""

    def delete(self, name: str) -> None:
        """Remove `name`; removing a missing object is not an error (retries are safe)."""

    def exists(self, name: str) -> bool: ...

    def sizes(self, prefix: str) -> dict[str, int]:
        """Each name starting with `prefix` and its size in bytes, from one listing (what
        `slurm-geo ckpt check` compares the manifests' pack ends against)."""

    # Optional (slurm_geo.ckpt.stores.digests): a store that keeps a digest of each object says
    # it without its bytes leaving where they are; copies are then verified as written.
    #   def digest(self, name: str) -> str | None: the digest of the object as stored
    #   def digest_of(self, data: Bytes) -> str: what digest() says of an object of `data`


class LocalDirStore:
    """Objects as files under `root`, written by temp file, fsync, rename, directory fsync.

    A root group or others may write (mode 1777, or 2770 with a group) is a store *shared*
    by users who do not trust each other. Whoever owns a directory can remove anything in
    it, so a put never writes into a directory owned by a user other than root, the
    store's owner or the writer, nor into one others may write without the sticky bit
    (`directory_fault`); every directory on the way is opened without following a
    symbolic link. The directories every run shares (`keys/`, `run-packs/`, the older
    `packs/` and its 256 `packs/xx/`, ...) are made by root or the store's owner when they
    open the store (`prepare_shared_directories`), never by a user, whose directory there
    would let them remove everyone's objects; a run's own directories (`manifests/<run>/`,
    `run-packs/<run>/`, `promoted/<run>/`, `outputs/<run>/`) are made with its key, by
    whoever writes it first.
    """

    def __init__(self, root: Path):
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise StoreUnavailable(str(root), "not a directory")
        info = self.root.stat()
        mode = stat.S_IMODE(info.st_mode)
        # New directories of a shared store take the root's bits, and the sticky bit: a
        # user may add objects there, never remove another's (as /tmp).
        self._shared = mode | stat.S_ISVTX if mode & (stat.S_IWGRP | stat.S_IWOTH) else 0
        # Root, the store's owner and the daemons' account are trusted as makers of
        # directories; so is the writer itself.
        service = service_uid()
        self._trusted = frozenset({0, os.geteuid(), info.st_uid, *(() if service is None
                                                                   else (service,))})
        self._may_share = os.geteuid() in (0, info.st_uid, service)
        self._service = service
        # Only the daemons (and root) write fences, promotion markers and probes: sealed
        # under keys no job holds, and in directories no user may write (DAEMON_DIRECTORIES).
        self._is_daemon = os.geteuid() in (0, service)
        if self._shared and self._may_share:
            prepare_shared_directories(self)

    def __repr__(self) -> str:
        return f"LocalDirStore({str(self.root)!r})"

    @property
    def leaves_pointers_to_owners(self) -> bool:
        """Whether this writer leaves a run's `latest/<run>` to the run's owner: root or
        the daemons writing a shared store, where a pointer they made in the sticky
        `latest/` would be theirs, one the owner's job could never replace."""
        return bool(self._shared) and self._is_daemon

    def put(self, name: str, data: Bytes) -> None:
        parts = self._parts(name)
        try:
            if self._shared and parts[0] == "keys" and len(parts) == 2:
                for per_run in RUN_DIRECTORIES:  # made with the key: see the class docstring
                    if per_run in DAEMON_DIRECTORIES and not self._is_daemon:
                        continue  # the daemons make it when they first mark the run
                    os.close(self._directory(name, [per_run, parts[1]], create=True))
            if self._shared and parts[0] == "tree-keys" and len(parts) == 2:
                # A staged tree domain's, likewise with its key (docs/format.md §11): its
                # packs, and the snapshots of its tree of the same id (the default domain)
                for per_tree in TREE_DIRECTORIES:
                    os.close(self._directory(name, [per_tree, parts[1]], create=True))
            directory = self._directory(name, parts[:-1], create=True)
            try:
                self._put_in(directory, name, parts[-1], data)
            finally:
                os.close(directory)
        except OSError as exc:
            raise StoreUnavailable(name, exc.strerror or str(exc)) from None

    def _put_in(self, directory: int, name: str, leaf: str, data: Bytes) -> None:
        temp = f".{leaf}.{os.urandom(6).hex()}.tmp"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600,
                     dir_fd=directory)
        try:
            if self._shared:
                # Objects are ciphertext: the daemons copy a run's checkpoints back into
                # a shared store for its owner's job, which must read them.
                os.fchmod(fd, self._shared & 0o644)
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            self._replace(directory, temp, name, leaf)
        except BaseException:
            with suppress(OSError):
                os.unlink(temp, dir_fd=directory)
            raise
        os.fsync(directory)

    def _replace(self, directory: int, temp: str, name: str, leaf: str) -> None:
        try:
            os.replace(temp, leaf, src_dir_fd=directory, dst_dir_fd=directory)
        except PermissionError:
            # In a sticky directory only the owner of an object may replace it: one that
            # another user made under the name this put writes is theirs, not ours.
            owner = _owner_of(directory, leaf)
            if owner is None or owner in self._trusted:
                raise
            raise UnsafeStoreDirectory(
                name, f"object '{name}' in store {self.root} belongs to {_user(owner)}, who "
                "made it under the name this put writes: it is not taken over; an admin "
                "removes it (a put as root replaces it)") from None

    def get(self, name: str) -> bytes:
        with _read_errors(name):
            fd = self._open_object(name)
            with os.fdopen(fd, "rb") as handle:
                return handle.read()

    def get_range(self, name: str, start: int, length: int) -> bytes:
        """Bytes `start` to `start + length` of `name` (fewer where it ends sooner): a reader
        after one blob of a pack reads that blob, not the whole pack (`ChunkReader`)."""
        with _read_errors(name):
            fd = self._open_object(name)
            try:
                # Never more than the object holds: a length from a damaged or forged entry
                # must not become an allocation of that size.
                length = max(0, min(length, os.fstat(fd).st_size - start))
                data = os.pread(fd, length, start)
                while 0 < len(data) < length:  # short reads: network filesystems, signals
                    more = os.pread(fd, length - len(data), start + len(data))
                    if not more:
                        break
                    data += more
                return data
            finally:
                os.close(fd)

    def list(self, prefix: str) -> list[str]:
        directory = prefix.rpartition("/")[0]
        top = self._path(directory) if directory else self.root
        try:
            names = [n for n in self._walk(top) if n.startswith(prefix)]
        except OSError as exc:
            raise StoreUnavailable(prefix, exc.strerror or str(exc)) from None
        return sorted(names)

    def delete(self, name: str) -> None:
        parts = self._parts(name)
        try:
            directory = self._directory(name, parts[:-1], create=False)
        except (FileNotFoundError, NotADirectoryError):
            return  # the directory itself is gone: so is the object
        except OSError as exc:
            raise StoreUnavailable(name, exc.strerror or str(exc)) from None
        try:
            os.unlink(parts[-1], dir_fd=directory)
            os.fsync(directory)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise StoreUnavailable(name, exc.strerror or str(exc)) from None
        finally:
            os.close(directory)

    def exists(self, name: str) -> bool:
        try:
            fd = self._open_object(name)
        except OSError:
            return False
        try:
            return stat.S_ISREG(os.fstat(fd).st_mode)
        finally:
            os.close(fd)

    def digest(self, name: str) -> str | None:
        """SHA-256 of the object as it is on this store's disk (base64, as S3 writes it),
        hashed where the bytes are: a copy to this store is checked against it."""
        with _read_errors(name):
            fd = self._open_object(name)
            with os.fdopen(fd, "rb") as handle:
                return sha256_b64(handle)

    def digest_of(self, data: Bytes) -> str:
        return sha256_b64(data)

    def sizes(self, prefix: str) -> dict[str, int]:
        found: dict[str, int] = {}
        for name in self.list(prefix):
            try:
                found[name] = (self.root / name).stat().st_size
            except FileNotFoundError:
                continue  # deleted since the listing: as if listed a moment later
            except OSError as exc:
                raise StoreUnavailable(name, exc.strerror or str(exc)) from None
        return found

    def _parts(self, name: str) -> Sequence[str]:
        self._path(name)
        return name.split("/")

    def _path(self, name: str) -> Path:
        path = self.root / check_object_name(name)
        if not path.resolve().is_relative_to(self.root):
            raise UnsafeObjectName(name, "it leads out of the store through a symbolic link")
        return path

    def _open_object(self, name: str) -> int:
        """A read-only descriptor of the object, no symbolic link followed on the way."""
        parts = self._parts(name)
        directory = self._directory(name, parts[:-1], create=False)
        try:
            return os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW, dir_fd=directory)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafeObjectName(name, "it is a symbolic link: the store never follows "
                                       "one") from None
            raise
        finally:
            os.close(directory)

    def _walk(self, top: Path) -> Iterator[str]:
        # Names starting with '.' are temporary files of an unfinished put.
        for directory, subdirs, files in os.walk(top, onerror=_raise_unless_missing):
            subdirs[:] = [d for d in subdirs if not d.startswith(".")]
            relative = Path(directory).relative_to(self.root)
            for file in files:
                if not file.startswith("."):
                    yield (relative / file).as_posix()

    def _directory(self, name: str, parts: Sequence[str], create: bool) -> int:
        """A descriptor of the directory `parts` under the root, every step opened without
        following a symbolic link and, for a write (`create`), checked and made if missing."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for depth in range(1, len(parts) + 1):
                child = self._child(fd, name, parts[:depth], create)
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _child(self, parent: int, name: str, parts: Sequence[str], create: bool) -> int:
        relative = "/".join(parts)
        try:
            fd = _open_directory(parts[-1], parent)
        except FileNotFoundError:
            if not create:
                raise
            self._make_directory(parent, name, parts)
            fd = _open_directory(parts[-1], parent)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafeObjectName(name, f"'{relative}' is a symbolic link: the store "
                                       "never follows one") from None
            raise
        if create:
            fault = directory_fault(os.fstat(fd), self._trusted)
            if fault is not None:
                os.close(fd)
                raise UnsafeStoreDirectory(
                    name, f"store {self.root}: directory '{relative}' {fault.reason}, so another "
                    f"user could remove what is written in it; {fault.fix}")
        return fd

    def _make_directory(self, parent: int, name: str, parts: Sequence[str]) -> None:
        """Make a missing directory, durable in its parent. In a shared store it takes the
        root's bits and the sticky bit whatever the writer's umask, or the first user to
        write under a prefix would lock everyone else out of it (as git's
        core.sharedRepository); one every run shares only root or the owner may make."""
        relative = "/".join(parts)
        if self._shared and not self._may_share and is_shared_directory(parts):
            raise UnsafeStoreDirectory(
                name, f"store {self.root}: directory '{relative}' is missing, and every "
                "user's runs share it, so only root or the store's owner may make it; run "
                "any slurm-geo command on this store once as root (e.g. `slurm-geo ckpt "
                "check`), which makes them all")
        try:
            os.mkdir(parts[-1], 0o700, dir_fd=parent)
        except FileExistsError:
            return  # another writer has just made it: checked when opened
        if self._shared:
            # A run's directory a user makes is theirs alone to write; root makes it (with
            # the run's key) writable for the run's job, and sticky. What only the daemons
            # write, no one else may write.
            mode = self._shared if self._may_share or is_shared_directory(parts) \
                else self._shared & 0o755
            if parts[0] in DAEMON_DIRECTORIES:
                mode = 0o755
            fd = _open_directory(parts[-1], parent)
            try:
                os.fchmod(fd, mode)
            finally:
                os.close(fd)
        os.fsync(parent)


def leaves_pointers_to_owners(store: Store) -> bool:
    """`LocalDirStore.leaves_pointers_to_owners` of the local store under any wrappers
    (retries, breaker, pacing: each keeps the store it wraps as `inner`); False for others."""
    while not isinstance(store, LocalDirStore):
        inner = getattr(store, "inner", None)
        if inner is None:
            return False
        store = inner
    return store.leaves_pointers_to_owners


# Directories every run of a store shares (docs/format.md §2), and those of one run.
SHARED_DIRECTORIES = ("fences", "keys", "latest", "locks", "manifests", "packs", "probes",
                      "promoted", "run-packs", "verified",
                      # staged trees and runs' world records (docs/format.md §11: made
                      # here so that a home job stages its world as its owner)
                      "tree-keys", "tree-latest", "tree-packs", "trees", "worlds",
                      "tree-residency",
                      # what moved incarnations ship home (docs/format.md §11.9)
                      "outputs")
RUN_DIRECTORIES = ("manifests", "promoted", "run-packs", "outputs", "verified")
TREE_DIRECTORIES = ("tree-packs", "trees")  # made with a domain's key, as a run's with its
# Written by the daemons alone: fences (under F), promotion markers and verification
# records (under P), staged
# trees' residency (under R) and the federation daemon's bandwidth probes. A user able to
# create a name there could block a fence of another's run (a sticky directory lets only
# its maker replace a file), so in a shared store they belong to the daemons' account,
# mode 0755.
DAEMON_DIRECTORIES = ("fences", "probes", "promoted", "tree-residency", "verified")


class DirectoryFault(NamedTuple):
    reason: str
    fix: str


def directory_fault(info: os.stat_result, trusted: frozenset[int]) -> DirectoryFault | None:
    """Why a store may not write into a directory with this owner and mode, if it may not:
    its owner (anyone not `trusted`: root, the store's owner, the daemons' account, the
    writer) can remove what
    is in it, and so can everyone who may write it, unless it is sticky."""
    if info.st_uid not in trusted:
        return DirectoryFault(f"belongs to {_user(info.st_uid)}",
                              "an admin removes it, or gives it to root (chown root) once "
                              "its content is known to be good")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
        return DirectoryFault("is writable by group or others without the sticky bit",
                              "chmod +t it")
    return None


def is_shared_directory(parts: Sequence[str]) -> bool:
    """Whether the directory `parts` under a store's root holds objects of every run."""
    return len(parts) == 1 or (len(parts) == 2 and parts[0] == "packs")


def prepare_shared_directories(store: LocalDirStore) -> None:
    """Make the directories every run shares (by root or the store's owner), so that no
    user makes one: whatever goes wrong is said by the put that needs it."""
    wanted = [[d] for d in SHARED_DIRECTORIES] + [["packs", f"{i:02x}"] for i in range(256)]
    if not (all(store.root.joinpath(*parts).is_dir() for parts in (wanted[-1], wanted[-2]))
            and all(store.root.joinpath(d).is_dir() for d in SHARED_DIRECTORIES)):
        for parts in wanted:
            try:
                os.close(store._directory("/".join(parts), parts, create=True))
            except (OSError, CkptError):
                continue
    for name in DAEMON_DIRECTORIES:
        _keep_for_the_daemons(store.root / name, store._service)


def _keep_for_the_daemons(directory: Path, service: int | None) -> None:
    """A directory only the daemons write: theirs (as root can give it), mode 0755, and
    no directory of a run under it writable by anyone else (a store from before)."""
    with suppress(OSError):
        for path in [directory, *(p for p in directory.iterdir() if p.is_dir()
                                  and not p.is_symlink())]:
            info = os.lstat(path)
            if os.geteuid() == 0 and service is not None and info.st_uid != service:
                os.lchown(path, service, -1)
            if stat.S_IMODE(info.st_mode) != 0o755 and os.geteuid() in (0, info.st_uid):
                os.chmod(path, 0o755)

@contextmanager
def _read_errors(name: str) -> Iterator[None]:
    """A read's failures as the store's: a missing object (or a directory in its place)
    `ObjectMissing`, any other I/O failure `StoreUnavailable`."""
    try:
        yield
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise ObjectMissing(name) from None
    except OSError as exc:
        raise StoreUnavailable(name, exc.strerror or str(exc)) from None


def _raise_unless_missing(error: OSError) -> None:
    if not isinstance(error, FileNotFoundError):
        raise error


def _open_directory(name: str, parent: int) -> int:
    return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)


def _owner_of(directory: int, name: str) -> int | None:
    try:
        return os.stat(name, dir_fd=directory, follow_symlinks=False).st_uid
    except OSError:
        return None


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"
