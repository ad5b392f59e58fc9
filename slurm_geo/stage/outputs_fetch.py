"""The owner's side of shipped outputs (docs/format.md §11.9): write what moved
incarnations shipped to the paths she expects at home (or under another directory), as
herself, never replacing a file that is newer than what was shipped.

Incarnations are applied oldest first (by when their last index was written), so where
two shipped the same path the later one's file stands. For each file: absent, it is
written (a hidden temporary beside it, then renamed); present with the same content, it
is left; present and modified after the shipped copy, it is *kept* and reported; present
and older, it is replaced. A link, or anything but a regular file where a file goes, is
kept and reported: never written through.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from slurm_geo.ckpt.format.keys import RunKeyRing
from slurm_geo.ckpt.stores.store import Store
from slurm_geo.stage.outputs import (
    Index,
    ShippedFile,
    incarnations,
    latest_index,
    read_file,
)


@dataclass
class Fetched:
    written: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    kept: list[tuple[str, str]] = field(default_factory=list)  # (path, why)
    incarnations: list[str] = field(default_factory=list)


def shipped_indexes(store: Store, ring: RunKeyRing, run: str) -> list[Index]:
    """Each incarnation's latest index, oldest written first."""
    found = [latest_index(store, ring, run, name) for name in incarnations(store, run)]
    return sorted((i for i in found if i is not None),
                  key=lambda i: (i.written_at, i.incarnation))


def fetch_outputs(store: Store, ring: RunKeyRing, run: str, to: Path | None = None,
                  incarnation: str | None = None) -> Fetched:
    """Write `run`'s shipped outputs (of one `incarnation`, or of every one) at their
    home paths, or under `to` (`to` + the home path)."""
    plan: dict[Path, tuple[Index, ShippedFile]] = {}
    result = Fetched()
    for index in shipped_indexes(store, ring, run):
        if incarnation is not None and index.incarnation != incarnation:
            continue
        result.incarnations.append(index.incarnation)
        for output in index.outputs:
            base = Path(output.home) if to is None else to / output.home.lstrip("/")
            for entry in output.entries:
                plan[base if entry.path == "." else base / entry.path] = (index, entry)
    for target in sorted(plan, key=lambda p: (len(p.parts), str(p))):
        index, entry = plan[target]
        if entry.type == "dir":
            _directory(target, entry, result)
        else:
            _file(store, ring, run, index.incarnation, target, entry, result)
    return result


def _directory(target: Path, entry: ShippedFile, result: Fetched) -> None:
    try:
        info = os.lstat(target)
    except FileNotFoundError:
        target.mkdir(parents=True, mode=entry.mode & 0o777 or 0o700)
        return
    if not stat.S_ISDIR(info.st_mode):
        result.kept.append((str(target), "not a directory here"))


def _file(store: Store, ring: RunKeyRing, run: str, incarnation: str, target: Path,
          entry: ShippedFile, result: Fetched) -> None:
    try:
        info = os.lstat(target)
    except FileNotFoundError:
        info = None
    if info is not None:
        if not stat.S_ISREG(info.st_mode):
            result.kept.append((str(target), "not a regular file here"))
            return
        if info.st_size == entry.size and entry.sha256 and _sha256(target) == entry.sha256:
            result.unchanged.append(str(target))
            return
        if info.st_mtime_ns > entry.mtime_ns:
            result.kept.append((str(target), "newer here than the shipped copy"))
            return
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.parent / f".{target.name}.slurm-geo-{os.urandom(6).hex()}"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as handle:
            for data in read_file(store, ring, run, incarnation, entry):
                handle.write(data)
            handle.flush()
            os.fchmod(handle.fileno(), entry.mode & 0o777)
            os.fsync(handle.fileno())
        os.utime(temporary, ns=(entry.mtime_ns, entry.mtime_ns), follow_symlinks=False)
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    result.written.append(str(target))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
