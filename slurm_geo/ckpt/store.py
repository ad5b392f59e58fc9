"""Where checkpoint objects live: one small interface, and a local-directory store.

Stores only move bytes and classify their own failures: a missing object raises
`ObjectMissing`, any other I/O failure `StoreUnavailable`, and a name that could leave
the store `UnsafeObjectName`. Everything else (crypto, formats) happens above them.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

from slurm_geo.ckpt.errors import ObjectMissing, StoreUnavailable, UnsafeObjectName
from slurm_geo.ckpt.names import check_object_name

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


class LocalDirStore:
    """Objects as files under `root`, written by temp file, fsync, rename, directory fsync."""

    def __init__(self, root: Path):
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise StoreUnavailable(str(root), "not a directory")
        # A root group or others may write is a store shared by the users of a site
        # filesystem (mode 1777, or 2770 with a group): see _make_dirs and put.
        mode = stat.S_IMODE(self.root.stat().st_mode)
        self._shared = mode if mode & (stat.S_IWGRP | stat.S_IWOTH) else 0

    def __repr__(self) -> str:
        return f"LocalDirStore({str(self.root)!r})"

    def put(self, name: str, data: Bytes) -> None:
        path = self._path(name)
        try:
            self._make_dirs(path.parent)
            fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            try:
                if self._shared:
                    # Objects are ciphertext: the daemons copy a run's checkpoints back into
                    # a shared store for its owner's job, which must read them.
                    os.fchmod(fd, self._shared & 0o644)
                with os.fdopen(fd, "wb") as handle:
                    handle.write(data)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(temp, path)
            except BaseException:
                Path(temp).unlink(missing_ok=True)
                raise
            _fsync_dir(path.parent)
        except OSError as exc:
            raise StoreUnavailable(name, exc.strerror or str(exc)) from None

    def get(self, name: str) -> bytes:
        path = self._path(name)
        with _read_errors(name):
            return path.read_bytes()

    def get_range(self, name: str, start: int, length: int) -> bytes:
        """Bytes `start` to `start + length` of `name` (fewer where it ends sooner): a reader
        after one blob of a pack reads that blob, not the whole pack (`ChunkReader`)."""
        path = self._path(name)
        with _read_errors(name):
            fd = os.open(path, os.O_RDONLY)
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
        path = self._path(name)
        try:
            path.unlink(missing_ok=True)
            _fsync_dir(path.parent)
        except FileNotFoundError:
            pass  # the directory itself is gone: so is the object
        except OSError as exc:
            raise StoreUnavailable(name, exc.strerror or str(exc)) from None

    def exists(self, name: str) -> bool:
        return self._path(name).is_file()

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

    def _path(self, name: str) -> Path:
        path = self.root / check_object_name(name)
        if not path.resolve().is_relative_to(self.root):
            raise UnsafeObjectName(name, "it leads out of the store through a symbolic link")
        return path

    def _walk(self, top: Path) -> Iterator[str]:
        # Names starting with '.' are temporary files of an unfinished put.
        for directory, subdirs, files in os.walk(top, onerror=_raise_unless_missing):
            subdirs[:] = [d for d in subdirs if not d.startswith(".")]
            relative = Path(directory).relative_to(self.root)
            for file in files:
                if not file.startswith("."):
                    yield (relative / file).as_posix()

    def _make_dirs(self, directory: Path) -> None:
        """Create missing directories, each made durable in its parent.

        In a shared store each new directory takes the root's permission bits, whatever
        the writer's umask, or the first user to write under a prefix would lock everyone
        else out of it (as git's core.sharedRepository).
        """
        missing = []
        while directory != self.root and not directory.is_dir():
            missing.append(directory)
            directory = directory.parent
        for created in reversed(missing):
            created.mkdir(exist_ok=True)  # another writer may have just made it
            if self._shared and created.stat().st_uid == os.getuid():
                created.chmod(self._shared)
            _fsync_dir(created.parent)


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


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
