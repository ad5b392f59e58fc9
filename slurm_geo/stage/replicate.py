"""Copying a staged tree's snapshot to another store (docs/format.md §11), the way
`slurm_geo.ckpt.ops.replicate.copy_checkpoint` copies a checkpoint: the domain's key ring
first (sealed under the master key, copied as it is), then the packs the destination
lacks, then the snapshot's manifest (the commit point: a reader finds a snapshot only
once every pack it names is there), then the tree's latest pointer when the destination's
names an older snapshot or none. A copy cut anywhere leaves the destination's snapshots
as they were, and the next copy puts only what is still missing.

Nothing here reads a chunk's plaintext: the objects cross as ciphertext, and the manifest
is opened (with the domain's key) only to list the packs it needs.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from slurm_geo.ckpt.errors import CkptError, StoreUnavailable
from slurm_geo.ckpt.ops.replicate import copy_if_missing, copy_object
from slurm_geo.ckpt.stores.parallel import run_all
from slurm_geo.ckpt.stores.store import Store
from slurm_geo.stage.keys import TreeKeyHolder
from slurm_geo.stage.names import (
    snapshot_name,
    tree_key_name,
    tree_pack_name,
)
from slurm_geo.stage.trees import Trees


@dataclass(frozen=True)
class TreeCopyReport:
    tree: str
    snapshot: int
    packs_copied: int
    packs_present: int
    bytes_copied: int
    latest_moved: bool


def copy_snapshot(source: Trees, source_store: Store, destination: Store,
                  destination_keys: TreeKeyHolder, tree: str, snapshot: int,
                  domain: str | None = None, streams: int = 1,
                  on_pack: Callable[[int, int], None] = lambda _d, _t: None,
                  present: Collection[str] = frozenset()) -> TreeCopyReport:
    """Copy `tree`'s `snapshot` from `source` (read from `source_store`, which may be a
    paced view of the same store) to `destination`, whose own keys open what it holds
    (`destination_keys`: the same domain rings, read there). `present`: pack names a
    listing of the destination just showed, not asked for again one by one (a world
    pass cut by a checkpoint resumes with a listing, not a request per pack)."""
    manifest = source.manifest(tree, snapshot, domain)  # opened and checked: never copy junk
    domain = manifest.domain
    key = tree_key_name(domain)
    if not destination.exists(key):
        copy_object(source_store, destination, key)
    packs = sorted({tree_pack_name(domain, ref.pack) for ref in manifest.refs()})
    done = [0]

    def handled(_name: str, _moved: int | None) -> None:
        done[0] += 1
        on_pack(done[0], len(packs))
    moved = run_all(lambda name: None if name in present
                    else copy_if_missing(source_store, destination, name), packs,
                    streams, on_done=handled)
    copied = [size for size in moved if size is not None]
    name = snapshot_name(tree, snapshot)
    if not destination.exists(name):
        copy_object(source_store, destination, name)
    there = Trees(destination, destination_keys)
    latest_there = _latest_or_none(there, tree, domain)
    latest_moved = latest_there is None or latest_there < snapshot
    if latest_moved:
        there.point_latest(tree, snapshot, source.domain_keys(domain))
    return TreeCopyReport(tree, snapshot, len(copied), len(packs) - len(copied), sum(copied),
                          latest_moved)


def _latest_or_none(trees: Trees, tree: str, domain: str) -> int | None:
    """The destination's latest snapshot of `tree`; None for none, or for a pointer that no
    longer opens (it is replaced by one that does)."""
    try:
        return trees.latest(tree, domain)
    except StoreUnavailable:
        raise
    except CkptError:
        return None
