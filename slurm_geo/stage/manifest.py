"""Tree manifests (docs/format.md §11.3): what one snapshot of a staged tree holds.

A manifest lists every entry of the tree in walk order, a directory before what it holds:
its relative path, its type (file, directory, symbolic link), its permission bits (never
setuid or setgid), its modification time and, for a file, its size and the chunks of its
content; a link's target is kept as text. Parsing is strict and pure: a manifest that
opened (its tag checked) but breaks a rule is *corrupt*, named.
"""

from __future__ import annotations

import json
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import zstandard

from slurm_geo.ckpt.errors import (
    CorruptObject,
    MalformedData,
    UnsafeObjectName,
    UnsupportedFormat,
)
from slurm_geo.ckpt.format.chunking import CdcParams
from slurm_geo.ckpt.format.manifest import MAX_CHUNK_SIZE, ChunkRef
from slurm_geo.ckpt.format.names import is_hex_id
from slurm_geo.ckpt.format.pack import ENTRY_OVERHEAD, HEADER_SIZE
from slurm_geo.stage.names import check_tree_id

TREE_FORMAT = 1
FILE, DIR, SYMLINK = "file", "dir", "symlink"
ROOT = "."
# Kept: permission bits and the sticky bit. Never setuid or setgid: a staged tree is
# materialised by whoever asks, and must not hand out their rights.
MODE_BITS = 0o1777
LINK_MODE = 0o777
MAX_PAYLOAD = 1 << 30  # a manifest's JSON, decompressed: refused past it
ZSTD_LEVEL = 3


def keep_mode(st_mode: int) -> int:
    return stat.S_IMODE(st_mode) & MODE_BITS


@dataclass(frozen=True)
class TreeEntry:
    path: str  # "." for the root, else a relative path of '/'-separated names
    type: str
    mode: int
    mtime_ns: int
    size: int = 0  # a file's bytes
    chunks: tuple[ChunkRef, ...] = ()
    target: str | None = None  # a symbolic link's, as text: never followed
    # A file's inode and change time at home, for the next snapshot's "unchanged" test
    # (with size and mtime): not used when materialising.
    ino: int = 0
    ctime_ns: int = 0

    def unchanged_as(self, other: TreeEntry) -> bool:
        """Whether a file found now (`self`) may take `other`'s chunks without a read."""
        return (self.type == other.type == FILE and self.size == other.size
                and self.mtime_ns == other.mtime_ns and self.ctime_ns == other.ctime_ns
                and self.ino == other.ino)

    def same_as(self, other: TreeEntry) -> bool:
        """Equal for what a materialised tree shows (content, mode, time, target)."""
        return (self.path, self.type, self.mode, self.mtime_ns, self.size, self.target,
                [c.id for c in self.chunks]) == (other.path, other.type, other.mode,
                                                 other.mtime_ns, other.size, other.target,
                                                 [c.id for c in other.chunks])


@dataclass(frozen=True)
class TreeManifest:
    tree: str
    domain: str  # whose key seals it and whose packs hold its chunks
    snapshot: int
    parent: int | None
    created_at: str
    source: str  # where it was staged from, as the stager named it (a path at home)
    chunking: CdcParams
    entries: tuple[TreeEntry, ...]
    format: int = TREE_FORMAT
    key: bytes | None = field(default=None, compare=False, repr=False)  # fingerprint read under
    # SHA-256 (hex) of the sealed object it was read from or written as: what a pin binds
    sha256: str | None = field(default=None, compare=False, repr=False)

    @property
    def root(self) -> TreeEntry:
        return self.entries[0]

    def files(self) -> Iterator[TreeEntry]:
        return (e for e in self.entries if e.type == FILE)

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.files())

    def refs(self) -> Iterator[ChunkRef]:
        for entry in self.files():
            yield from entry.chunks


