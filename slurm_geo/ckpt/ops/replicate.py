"""Copy a checkpoint between stores as it is: ciphertext in, ciphertext out, verified as
it is written.

The order of docs/format.md §8 holds at the destination: the run's key, then the packs the
destination lacks, then the manifest (the commit point), then the latest pointer (only if
it moves forward, and never one root or the daemons would make in a shared store: that is
the run owner's). A copy cut anywhere leaves the destination's previous checkpoint
intact; a repeated copy uploads only what is still missing.

Verified as written (docs/checkpoint-sync.md, "What verified proves"): each pack read from
the source is hashed against its name (BLAKE3, the writer's own hash of it) before it is
sent, the manifest sent is the one that opened, and every object put is then compared
with the digest the destination keeps of it (slurm_geo.ckpt.stores.digests: S3's server-checked
SHA-256 from a HEAD, a local file hashed where it lies). A pack the destination holds
already counts when its digest there equals the source's (or that of the source's bytes);
one whose digest differs is put again. Nothing is read back.

The packs may go `streams` at once (slurm_geo.ckpt.stores.transfer_plan: enough to fill a link
with latency); the manifest still waits for every one of them, and a failed pack stops
the packs not yet started and is raised before the manifest is touched.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from slurm_geo.ckpt.errors import CorruptObject, ObjectMissing, UnsafeStoreDirectory
from slurm_geo.ckpt.format.manifest import Manifest, with_bases
from slurm_geo.ckpt.format.names import key_name, manifest_name, pack_id_of_name
from slurm_geo.ckpt.format.pack import check_pack_id
from slurm_geo.ckpt.repo.fence import FenceLookup, check_admitted, read_fence
from slurm_geo.ckpt.repo.repository import Repository
from slurm_geo.ckpt.repo.runkey import carry_run_keys
from slurm_geo.ckpt.stores.digests import CheckedWrites, expected_digest, stored_digest
from slurm_geo.ckpt.stores.parallel import run_all
from slurm_geo.ckpt.stores.store import Store, leaves_pointers_to_owners


class DamagedAtSource(CorruptObject):
    """A pack of the checkpoint being copied does not hash to its name where it is read
    from: the checkpoint is damaged at its source, and nothing of it is sent."""

    def __init__(self, name: str):
        super().__init__(name, "at the source: its content does not match its name, "
                         "altered or truncated; nothing of it was sent")


@dataclass(frozen=True)
class CopyReport:
    run: str
    step: int
    packs_copied: int
    packs_present: int
    bytes_copied: int
    # The destination's latest pointer is the run owner's to write: theirs already, in a
    # sticky shared directory only they may replace, or in a shared store the copy's
    # writer (root, the daemons) must neither make nor replace, or the owner's job could
    # never replace it after. Left as it was: a resume names its step.
    latest_left: bool = False
    # Each object the checkpoint needs at the destination (the run's key, its packs, its
    # manifest) and its size there; the bytes read back to check objects a destination
    # keeps no digest of (0 where it keeps them); the manifest's digest there; its creation.
    objects: dict[str, int] = field(default_factory=dict)
    bytes_read_back: int = 0
    manifest_digest: str = ""
    manifest_sha256: str = ""  # hex, of the sealed manifest
    created_at: str = ""


def copy_checkpoint(source: Repository, source_store: Store, destination: Store, run: str,
                    step: int, on_pack: Callable[[int, int], None] = lambda _i, _n: None,
                    fence: FenceLookup = read_fence, streams: int = 1,
                    on_bytes: Callable[[int, int], None] = lambda _d, _t: None) -> CopyReport:
    """Copy `run@step`, up to `streams` packs at once; `on_pack(done, total)` and
    `on_bytes(done, total)` are called in the calling thread after each pack is handled.
    `fence` reads the destination's fence (by default the store's own, strictly). With
    `streams` above 1 the stores are used from several threads at once."""
    name = manifest_name(run, step)
    sealed = source_store.get(name)
    manifest = source.open_manifest(run, step, sealed)  # never copy a bad manifest
    extents = pack_extents(manifest)
    packs = sorted(extents)
    checked = CheckedWrites(destination)
    carry_run_keys(source, checked, run)
    done = itertools.count(1)
    tally = _ByteTally(extents, on_bytes)

    def handled(pack: str, moved: int | None) -> None:
        on_pack(next(done), len(packs))
        tally.handled(pack, moved)
    moved = run_all(lambda pack: copy_pack(source_store, checked, pack), packs,
                    streams, on_done=handled)
    copied = [size for size in moved if size is not None]
    # Checked last, right before the commit point: a fence set during the copy still holds.
    replica = source.on(destination)
    check_admitted(replica, manifest, fence)
    checked.put(name, sealed)
    pointed = replica.pointer(run)
    latest_left = (pointed is None or pointed < step) and \
        not _point_forward(replica, destination, run, step)
    return CopyReport(run, step, len(copied), len(packs) - len(copied), sum(copied),
                      latest_left, objects=sizes_of(destination, needed_objects(manifest)),
                      bytes_read_back=checked.bytes_read_back,
                      manifest_digest=checked.written[name][1],
                      manifest_sha256=hashlib.sha256(sealed).hexdigest(),
                      created_at=manifest.metadata.created_at)


def needed_objects(manifest: Manifest) -> list[str]:
    """Every object a resume from `manifest` reads: the run's key, packs, the manifest."""
    return [key_name(manifest.run), *sorted(pack_extents(manifest)),
            manifest_name(manifest.run, manifest.step)]


