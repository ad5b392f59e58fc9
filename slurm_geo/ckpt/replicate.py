"""Copy a checkpoint between stores as it is: ciphertext in, ciphertext out.

The order of docs/format.md §8 holds at the destination: the run's key, then the packs the
destination lacks, then the manifest (the commit point), then the latest pointer (only if
it moves forward, and never one root or the daemons would make in a shared store: that is
the run owner's). A copy cut anywhere leaves the destination's previous checkpoint
intact; a repeated copy uploads only what is still missing.

The packs may go `streams` at once (slurm_geo.ckpt.transfer_plan: enough to fill a link
with latency); the manifest still waits for every one of them, and a failed pack stops
the packs not yet started and is raised before the manifest is touched.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from slurm_geo.ckpt.errors import UnsafeStoreDirectory
from slurm_geo.ckpt.fence import FenceLookup, check_admitted, read_fence
from slurm_geo.ckpt.manifest import Manifest, with_bases
from slurm_geo.ckpt.names import manifest_name
from slurm_geo.ckpt.parallel import run_all
from slurm_geo.ckpt.repository import Repository
from slurm_geo.ckpt.runkey import carry_run_keys
from slurm_geo.ckpt.store import Store, leaves_pointers_to_owners


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


def copy_checkpoint(source: Repository, source_store: Store, destination: Store, run: str,
                    step: int, on_pack: Callable[[int, int], None] = lambda _i, _n: None,
                    fence: FenceLookup = read_fence, streams: int = 1,
                    on_bytes: Callable[[int, int], None] = lambda _d, _t: None) -> CopyReport:
    """Copy `run@step`, up to `streams` packs at once; `on_pack(done, total)` and
    `on_bytes(done, total)` are called in the calling thread after each pack is handled.
    `fence` reads the destination's fence (by default the store's own, strictly). With
    `streams` above 1 the stores are used from several threads at once."""
    manifest = source.manifest(run, step)  # opens and validates: never copy a bad manifest
    extents = pack_extents(manifest)
    packs = sorted(extents)
    carry_run_keys(source, destination, run)
    done = itertools.count(1)
    tally = _ByteTally(extents, on_bytes)

    def handled(name: str, moved: int | None) -> None:
        on_pack(next(done), len(packs))
        tally.handled(name, moved)
    moved = run_all(lambda name: copy_if_missing(source_store, destination, name), packs,
                    streams, on_done=handled)
    copied = [size for size in moved if size is not None]
    # Checked last, right before the commit point: a fence set during the copy still holds.
    check_admitted(Repository(destination, source.master_keys), manifest, fence)
    copy_object(source_store, destination, manifest_name(run, step))
    replica = Repository(destination, source.master_keys)
    pointed = replica.pointer(run)
    latest_left = (pointed is None or pointed < step) and \
        not _point_forward(replica, destination, run, step)
    return CopyReport(run, step, len(copied), len(packs) - len(copied), sum(copied),
                      latest_left)


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
