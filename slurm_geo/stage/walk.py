"""Walking a tree to stage it, through a caller's opener, never following a link.

The walk opens nothing by path on its own. The caller's `Opener` opens the root and each
entry relative to its directory's descriptor (openat), always with O_NOFOLLOW: the later
wiring runs it as the user whose tree it is (root never reads a user's paths), and a local
one (`LocalOpener`) is the plain system calls. An entry is judged by `fstat` of what was
actually opened, so a directory or file swapped for a symbolic link between the listing
and the open is recorded as the link it now is (its target as text) and never followed,
and one swapped for a device or FIFO is skipped, never read (O_NONBLOCK: opening a FIFO
does not wait). Entries come in a fixed order: a directory, then its entries by name.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from slurm_geo.errors import SlurmGeoError
from slurm_geo.exitcodes import ExitCode
from slurm_geo.stage.manifest import DIR, FILE, ROOT, SYMLINK
from slurm_geo.stage.public import has_acl

OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
OTHER = "other"  # a device, FIFO or socket: not staged


class StageSourceError(SlurmGeoError):
    """A tree that cannot be staged as asked: one line naming the path and the fix."""

    exit_code = ExitCode.USAGE

    def __init__(self, path: str, detail: str):
        self.path = path
        super().__init__(f"cannot stage '{path}': {detail}")


class Opener(Protocol):
    """Opens the entries of one tree; every open and lookup refuses to follow a link."""

    def open_root(self) -> int:
        """A descriptor of the root, a directory or a regular file (never a link to one)."""
        ...

    def open_at(self, dir_fd: int, name: str) -> int:
        """A read-only descriptor of `name` in the directory `dir_fd`, O_NOFOLLOW."""
        ...

    def lstat_at(self, dir_fd: int, name: str) -> os.stat_result: ...

    def readlink_at(self, dir_fd: int, name: str) -> str: ...


class LocalOpener:
    """The system calls of this process: for a tree its user may read."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)

    def open_root(self) -> int:
        return os.open(self.root, OPEN_FLAGS)

    def open_at(self, dir_fd: int, name: str) -> int:
        return os.open(name, OPEN_FLAGS, dir_fd=dir_fd)

    def lstat_at(self, dir_fd: int, name: str) -> os.stat_result:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)

    def readlink_at(self, dir_fd: int, name: str) -> str:
        return os.readlink(name, dir_fd=dir_fd)


@dataclass(frozen=True)
class Found:
    """One entry as the walk found it. A file's `fd` is open for reading until the walk
    is asked for the next entry (it closes it then)."""

    path: str
    kind: str
    info: os.stat_result
    fd: int | None = None
    target: str | None = None
    acl: bool = False  # it has an ACL (looked at only where the walk was asked to)


def walk(opener: Opener, source: str, acls: bool = False) -> Iterator[Found]:
    """The root (".") and, for a directory, everything under it; `source` names the tree
    in errors. With `acls`, each file and directory says whether it has an ACL (read from
    what was opened: slurm_geo.stage.public)."""
    try:
        fd = opener.open_root()
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StageSourceError(source, "it is a symbolic link; name the directory or "
                                   "file it points to") from None
        raise StageSourceError(source, exc.strerror or str(exc)) from None
    try:
        info = os.fstat(fd)
        acl = acls and has_acl(fd)
        if stat.S_ISREG(info.st_mode):
            yield Found(ROOT, FILE, info, fd, acl=acl)
        elif stat.S_ISDIR(info.st_mode):
            yield Found(ROOT, DIR, info, acl=acl)
            yield from _children(opener, fd, "", source, acls)
        else:
            raise StageSourceError(source, "neither a directory nor a regular file")
    finally:
        os.close(fd)


def _children(opener: Opener, dir_fd: int, prefix: str, source: str,
              acls: bool) -> Iterator[Found]:
    try:
        names = sorted(os.listdir(dir_fd))
    except OSError as exc:
        raise _unreadable(source, prefix.rstrip("/") or ROOT, exc) from None
    for name in names:
        path = prefix + name
        try:
            info = opener.lstat_at(dir_fd, name)
            if stat.S_ISLNK(info.st_mode):
                yield Found(path, SYMLINK, info, target=opener.readlink_at(dir_fd, name))
                continue
            if not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)):
                yield Found(path, OTHER, info)
                continue
            try:
                fd = opener.open_at(dir_fd, name)
            except OSError as exc:
                if exc.errno != errno.ELOOP:
                    raise
                info = opener.lstat_at(dir_fd, name)  # now a link: recorded, not followed
                yield Found(path, SYMLINK, info, target=opener.readlink_at(dir_fd, name))
                continue
        except FileNotFoundError:
            continue  # removed since the listing: the tree as it is now
        except OSError as exc:
            raise _unreadable(source, path, exc) from None
        try:
            yield from _opened(opener, fd, path, source, acls)
        finally:
            os.close(fd)


def _opened(opener: Opener, fd: int, path: str, source: str, acls: bool
            ) -> Iterator[Found]:
    info = os.fstat(fd)
    acl = acls and has_acl(fd)
    if stat.S_ISREG(info.st_mode):
        yield Found(path, FILE, info, fd, acl=acl)
    elif stat.S_ISDIR(info.st_mode):
        yield Found(path, DIR, info, acl=acl)
        yield from _children(opener, fd, path + "/", source, acls)
    else:
        yield Found(path, OTHER, info)


def _unreadable(source: str, path: str, exc: OSError) -> StageSourceError:
    return StageSourceError(f"{source.rstrip('/')}/{path}" if path != ROOT else source,
                            f"{exc.strerror or exc}; the tree is staged whole or not at all "
                            "(make it readable to its stager, or leave it out)")
