"""Materialising a snapshot of a staged tree as the calling user (docs/format.md §11.5).

Everything is written under a new hidden directory (or file) next to the target, opened
and created relative to directory descriptors with O_NOFOLLOW and O_EXCL, so nothing is
ever written through a symbolic link, neither one the snapshot recreates nor one someone
else put there; it is renamed to the target only once whole. Every chunk is checked
against its id before a byte of it is written; a fault raises the typed error naming the
object, and what was written so far is removed. Modes are the snapshot's (permission and
sticky bits: setuid and setgid are never stored), set with fchmod after the content, so
the umask plays no part; directories get theirs last, deepest first, with their times.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from slurm_geo.ckpt.format.manifest import ChunkRef
from slurm_geo.ckpt.repo.reader import ChunkReader, default_workers, ordered_map, worker_pool
from slurm_geo.errors import SlurmGeoError
from slurm_geo.exitcodes import ExitCode
from slurm_geo.stage.manifest import DIR, FILE, ROOT, SYMLINK, TreeEntry, TreeManifest

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class StageTargetError(SlurmGeoError):
    exit_code = ExitCode.USAGE

    def __init__(self, target: str, detail: str):
        super().__init__(f"cannot materialise a staged tree at '{target}': {detail}")


@dataclass(frozen=True)
class Materialised:
    path: Path
    files: int
    bytes: int
    links: int
    directories: int


def materialise(manifest: TreeManifest, reader: ChunkReader,
                target: str | os.PathLike[str]) -> Materialised:
    path = Path(os.path.abspath(target))
    if os.path.lexists(path):
        raise StageTargetError(str(path), "it exists; name a new path (or remove it)")
    try:
        parent = os.open(path.parent, DIR_FLAGS)
    except OSError as exc:
        raise StageTargetError(str(path), f"its directory: {exc.strerror or exc}") from None
    temp = f".{path.name}.staging-{os.urandom(6).hex()}"
    try:
        counts = _Writer(manifest, reader, parent, temp).write()
        try:
            os.rename(temp, path.name, src_dir_fd=parent, dst_dir_fd=parent)
        except OSError as exc:
            raise StageTargetError(str(path), exc.strerror or str(exc)) from None
        os.fsync(parent)
    except BaseException:
        _remove(parent, temp)
        raise
    finally:
        os.close(parent)
    return Materialised(path, *counts)


def _remove(parent: int, name: str) -> None:
    """Remove what an unfinished materialisation wrote (links removed, never followed)."""
    try:
        info = os.stat(name, dir_fd=parent, follow_symlinks=False)
        if stat.S_ISDIR(info.st_mode):
            shutil.rmtree(name, dir_fd=parent, ignore_errors=True)
        else:
            os.unlink(name, dir_fd=parent)
    except FileNotFoundError:
        return


class _Writer:
    def __init__(self, manifest: TreeManifest, reader: ChunkReader, parent: int, temp: str):
        self._manifest = manifest
        self._reader = reader
        self._parent = parent
        self._temp = temp
        self._stack: list[tuple[str, int]] = []  # open directories: the current chain
        self.files = self.bytes = self.links = self.directories = 0

    def write(self) -> tuple[int, int, int, int]:
        workers = default_workers()
        pool = worker_pool(workers, "slurm-geo-materialise")
        chunks = ordered_map(self._reader.read, self._refs(), pool, 2 * workers)
        try:
            for entry in self._manifest.entries:
                self._write_entry(entry, chunks)
            self._close_to(0)
            self._finish_directories()
        finally:
            self._close_to(0)
            chunks.close()
            pool.shutdown(wait=True, cancel_futures=True)
        return self.files, self.bytes, self.links, self.directories

    def _refs(self) -> Iterator[ChunkRef]:
        return self._manifest.refs()

    def _write_entry(self, entry: TreeEntry, chunks: Iterator[bytearray]) -> None:
        if entry.path == ROOT:
            if entry.type == DIR:
                os.mkdir(self._temp, 0o700, dir_fd=self._parent)
                self._stack.append((ROOT, os.open(self._temp, DIR_FLAGS, dir_fd=self._parent)))
                self.directories += 1
            else:
                self._write_file(self._parent, self._temp, entry, chunks)
            return
        parent_path, _, name = entry.path.rpartition("/")
        directory = self._directory(parent_path or ROOT)
        if entry.type == DIR:
            os.mkdir(name, 0o700, dir_fd=directory)
            self._stack.append((entry.path, os.open(name, DIR_FLAGS, dir_fd=directory)))
            self.directories += 1
        elif entry.type == SYMLINK:
            assert entry.target is not None
            os.symlink(entry.target, name, dir_fd=directory)
            os.utime(name, ns=(entry.mtime_ns, entry.mtime_ns), dir_fd=directory,
                     follow_symlinks=False)
            self.links += 1
        else:
            assert entry.type == FILE
            self._write_file(directory, name, entry, chunks)

    def _write_file(self, directory: int, name: str, entry: TreeEntry,
                    chunks: Iterator[bytearray]) -> None:
        fd = os.open(name, NEW_FILE, 0o600, dir_fd=directory)
        try:
            for _ref in entry.chunks:
                data = memoryview(next(chunks))
                while data:
                    data = data[os.write(fd, data):]
            os.fchmod(fd, entry.mode)
            os.utime(fd, ns=(entry.mtime_ns, entry.mtime_ns))
        finally:
            os.close(fd)
        self.files += 1
        self.bytes += entry.size

    def _directory(self, path: str) -> int:
        """The descriptor of the directory `path`: on the chain of open ones (the walk
        order), else opened from the root, each step O_NOFOLLOW."""
        for depth, (open_path, _fd) in enumerate(self._stack):
            if open_path == path:
                self._close_to(depth + 1)
                return self._stack[-1][1]
        self._close_to(1)
        fd = self._open_from_root(path)
        self._stack.append((path, fd))
        return fd

    def _close_to(self, depth: int) -> None:
        while len(self._stack) > depth:
            os.close(self._stack.pop()[1])

    def _finish_directories(self) -> None:
        """Each directory's mode and times, deepest first (a read-only directory last)."""
        directories = [e for e in self._manifest.entries if e.type == DIR]
        for entry in reversed(directories):
            if entry.path == ROOT:
                fd = os.open(self._temp, DIR_FLAGS, dir_fd=self._parent)
            else:
                fd = self._open_from_root(entry.path)
            try:
                os.fchmod(fd, entry.mode)
                os.utime(fd, ns=(entry.mtime_ns, entry.mtime_ns))
            finally:
                os.close(fd)

    def _open_from_root(self, path: str) -> int:
        fd = os.open(self._temp, DIR_FLAGS, dir_fd=self._parent)
        for name in path.split("/"):
            try:
                child = os.open(name, DIR_FLAGS, dir_fd=fd)
            finally:
                os.close(fd)
            fd = child
        return fd
