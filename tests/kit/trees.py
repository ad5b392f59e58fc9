"""Trees on disk as the staging tests write and compare them, and a store that counts the
bytes put into it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from slurm_geo.ckpt.format.chunking import CdcParams
from slurm_geo.ckpt.repo.writer import WriteOptions
from slurm_geo.ckpt.stores.store import Bytes, LocalDirStore

SMALL = CdcParams(min_size=4096, mask_bits=13, max_size=65536)
OPTIONS = WriteOptions(cdc=SMALL, pack_size=1 << 20, workers=2)
MASTER = bytes(range(32))


class CountingStore(LocalDirStore):
    """The bytes every put wrote, by object name."""

    def __init__(self, root: Path):
        super().__init__(root)
        self.puts: dict[str, int] = {}

    def put(self, name: str, data: Bytes) -> None:
        super().put(name, data)
        self.puts[name] = self.puts.get(name, 0) + len(data)

    def counted(self) -> int:
        total, self.puts = sum(self.puts.values()), {}
        return total


def write_tree(root: Path, files: dict[str, bytes | str], modes: dict[str, int] | None = None
               ) -> Path:
    """Files (bytes), links ("->target" strings) and empty directories (paths ending in
    '/'), then the modes given."""
    root.mkdir(parents=True, exist_ok=True)
    for path, content in files.items():
        where = root / path
        where.parent.mkdir(parents=True, exist_ok=True)
        if path.endswith("/"):
            where.mkdir(exist_ok=True)
        elif isinstance(content, str):
            os.symlink(content.removeprefix("->"), where)
        else:
            where.write_bytes(content)
    for path, mode in (modes or {}).items():
        os.chmod(root / path, mode)
    return root


def listing(root: Path) -> dict[str, tuple]:
    """What a tree shows: per path its type, mode, content or link target, mtime."""
    found: dict[str, tuple] = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(directory) / name
            info = path.lstat()
            relative = path.relative_to(root).as_posix()
            if stat.S_ISLNK(info.st_mode):
                found[relative] = ("link", os.readlink(path), info.st_mtime_ns)
            elif stat.S_ISDIR(info.st_mode):
                found[relative] = ("dir", stat.S_IMODE(info.st_mode), info.st_mtime_ns)
            else:
                found[relative] = ("file", stat.S_IMODE(info.st_mode), path.read_bytes(),
                                   info.st_mtime_ns)
    return found