def tree_to_payload(manifest: TreeManifest) -> bytes:
    packs: dict[str, int] = {}
    entries = [_entry_to_json(e, packs) for e in manifest.entries]
    document = {
        "format": manifest.format, "tree": manifest.tree, "domain": manifest.domain,
        "snapshot": manifest.snapshot, "parent": manifest.parent,
        "created_at": manifest.created_at, "source": manifest.source,
        "chunking": {"min_size": manifest.chunking.min_size,
                     "mask_bits": manifest.chunking.mask_bits,
                     "max_size": manifest.chunking.max_size},
        "packs": list(packs), "entries": entries,
    }
    text = json.dumps(document, separators=(",", ":"), ensure_ascii=True)
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(text.encode("ascii"))


def _entry_to_json(entry: TreeEntry, packs: dict[str, int]) -> dict[str, Any]:
    out: dict[str, Any] = {"path": entry.path, "type": entry.type}
    if entry.type != SYMLINK:
        out["mode"] = entry.mode
    out["mtime_ns"] = entry.mtime_ns
    if entry.type == FILE:
        out.update(size=entry.size, ino=entry.ino, ctime_ns=entry.ctime_ns, chunks=[
            [c.id, packs.setdefault(c.pack, len(packs)), c.offset, c.length, c.size]
            for c in entry.chunks])
    if entry.type == SYMLINK:
        out["target"] = entry.target
    return out


def parse_tree(payload: bytes, name: str, tree: str, snapshot: int) -> TreeManifest:
    """The tree manifest in `payload`, read from `name`, which stands for (tree, snapshot)."""
    try:
        document = _document(payload)
        version = document.get("format")
        if version != TREE_FORMAT or isinstance(version, bool):
            raise UnsupportedFormat(name, version, str(TREE_FORMAT))
        manifest = _parse(document)
    except MalformedData as exc:
        raise CorruptObject(name, f"invalid tree manifest: {exc}") from None
    if manifest.tree != tree or manifest.snapshot != snapshot:
        raise CorruptObject(name, f"holds tree {manifest.tree!r} snapshot {manifest.snapshot}")
    return manifest


def _document(payload: bytes) -> dict[str, Any]:
    try:
        text = zstandard.ZstdDecompressor().decompress(payload, max_output_size=MAX_PAYLOAD)
        document = json.loads(text)
    except (zstandard.ZstdError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MalformedData(f"not a zstd frame of JSON ({exc})") from None
    if not isinstance(document, dict):
        raise MalformedData("not a JSON object")
    return document


def _get(obj: dict[str, Any], key: str, kind: type, where: str, nullable: bool = False) -> Any:
    if key not in obj:
        raise MalformedData(f"{where}: '{key}' is missing")
    value = obj[key]
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, kind):
        raise MalformedData(f"{where}: '{key}' is not a {kind.__name__}")
    return value


def _parse(doc: dict[str, Any]) -> TreeManifest:
    try:
        tree = check_tree_id(_get(doc, "tree", str, "manifest"))
        domain = check_tree_id(_get(doc, "domain", str, "manifest"), "domain")
    except UnsafeObjectName as exc:  # an unsafe id is damage here, named with the manifest
        raise MalformedData(str(exc)) from None
    snapshot = _get(doc, "snapshot", int, "manifest")
    parent = _get(doc, "parent", int, "manifest", nullable=True)
    if snapshot < 1 or (parent is not None and not 1 <= parent < snapshot):
        raise MalformedData(f"snapshot {snapshot} with parent {parent}")
    raw = _get(doc, "chunking", dict, "manifest")
    try:
        chunking = CdcParams(*(_get(raw, k, int, "chunking")
                               for k in ("min_size", "mask_bits", "max_size")))
    except ValueError as exc:
        raise MalformedData(str(exc)) from None
    packs = _get(doc, "packs", list, "manifest")
    if not all(is_hex_id(p) for p in packs):
        raise MalformedData("a pack id is not 64 lowercase hex digits")
    entries = tuple(_Entries(packs).parse(_get(doc, "entries", list, "manifest")))
    return TreeManifest(tree, domain, snapshot, parent,
                        _get(doc, "created_at", str, "manifest"),
                        _get(doc, "source", str, "manifest"), chunking, entries)


