"""Staged trees in a checkpoint store (docs/format.md §11): stage a snapshot of a directory
tree or one file, read it back, verify it, materialise it.

A snapshot is written as a checkpoint is: the domain's key (once), then the packs of the
chunks not stored yet, then the tree manifest, then the tree's latest pointer; a crash
leaves the previous snapshot whole and still the latest. Snapshots are numbered from 1 and
never rewritten. A new snapshot takes the chunks of the latest one under the same key: a
file whose size, modification time, change time and inode are unchanged is not read at
all (restic's parent snapshot), a changed one is read and cut again, and only chunks not
stored yet are stored. A snapshot of a tree in which nothing changed stores nothing: the
latest one stands. One stager per tree at a time (checkpoint-sync is one per site); two
racing would be refused by the second's manifest name, not merged.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from functools import partial

from slurm_geo.ckpt.errors import CkptError, CorruptObject, ObjectMissing
from slurm_geo.ckpt.format.chunking import CdcParams
from slurm_geo.ckpt.format.keys import SALT_SIZE, RandomBytes, RunKeys
from slurm_geo.ckpt.format.manifest import FORMAT_VERSION, ChunkRef
from slurm_geo.ckpt.format.seal import Kind, open_sealed, seal, sealing_fingerprint
from slurm_geo.ckpt.repo.reader import ChunkReader, default_workers, ordered_map, worker_pool
from slurm_geo.ckpt.repo.writer import ChunkWriter, WriteOptions
from slurm_geo.ckpt.stores.store import Bytes, Store
from slurm_geo.exitcodes import ExitCode
from slurm_geo.stage.cdc import stream_chunks
from slurm_geo.stage.keys import TreeKeyHolder
from slurm_geo.stage.manifest import (
    DIR,
    FILE,
    LINK_MODE,
    SYMLINK,
    TreeEntry,
    TreeManifest,
    keep_mode,
    parse_tree,
    tree_to_payload,
)
from slurm_geo.stage.materialise import Materialised, materialise
from slurm_geo.stage.names import (
    check_tree_id,
    snapshot_name,
    snapshot_of_name,
    snapshot_prefix,
    tree_latest_name,
    tree_pack_name,
)
from slurm_geo.stage.public import entry_private
from slurm_geo.stage.sharing import NotPublic, Shared, Vetted, pinned_sealed, plan
from slurm_geo.stage.walk import OTHER, Found, Opener, walk

LATEST_FORMAT = 1
DEFAULT_TREE_OPTIONS = WriteOptions()


class ImmutableSnapshot(CkptError):
    exit_code = ExitCode.IMMUTABLE

    def __init__(self, name: str):
        super().__init__(name, f"snapshot '{name}' exists and is never rewritten; another "
                         "stager of this tree wrote it meanwhile: stage again")


@dataclass(frozen=True)
class Staged:
    """What staging did. `new`: False where nothing had changed and the latest snapshot
    stands as `manifest`."""

    manifest: TreeManifest
    new: bool
    stored_bytes: int  # bytes put in the store: packs, manifest, pointer (a new key aside)
    files_read: int
    bytes_read: int
    files_reused: int  # unchanged by their stat: their chunks taken without a read
    bytes_reused: int
    skipped: tuple[str, ...]  # devices, FIFOs, sockets: not staged
    private: str | None = None  # an entry not every user may read, and why (if looked)
    public: bool | None = None  # every user may read it all (None: not looked at)
    read_back: int = 0  # chunks of others' snapshots read back and referenced (shared)
    refused: int = 0    # chunks of others' snapshots that did not open to their id


@dataclass(frozen=True)
class Verified:
    chunks: int
    bytes: int  # of the distinct chunks read


class _Counting:
    """A store that counts the bytes put through it."""

    def __init__(self, store: Store):
        self._store = store
        self.put_bytes = 0

    def put(self, name: str, data: Bytes) -> None:
        self._store.put(name, data)
        self.put_bytes += len(data)

    def get(self, name: str) -> bytes:
        return self._store.get(name)

    def list(self, prefix: str) -> list[str]:
        return self._store.list(prefix)

    def delete(self, name: str) -> None:
        self._store.delete(name)

    def exists(self, name: str) -> bool:
        return self._store.exists(name)

    def sizes(self, prefix: str) -> dict[str, int]:
        return self._store.sizes(prefix)


def _no_delta_base(ref: ChunkRef) -> bytes:
    raise AssertionError("staged trees take no deltas")


class Trees:
    """The staged trees of one store, under the keys a `TreeKeyHolder` gives."""

    def __init__(self, store: Store, keys: TreeKeyHolder,
                 options: WriteOptions = DEFAULT_TREE_OPTIONS,
                 random_bytes: RandomBytes = os.urandom,
                 clock: Callable[[], datetime] = lambda: datetime.now(UTC)):
        self._store = store
        self._keys = keys
        self._options = options
        self._random_bytes = random_bytes
        self._clock = clock

    # Reading.

    def snapshots(self, tree: str) -> list[int]:
        names = self._store.list(snapshot_prefix(tree))
        return sorted(n for n in (snapshot_of_name(tree, name) for name in names) if n)

    def latest(self, tree: str, domain: str | None = None) -> int | None:
        """The snapshot the tree's latest pointer names; None for a tree never staged."""
        name = tree_latest_name(tree)
        try:
            sealed = self._store.get(name)
        except ObjectMissing:
            return None
        ring = self._keys.ring(domain or tree)
        payload = open_sealed(ring.opening(sealing_fingerprint(sealed)).data_key, Kind.LATEST,
                              sealed, name)
        try:
            document = json.loads(payload)
            snapshot = document["snapshot"]
            if document.get("format") != LATEST_FORMAT or document.get("tree") != tree \
                    or isinstance(snapshot, bool) or not isinstance(snapshot, int) \
                    or snapshot < 1:
                raise ValueError(document)
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            raise CorruptObject(name, "invalid tree latest pointer") from None
        return snapshot

    def manifest(self, tree: str, snapshot: int, domain: str | None = None,
                 sealed: bytes | None = None) -> TreeManifest:
        """The snapshot's manifest, from the store or from its `sealed` object as read."""
        domain = domain or tree
        name = snapshot_name(tree, snapshot)
        sealed = self._store.get(name) if sealed is None else sealed
        keys = self._keys.ring(domain).opening(sealing_fingerprint(sealed))
        manifest = parse_tree(open_sealed(keys.data_key, Kind.MANIFEST, sealed, name),
                              name, tree, snapshot)
        if manifest.domain != domain:
            raise CorruptObject(name, f"names domain {manifest.domain!r}, not {domain!r}")
        return replace(manifest, key=keys.fingerprint,
                       sha256=hashlib.sha256(sealed).hexdigest())

    def reader(self, manifest: TreeManifest, hash_packs: bool = False) -> ChunkReader:
        """A reader of the manifest's chunks: every chunk it returns is checked by its id."""
        keys = self._keys.ring(manifest.domain).sealed_under(
            manifest.key, snapshot_name(manifest.tree, manifest.snapshot))
        return ChunkReader(self._store, keys, FORMAT_VERSION, manifest.domain,
                           hash_packs=hash_packs,
                           pack_object=partial(tree_pack_name, manifest.domain))

    def verify(self, tree: str, snapshot: int, domain: str | None = None) -> Verified:
        """Read every chunk of the snapshot (packs hashed, chunks checked against their ids)
        without writing anything; the first fault raises, naming its object."""
        manifest = self.manifest(tree, snapshot, domain)
        reader = self.reader(manifest, hash_packs=True)
        refs = list({r.id: r for r in manifest.refs()}.values())
        workers = default_workers()
        pool = worker_pool(workers, "slurm-geo-verify")
        try:
            total = sum(len(data) for data in ordered_map(reader.read, refs, pool, 2 * workers))
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        return Verified(len(refs), total)

    def materialise(self, tree: str, snapshot: int, target: str | os.PathLike[str],
                    domain: str | None = None) -> Materialised:
        """Write the snapshot at `target` (which must not exist), every chunk verified."""
        manifest = self.manifest(tree, snapshot, domain)
        return materialise(manifest, self.reader(manifest), target)

    # Staging.

    def stage(self, tree: str, opener: Opener, source: str, domain: str | None = None,
              shares_with: Sequence[str] = (), shared: Shared | None = None,
              note_public: bool = False) -> Staged:
        """A new snapshot of the tree `opener` opens (`source` names it: a path at home).

        Its chunks already in the tree's latest snapshot are referenced, not stored; so
        are those in the latest snapshots of the trees `shares_with` names, which must be
        of the same `domain` (e.g. a user's other environments: docs/format.md §11.2).

        `shared`: the domain's key is every grantee's (slurm_geo.stage.sharing): every
        entry must be readable by every user (else `NotPublic`, before any byte of it is
        read), a file is taken unread only from the snapshot the stager's run pinned, and
        another's chunks are referenced only once read back to their ids. `note_public`:
        say in `Staged.public` whether every user may read the whole tree."""
        check_tree_id(tree)
        domain = domain or tree
        counting = _Counting(self._store)
        keys = self._keys.ring(domain, create=True).current
        listed = self.snapshots(tree)
        usable = partial(_shares, keys, self._options.cdc, domain)
        if shared is None:
            latest = self.latest(tree, domain)
            parent = None if latest is None else self.manifest(tree, latest, domain)
            others = (self._latest_manifest(domain, other) for other in shares_with)
            build = _Build(parent if parent is not None and usable(parent) else None,
                           [m for m in others if m is not None and usable(m)])
            standing: tuple[TreeManifest | None, ...] = (parent,)
        else:
            build, latest, standing = self._shared_build(tree, domain, listed, shared,
                                                         keys, usable)
        build.watch(shared is not None, note_public or shared is not None, source)
        with ChunkWriter(counting, keys, self._options, self._random_bytes,
                         build.known, _no_delta_base, domain,
                         pack_object=partial(tree_pack_name, domain)) as writer:
            for found in walk(opener, source, acls=build.watching):
                build.add(found, writer, self._options)
            writer.close()
            entries = build.entries(writer)
        number = max([*listed, latest or 0]) + 1
        manifest = TreeManifest(tree, domain, number, latest,
                                self._clock().isoformat(timespec="seconds"), source,
                                self._options.cdc, entries)
        for same in standing:
            if same is not None and same.domain == domain and same.entries == entries \
                    and (shared is None or same.source == source):
                return build.staged(same, False, counting.put_bytes)
        digest = self._commit(manifest, keys, counting, pointer_required=shared is None)
        return build.staged(replace(manifest, key=keys.fingerprint, sha256=digest), True,
                            counting.put_bytes)

    def _shared_build(self, tree: str, domain: str, listed: list[int], shared: Shared,
                      keys: RunKeys, usable: Callable[[TreeManifest], bool]
                      ) -> tuple[_Build, int | None, tuple[TreeManifest | None, ...]]:
        """The build of a shared staging: stat reuse from the pinned snapshot only, the
        others' chunks vetted; the snapshot it numbers after and the ones that may stand."""
        sealed = pinned_sealed(self._store, tree, shared.pinned)
        pinned = None
        if sealed is not None and shared.pinned is not None:
            try:
                pinned = self.manifest(tree, shared.pinned[0], domain, sealed)
            except CkptError:
                pinned = None
        found = plan(self._store, tree, domain, listed, pinned,
                     lambda n: self.manifest(tree, n, domain), usable)
        reader = ChunkReader(self._store, keys, FORMAT_VERSION, domain,
                             pack_object=partial(tree_pack_name, domain))
        known = Vetted(() if found.trusted is None else found.trusted.refs(),
                       (r for m in found.candidates for r in m.refs()), reader.read)
        standing = (pinned, found.newest)
        return _Build(found.trusted, known=known), \
            None if pinned is None else pinned.snapshot, standing

    def _latest_manifest(self, domain: str, tree: str) -> TreeManifest | None:
        latest = self.latest(tree, domain)
        return None if latest is None else self.manifest(tree, latest, domain)

    def _commit(self, manifest: TreeManifest, keys: RunKeys, store: _Counting,
                pointer_required: bool = True) -> str:
        """The manifest, then the latest pointer. In a shared tree the pointer is a hint
        (a grantee cannot replace another's where the store keeps owners): a stager there
        reads the snapshots it lists, never the pointer, and a reader the pins."""
        name = snapshot_name(manifest.tree, manifest.snapshot)
        if self._store.exists(name):
            raise ImmutableSnapshot(name)
        sealed = seal(keys.data_key, Kind.MANIFEST, self._random_bytes(SALT_SIZE),
                      tree_to_payload(manifest), name)
        store.put(name, sealed)
        try:
            self.point_latest(manifest.tree, manifest.snapshot, keys, store)
        except (CkptError, OSError):
            if pointer_required:
                raise
        return hashlib.sha256(sealed).hexdigest()

    def point_latest(self, tree: str, snapshot: int, keys: RunKeys,
                     store: Store | None = None) -> None:
        """Name `snapshot` as the tree's newest, sealed under `keys` (its domain's)."""
        latest = tree_latest_name(tree)
        pointer = json.dumps({"format": LATEST_FORMAT, "tree": tree,
                              "snapshot": snapshot}).encode()
        (store or self._store).put(latest, seal(keys.data_key, Kind.LATEST,
                                                self._random_bytes(SALT_SIZE), pointer, latest))

    def domain_keys(self, domain: str) -> RunKeys:
        """The key this store's trees of `domain` are sealed under now."""
        return self._keys.ring(domain).current


