"""Files and directories private to the daemon that writes them, whatever the umask.

Every file a daemon creates (its SQLite databases and their -wal, -shm and -journal
companions, state, lock, pid and metrics files, exports) holds some user's jobs, runs or
directives, so it is made with these helpers and no other way:

- `private_dir(path)`: the directory, created 0700 (missing parents too), or tightened
  to 0700 when it exists with a group or other bit;
- `private_file(path)`: the file, created 0600 without following a link, or tightened;
- `private_database(path)`: the directory and the database file as above, and each
  companion SQLite has left beside it, before SQLite opens it: SQLite creates its
  companions with the database file's mode, so they are 0600 too.

`group=True` is for the one file whose readers need a group (the job registry, written
by SlurmUser and read by the daemons, root without capabilities): files 0640 and
directories 0750, in the group the directory gives them (`chmod g+s` on it names it);
others never get a bit.

Tightening is what the owner may do, and only to what is the state's own: a path owned
by another account, a link where a file should be, or a too-open directory that is
shared (others may write to it, as /tmp, or it is a system-wide one, as /var/lib) is
refused with one line naming it and the fix (`UnsafeStatePath`, the config's exit code),
never followed, chmodded or used as it stands.
"""

from __future__ import annotations

import os
import sqlite3
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slurm_geo.errors import ConfigError

FILE_MODE = 0o600
DIR_MODE = 0o700
GROUP_FILE_MODE = 0o640
GROUP_DIR_MODE = 0o750
SQLITE_COMPANIONS = ("-wal", "-shm", "-journal")


class UnsafeStatePath(ConfigError):
    """A daemon's state file or directory is a link, or belongs to another account."""


def file_mode(group: bool = False) -> int:
    return GROUP_FILE_MODE if group else FILE_MODE


def dir_mode(group: bool = False) -> int:
    return GROUP_DIR_MODE if group else DIR_MODE


def wanted_mode(current: int, mode: int, *, directory: bool) -> int:
    """The permission bits an existing file or directory of mode `current` is tightened to:
    every bit outside `mode` cleared (never one added for the group: a tighter one is
    fine), the owner's own always there, and on a directory its setgid bit, which names
    the group of a group-readable one. Pure."""
    owner = stat.S_IRWXU if directory else stat.S_IRUSR | stat.S_IWUSR
    kept = stat.S_ISGID if directory else 0
    return (stat.S_IMODE(current) & (mode | kept)) | owner


def shared_directory(path: Path, mode: int) -> str | None:
    """Why an existing directory `path` of `mode` is not one to tighten (None: it may be
    the state's own): /tmp, /var/lib or /home must never become 0700. Pure."""
    if mode & (stat.S_ISVTX | stat.S_IWOTH):
        return "others may write to it"
    if len(Path(path).absolute().parts) < 4:  # "/", "var", "lib": a system's directory
        return "it is a system-wide directory"
    return None


def private_dir(path: Path, group: bool = False) -> Path:
    """`path` as a directory only its owner (and, with `group`, its group: read) may
    enter; created with its missing parents, or tightened."""
    mode = dir_mode(group)
    missing = []
    walk = Path(path)
    while not os.path.lexists(walk) and walk != walk.parent:
        missing.append(walk)
        walk = walk.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, mode)
        except FileExistsError:
            continue  # another process made it meanwhile
        os.chmod(directory, mode)  # the umask took bits from it
    _tighten(path, mode, directory=True)
    return path


def private_file(path: Path, group: bool = False) -> Path:
    """`path` as a file only its owner may read and write (with `group`: its group may
    read), in a private directory; created empty if missing, never through a link."""
    private_dir(path.parent, group)
    mode = file_mode(group)
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, mode)
            created = True
        except FileExistsError:
            fd = os.open(path, flags)
            created = False
    except OSError as exc:
        if os.path.islink(path):
            raise _refused(path, "is a symbolic link", "remove it") from None
        if isinstance(exc, PermissionError) and os.path.lexists(path):
            info = os.lstat(path)
            raise _refused(path, f"is mode {stat.S_IMODE(info.st_mode):04o} and belongs to "
                           f"uid {info.st_uid}, not this daemon's uid {os.geteuid()}",
                           "chown it to the daemon's account") from None
        raise UnsafeStatePath(f"{path}: {exc.strerror}; check the path and its directory's "
                              "owner") from None
    try:
        if created:
            os.fchmod(fd, mode)  # exactly: the umask may have taken the group's bit
        else:
            _tighten_fd(fd, path, mode)
    finally:
        os.close(fd)
    return path


