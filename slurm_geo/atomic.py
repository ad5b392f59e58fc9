"""Replacing a file atomically, so a crash never leaves a half-written one behind."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def write_atomic(path: Path, content: str | bytes, mode: int | None = None,
                 owner: tuple[int, int] | None = None) -> None:
    """Replace `path` with `content`: a temporary file beside it, fsync, rename, directory
    fsync. The file gets `mode` (None: what the umask leaves of 0o666) and `owner` (a uid
    and gid, when given) before the rename, so it is never there with others."""
    data = content.encode() if isinstance(content, str) else content
    # A fresh name nobody can guess, created here or not at all (O_EXCL): whatever another
    # user planted beside `path` (a link, a FIFO, a hard link to their file) is neither
    # followed nor written through, nor in the way.
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o666 if mode is None else mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            if mode is not None:
                os.fchmod(handle.fileno(), mode)
            if owner is not None:
                os.fchown(handle.fileno(), *owner)
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def write_if_changed(path: Path, content: str | bytes, mode: int = 0o644,
                     owner: tuple[int, int] | None = None) -> bool:
    """Replace `path` with `content` (`write_atomic`) unless it already holds it; either
    way leave it with `mode` (and `owner`, a uid and gid, when given). True if the file
    was written."""
    data = content.encode() if isinstance(content, str) else content
    if path.exists() and path.read_bytes() == data:
        path.chmod(mode)
        if owner is not None:
            os.chown(path, *owner)
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, data, mode, owner)
    return True
