"""A job's checkpoint directory, read as its owner could read it, never further.

checkpoint-sync reads every user's `--geo-ckpt-dir` with CAP_DAC_READ_SEARCH, so a path
inside one is a user's to point anywhere: a checkpoint directory, or a pack in it, made a
symbolic link (or a hard link) to the master key or the daemons' S3 credentials would
have the daemon upload that file to the off-site store the user's job reads. Here:

- every path is walked from the directory one name at a time, each opened with
  O_NOFOLLOW relative to the one before (openat): a link anywhere below the directory,
  or in its place, is never followed, whenever it appears (no check-then-open race);
- the directory must belong to one of its jobs' users, and every file read, or listed,
  must belong to the directory's owner and be a regular file (opened O_NONBLOCK, so a
  FIFO cannot hang a read): a hard link to another account's file is refused too;
- nothing is ever written.

The configured `[sync] roots` are read the same way, without the owner check (a site
filesystem holds every user's runs): no link below a root is ever followed either.

Whatever is refused is skipped: a listing leaves it out, a read raises `UnsafeObjectName`
(that replica fails, saying why), and `SkippedFiles` logs it once (`event=unsafe_file_skipped`,
a warning) and counts it for `slurm_geo_sync_unsafe_files_skipped_total`.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from slurm_geo.ckpt.errors import ObjectMissing, StoreUnavailable, UnsafeObjectName
from slurm_geo.ckpt.format.names import check_object_name
from slurm_geo.ckpt.stores.store import Bytes
from slurm_geo.daemon.events import event

log = logging.getLogger("slurm_geo.sync")

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
REMEMBERED = 4096  # paths told once each; beyond them every skip is told again


class SkippedFiles:
    """What was skipped, for the log (once per path) and the metrics (every time).
    Thread-safe: the main loop scans, an attempt's thread reads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._told: set[str] = set()
        self.count = 0

    def skip(self, path: str, reason: str) -> None:
        with self._lock:
            self.count += 1
            first = path not in self._told
            if first and len(self._told) < REMEMBERED:
                self._told.add(path)
        if first:
            event(log, "unsafe_file_skipped", logging.WARNING, path=path, reason=reason)


def refusal(info: os.stat_result, owner: int | None) -> str | None:
    """Why a file of this lstat/fstat is not read for a directory owned by `owner` (None:
    it is read; an `owner` of None checks no owner). Pure."""
    if stat.S_ISLNK(info.st_mode):
        return "a symbolic link, never followed"
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file"
    if owner is not None and info.st_uid != owner:
        return f"owned by uid {info.st_uid}, not by the directory's owner {owner}"
    return None