def private_database(path: Path, *, timeout_s: float, group: bool = False,
                     **options: Any) -> sqlite3.Connection:
    """A connection to the SQLite database at `path`, its file, its directory and its
    companions private (as `private_file`) before SQLite creates or opens anything.

    An existing database is tightened by its path, never opened here: closing any
    descriptor of a file drops every POSIX lock this process holds on it, so opening and
    closing the file while another connection of the process (a daemon's main thread)
    has it open would leave that connection unlocked, and another process could then
    checkpoint and remove the WAL under it (seen: checkpoint-sync's "disk I/O error",
    then "database disk image is malformed", once its world passes opened the state from
    a thread every pass)."""
    mode = file_mode(group)
    if os.path.lexists(path):
        private_dir(path.parent, group)
        info = os.lstat(path)
        if not stat.S_ISREG(info.st_mode):
            raise _refused(path, "is a symbolic link" if stat.S_ISLNK(info.st_mode)
                           else "is not a regular file", "remove it" if
                           stat.S_ISLNK(info.st_mode) else "move it away")
        _check_and_chmod(path, info, wanted_mode(info.st_mode, mode, directory=False),
                         lambda bits: os.chmod(path, bits))
    else:
        private_file(path, group)
    for suffix in SQLITE_COMPANIONS:
        companion = path.with_name(path.name + suffix)
        if os.path.lexists(companion):
            _tighten(companion, mode, directory=False)
    return sqlite3.connect(path, timeout=timeout_s, **options)


def _tighten(path: Path, mode: int, *, directory: bool) -> None:
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) and not directory:
        raise _refused(path, "is a symbolic link", "remove it")
    if directory:
        info = os.stat(path)  # a state directory an admin placed by a link is theirs
        if not stat.S_ISDIR(info.st_mode):
            raise _refused(path, "is not a directory", "move it away")
        wanted = wanted_mode(info.st_mode, mode, directory=True)
        if stat.S_IMODE(info.st_mode) != wanted:
            problem = shared_directory(path, info.st_mode)
            if problem is not None:
                raise UnsafeStatePath(
                    f"{path} is mode {stat.S_IMODE(info.st_mode):04o} and {problem}, so it "
                    "is not tightened for a daemon's private state: give the file a "
                    f"directory of its own, or chmod {wanted:04o} {path}")
    _check_and_chmod(path, info, wanted_mode(info.st_mode, mode, directory=directory),
                     lambda bits: os.chmod(path, bits))


def _tighten_fd(fd: int, path: Path, mode: int) -> None:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise _refused(path, "is not a regular file", "move it away")
    _check_and_chmod(path, info, wanted_mode(info.st_mode, mode, directory=False),
                     lambda bits: os.fchmod(fd, bits))


def _check_and_chmod(path: Path, info: os.stat_result, wanted: int,
                     chmod: Callable[[int], None]) -> None:
    if stat.S_IMODE(info.st_mode) == wanted:
        return
    try:
        chmod(wanted)
    except PermissionError:  # another account's, and this one may not change it
        raise _refused(path, f"is mode {stat.S_IMODE(info.st_mode):04o} and belongs to uid "
                       f"{info.st_uid}, not this daemon's uid {os.geteuid()}",
                       f"chown it to the daemon's account or chmod {wanted:04o} it") from None


def _refused(path: Path, what: str, fix: str) -> UnsafeStatePath:
    return UnsafeStatePath(f"{path} {what}; it holds a daemon's private state: {fix}")
