"""Replacing a file atomically, so a crash never leaves a half-written one behind."""

from __future__ import annotations

import os
from pathlib import Path


def write_if_changed(path: Path, content: str | bytes, mode: int = 0o644,
                     owner: tuple[int, int] | None = None) -> bool:
    """Replace `path` with `content` (temp file, fsync, rename, directory fsync) unless it
    already holds it; either way leave it with `mode` (and `owner`, a uid and gid, when
    given). True if the file was written."""
    data = content.encode() if isinstance(content, str) else content
    if path.exists() and path.read_bytes() == data:
        path.chmod(mode)
        if owner is not None:
            os.chown(path, *owner)
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    # Never through a link left in the temporary file's place; its mode whatever the umask.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 mode)
    os.fchmod(fd, mode)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    if owner is not None:
        os.chown(tmp, *owner)  # before the rename: the file is never there with another owner
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return True