def _shares(keys: RunKeys, chunking: CdcParams, domain: str, manifest: TreeManifest) -> bool:
    """Whether a new snapshot may reference `manifest`'s chunks: sealed under the key it
    is written under (§11.2), in its domain, cut the same way."""
    return (manifest.key == keys.fingerprint and manifest.domain == domain
            and manifest.chunking == chunking)


class _Build:
    """The entries of a snapshot as the walk finds them, and their chunks' slots."""

    def __init__(self, parent: TreeManifest | None, others: Sequence[TreeManifest] = (),
                 known: dict[str, ChunkRef] | None = None):
        self.known = known if known is not None else {
            r.id: r for m in (*others, *([parent] if parent else ())) for r in m.refs()}
        self._previous = {} if parent is None else {e.path: e for e in parent.entries}
        self._entries: list[tuple[TreeEntry, list[int]]] = []
        self._skipped: list[str] = []
        self.files_read = self.bytes_read = self.files_reused = self.bytes_reused = 0
        self.watching = self._require_public = False
        self._source = ""
        self.private: str | None = None

    def watch(self, require: bool, watch: bool, source: str) -> None:
        """Judge every entry by slurm_geo.stage.public; with `require`, stop at the first
        one not every user may read (before reading it)."""
        self._require_public, self.watching, self._source = require, watch or require, source

    def add(self, found: Found, writer: ChunkWriter, options: WriteOptions) -> None:
        info = found.info
        if self.watching and self.private is None:
            why = entry_private(found.kind, info.st_mode, found.acl)
            if why is not None:
                self.private = f"{found.path}: {why}"
                if self._require_public:
                    raise NotPublic(self._source, f"{self.private}; not every user may read "
                                    "it, so it is staged in its owner's domain only")
        if found.kind == OTHER:
            self._skipped.append(found.path)
        elif found.kind == SYMLINK:
            assert found.target is not None
            self._entries.append((TreeEntry(found.path, SYMLINK, LINK_MODE, info.st_mtime_ns,
                                            target=found.target), []))
        elif found.kind == DIR:
            self._entries.append((TreeEntry(found.path, DIR, keep_mode(info.st_mode),
                                            info.st_mtime_ns), []))
        else:
            self._entries.append(self._file(found, writer, options))

    def _file(self, found: Found, writer: ChunkWriter, options: WriteOptions
              ) -> tuple[TreeEntry, list[int]]:
        info, fd = found.info, found.fd
        assert fd is not None
        entry = TreeEntry(found.path, FILE, keep_mode(info.st_mode), info.st_mtime_ns,
                          info.st_size, ino=info.st_ino, ctime_ns=info.st_ctime_ns)
        before = self._previous.get(found.path)
        if before is not None and entry.unchanged_as(before):
            self.files_reused += 1
            self.bytes_reused += before.size
            return replace(entry, chunks=before.chunks), [writer.reuse(r) for r in before.chunks]
        slots, size = [], 0
        for chunk in stream_chunks(partial(os.read, fd), options.cdc):
            slots.append(writer.add(memoryview(chunk), 1))
            size += len(chunk)
        self.files_read += 1
        self.bytes_read += size
        return replace(entry, size=size), slots  # what was read, if it changed meanwhile

    def entries(self, writer: ChunkWriter) -> tuple[TreeEntry, ...]:
        return tuple(replace(entry, chunks=tuple(map(writer.ref, slots))) if entry.type == FILE
                     else entry for entry, slots in self._entries)

    def staged(self, manifest: TreeManifest, new: bool, stored: int) -> Staged:
        vetted = self.known if isinstance(self.known, Vetted) else None
        return Staged(manifest, new, stored, self.files_read, self.bytes_read,
                      self.files_reused, self.bytes_reused, tuple(self._skipped),
                      self.private, None if not self.watching else self.private is None,
                      0 if vetted is None else vetted.read_back,
                      0 if vetted is None else vetted.refused)