class OwnedDirStore:
    """The checkpoint directory `root`, owned by one of `owners` (uids), read-only. With
    `owners` None (a configured root: a site filesystem all users write to) any account's
    files are read, still never through a link."""

    def __init__(self, root: Path, owners: frozenset[int] | None, skipped: SkippedFiles):
        self.root = Path(root)
        self._owners = owners
        self._skipped = skipped

    def __repr__(self) -> str:
        return f"OwnedDirStore({str(self.root)!r})"

    # --- the Store interface, read side -----------------------------------------------

    def get(self, name: str) -> bytes:
        with self._file(name) as fd, os.fdopen(os.dup(fd), "rb") as handle:
            return handle.read()

    def exists(self, name: str) -> bool:
        try:
            with self._file(name):
                return True
        except (ObjectMissing, UnsafeObjectName):
            return False

    def list(self, prefix: str) -> list[str]:
        return sorted(self.sizes(prefix))

    def sizes(self, prefix: str) -> dict[str, int]:
        directory = prefix.rpartition("/")[0]
        found: dict[str, int] = {}
        try:
            with self._root() as (top, owner):
                fd = self._walk(top, directory.split("/") if directory else [], directory)
                try:
                    self._collect(fd, owner, directory, prefix, found)
                finally:
                    os.close(fd)
        except (ObjectMissing, UnsafeObjectName):
            return {}
        return found

    def put(self, name: str, data: Bytes) -> None:
        raise StoreUnavailable(name, "checkpoint-sync never writes into a job's directory")

    def delete(self, name: str) -> None:
        raise StoreUnavailable(name, "checkpoint-sync never writes into a job's directory")

    # --- walking without following ----------------------------------------------------

    @contextmanager
    def _root(self) -> Iterator[tuple[int, int | None]]:
        try:
            fd = _open(str(self.root), str(self.root), DIR_FLAGS, None)
        except ObjectMissing:  # an unmounted filesystem, never "no checkpoints"
            raise StoreUnavailable(str(self.root), "not a directory") from None
        try:
            owner: int | None = os.fstat(fd).st_uid
            if self._owners is None:
                owner = None
            elif owner not in self._owners:
                raise StoreUnavailable(str(self.root), f"it belongs to uid {owner}, not to "
                                       "its job's user")
            yield fd, owner
        finally:
            os.close(fd)

    def _walk(self, top: int, parts: Sequence[str], name: str) -> int:
        """A new descriptor of the directory `parts` below `top`, each step O_NOFOLLOW."""
        fd = os.dup(top)
        try:
            for part in parts:
                if part in ("", ".", ".."):
                    raise UnsafeObjectName(name, "it is not a plain relative path")
                inner = _open(part, name, DIR_FLAGS, fd)
                os.close(fd)
                fd = inner
        except UnsafeObjectName as exc:
            os.close(fd)
            self._skipped.skip(f"{self.root}/{name}", str(exc))
            raise
        except BaseException:
            os.close(fd)
            raise
        return fd

    @contextmanager
    def _file(self, name: str) -> Iterator[int]:
        check_object_name(name)
        *parts, last = name.split("/")
        with self._root() as (top, owner):
            directory = self._walk(top, parts, name)
            try:
                fd = _open(last, name, FILE_FLAGS, directory)
                why = refusal(os.fstat(fd), owner)
            except UnsafeObjectName as exc:
                self._skipped.skip(f"{self.root}/{name}", str(exc))
                raise
            finally:
                os.close(directory)
            try:
                if why is not None:
                    self._skipped.skip(f"{self.root}/{name}", why)
                    raise UnsafeObjectName(name, why)
                yield fd
            finally:
                os.close(fd)

    def _collect(self, fd: int, owner: int | None, directory: str, prefix: str,
                 found: dict[str, int]) -> None:
        for entry in os.listdir(fd):
            if entry.startswith("."):  # a put's temporary file
                continue
            name = f"{directory}/{entry}" if directory else entry
            if not (name.startswith(prefix) or prefix.startswith(name + "/")):
                continue
            info = os.stat(entry, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISDIR(info.st_mode):
                try:
                    inner = _open(entry, name, DIR_FLAGS, fd)
                except (ObjectMissing, UnsafeObjectName) as exc:  # gone, or now a link
                    if isinstance(exc, UnsafeObjectName):
                        self._skipped.skip(f"{self.root}/{name}", str(exc))
                    continue
                try:
                    self._collect(inner, owner, name, prefix, found)
                finally:
                    os.close(inner)
                continue
            why = refusal(info, owner)
            if why is not None:
                self._skipped.skip(f"{self.root}/{name}", why)
            elif name.startswith(prefix):
                found[name] = info.st_size


def _open(path: str, name: str, flags: int, dir_fd: int | None) -> int:
    """os.open, its failures as the store's: a link where O_NOFOLLOW stops `UnsafeObjectName`,
    a missing one `ObjectMissing`, any other `StoreUnavailable`."""
    try:
        return os.open(path, flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(path, dir_fd):
            raise UnsafeObjectName(name, "a symbolic link, never followed") from None
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            raise ObjectMissing(name) from None
        raise StoreUnavailable(name, exc.strerror or str(exc)) from None


def _is_link(path: str, dir_fd: int | None) -> bool:
    try:
        return stat.S_ISLNK(os.stat(path, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False