class _Entries:
    def __init__(self, packs: list[str]):
        self._packs = packs
        self._dirs: set[str] = set()
        self._seen: set[str] = set()

    def parse(self, raw_entries: list[Any]) -> Iterator[TreeEntry]:
        if not raw_entries:
            raise MalformedData("no entries: the root is missing")
        for index, raw in enumerate(raw_entries):
            if not isinstance(raw, dict):
                raise MalformedData("an entry is not an object")
            entry = self._entry(raw)
            self._place(entry, index)
            yield entry

    def _place(self, entry: TreeEntry, index: int) -> None:
        """The root first; every other entry under a directory listed before it, once."""
        if index == 0:
            if entry.path != ROOT or entry.type == SYMLINK:
                raise MalformedData("the first entry is not the root, a directory or file")
        else:
            check_relative_path(entry.path)
            parent = entry.path.rpartition("/")[0] or ROOT
            if parent not in self._dirs:
                raise MalformedData(f"{entry.path!r} is not under a directory listed before it")
            if entry.path in self._seen:
                raise MalformedData(f"{entry.path!r} is listed twice")
        self._seen.add(entry.path)
        if entry.type == DIR:
            self._dirs.add(entry.path)

    def _entry(self, raw: dict[str, Any]) -> TreeEntry:
        path = _get(raw, "path", str, "entry")
        kind = _get(raw, "type", str, path)
        mtime = _get(raw, "mtime_ns", int, path)
        if kind == SYMLINK:
            target = _get(raw, "target", str, path)
            if not target or "\0" in target:
                raise MalformedData(f"{path}: a link's target is empty or holds NUL")
            return TreeEntry(path, kind, LINK_MODE, mtime, target=target)
        if kind not in (FILE, DIR):
            raise MalformedData(f"{path}: unknown type {kind!r}")
        mode = _get(raw, "mode", int, path)
        if mode & ~MODE_BITS or mode < 0:
            raise MalformedData(f"{path}: mode {mode:o} holds more than permission bits")
        if kind == DIR:
            return TreeEntry(path, kind, mode, mtime)
        size = _get(raw, "size", int, path)
        chunks = tuple(self._ref(r, path) for r in _get(raw, "chunks", list, path))
        if size != sum(c.size for c in chunks):
            raise MalformedData(f"{path}: chunks do not add up to {size} bytes")
        return TreeEntry(path, kind, mode, mtime, size, chunks, ino=_get(raw, "ino", int, path),
                         ctime_ns=_get(raw, "ctime_ns", int, path))

    def _ref(self, raw: Any, where: str) -> ChunkRef:
        if not (isinstance(raw, list) and len(raw) == 5 and is_hex_id(raw[0])
                and all(isinstance(v, int) and not isinstance(v, bool) for v in raw[1:])):
            raise MalformedData(f"{where}: a chunk ref is not [id, pack, offset, length, size]")
        chunk, pack, offset, length, size = raw
        if not 0 <= pack < len(self._packs) or offset < HEADER_SIZE \
                or length < ENTRY_OVERHEAD or not 0 < size <= MAX_CHUNK_SIZE:
            raise MalformedData(f"{where}: chunk ref {chunk} is out of range")
        return ChunkRef(chunk, self._packs[pack], offset, length, size)


def check_relative_path(path: str) -> str:
    """A path inside the tree: names joined by '/', none empty, '.', '..' or holding NUL."""
    parts = path.split("/")
    if any(p in ("", ".", "..") or "\0" in p for p in parts):
        raise MalformedData(f"{path!r} is not a relative path inside the tree")
    return path