def sizes_of(store: Store, names: Iterable[str]) -> dict[str, int]:
    """The size of each of `names` in `store` (absent where missing), from one listing per
    directory they are in: a presence check that reads no object."""
    wanted = sorted(set(names))
    listed: dict[str, int] = {}
    for directory in sorted({n.rpartition("/")[0] + "/" for n in wanted}):
        listed.update(store.sizes(directory))
    return {n: listed[n] for n in wanted if n in listed}


def pack_extents(manifest: Manifest) -> dict[str, int]:
    """Each pack the checkpoint reads (delta bases included), by object name, and how far
    into it the checkpoint reads: its size, unless later entries belong to others."""
    extents: dict[str, int] = {}
    for ref in with_bases(manifest.refs()):
        name = manifest.pack_object(ref.pack)
        extents[name] = max(extents.get(name, 0), ref.offset + ref.length)
    return extents


class _ByteTally:
    """The bytes of a copy, as `on_bytes(done, total)`: the total starts as the packs'
    extents and becomes exact as each copied pack's size is known; a pack the destination
    has already counts as done at its extent."""

    def __init__(self, extents: dict[str, int], on_bytes: Callable[[int, int], None]):
        self._extents, self._on_bytes = extents, on_bytes
        self._done, self._total = 0, sum(extents.values())

    def handled(self, name: str, moved: int | None) -> None:
        size = self._extents[name] if moved is None else moved
        self._total += size - self._extents[name]
        self._done += size
        self._on_bytes(self._done, self._total)


def copy_pack(source: Store, destination: CheckedWrites, name: str) -> int | None:
    """Pack `name` at the destination, verified (see the module's docstring): the bytes
    copied, or None when the destination holds it already. A source pack whose bytes do
    not hash to its name raises DamagedAtSource, and nothing is sent."""
    pack_id = pack_id_of_name(name)
    try:
        held = stored_digest(destination, name)
    except ObjectMissing:
        held, there = None, False
    else:
        there = True
        if held is not None and held == stored_digest(source, name):
            return None
        if held is None and pack_id is not None:  # a store that keeps no digests
            try:
                destination.check_by_reading(name, lambda data: _hashes_to(name, data))
                return None
            except ObjectMissing:
                there = False  # a store without digests cannot tell a missing object
            except CorruptObject:
                pass  # damaged there: put again
    data = source.get(name)
    if pack_id is not None and not _hashes_to(name, data):
        raise DamagedAtSource(name)
    if there and held is not None and held == expected_digest(destination, data):
        return None
    destination.put(name, data)  # missing, damaged there, or of another form of digest
    return len(data)


def _hashes_to(name: str, data: bytes) -> bool:
    try:
        check_pack_id(name, pack_id_of_name(name) or "", data)
    except CorruptObject:
        return False
    return True


def copy_if_missing(source: Store, destination: Store, name: str) -> int | None:
    """The bytes copied; None when the destination has the object already."""
    return None if destination.exists(name) else copy_object(source, destination, name)


def copy_object(source: Store, destination: Store, name: str) -> int:
    """Object `name`, as its bytes are, from `source` to `destination`; the bytes copied."""
    data = source.get(name)
    destination.put(name, data)
    return len(data)


def _point_forward(replica: Repository, destination: Store, run: str, step: int) -> bool:
    """Name `step` the run's latest at the destination; False where that is left to the
    run's owner (root would even take over the owner's own pointer)."""
    if leaves_pointers_to_owners(destination):
        return False
    try:
        replica.point_latest(run, step)
    except UnsafeStoreDirectory:
        return False
    return True
