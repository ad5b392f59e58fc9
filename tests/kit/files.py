"""What the private-files tests check of a tree: nobody but its owner reads in."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def check_tree(top: Path, file_bits: int, dir_bits: int) -> list[str]:
    """Each entry under `top` (itself included) whose mode is not exactly what a private
    one has: `file_bits` for files, `dir_bits` for directories (setgid allowed)."""
    wrong = []
    for path in [top, *sorted(top.rglob("*"))]:
        info = os.lstat(path)
        want = dir_bits if stat.S_ISDIR(info.st_mode) else file_bits
        bits = stat.S_IMODE(info.st_mode) & ~stat.S_ISGID
        if stat.S_ISLNK(info.st_mode) or bits != want:
            wrong.append(f"{path} {stat.S_IMODE(info.st_mode):04o} (want {want:04o})")
    return wrong
