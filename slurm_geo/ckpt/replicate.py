"""Copy a checkpoint between stores as it is: ciphertext in, ciphertext out.

The order of docs/format.md §8 holds at the destination: the run's key, then the packs the
destination lacks, then the manifest (the commit point), then the latest pointer (only if
it moves forward). A copy cut anywhere leaves the destination's previous checkpoint
intact; a repeated copy uploads only what is still missing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from slurm_geo.ckpt.fence import FenceLookup, check_admitted, read_fence
from slurm_geo.ckpt.manifest import with_bases
from slurm_geo.ckpt.names import key_name, manifest_name, pack_name
from slurm_geo.ckpt.repository import Repository
from slurm_geo.ckpt.store import Store


@dataclass(frozen=True)
class CopyReport:
    run: str
    step: int
    packs_copied: int
    packs_present: int
    bytes_copied: int


def copy_checkpoint(source: Repository, source_store: Store, destination: Store, run: str,
                    step: int, on_pack: Callable[[int, int], None] = lambda _i, _n: None,
                    fence: FenceLookup = read_fence) -> CopyReport:
    """Copy `run@step`; `on_pack(done, total)` is called after each pack is handled.
    `fence` reads the destination's fence (by default the store's own, strictly)."""
    manifest = source.manifest(run, step)  # opens and validates: never copy a bad manifest
    packs = sorted({pack_name(r.pack) for r in with_bases(manifest.refs())})
    copied = present = moved = 0
    if not destination.exists(key_name(run)):
        _copy(source_store, destination, key_name(run))
    for done, name in enumerate(packs, 1):
        if destination.exists(name):
            present += 1
        else:
            moved += _copy(source_store, destination, name)
            copied += 1
        on_pack(done, len(packs))
    # Checked last, right before the commit point: a fence set during the copy still holds.
    check_admitted(Repository(destination, source.master_keys), manifest, fence)
    _copy(source_store, destination, manifest_name(run, step))
    if _destination_latest(source, destination, run) < step:
        _copy_latest_naming(source, destination, run, step)
    return CopyReport(run, step, copied, present, moved)


def _copy(source: Store, destination: Store, name: str) -> int:
    data = source.get(name)
    destination.put(name, data)
    return len(data)


def _destination_latest(source: Repository, destination: Store, run: str) -> int:
    """The step the destination's pointer names; -1 when it has none."""
    step = Repository(destination, source.master_keys).pointer(run)
    return -1 if step is None else step


def _copy_latest_naming(source: Repository, destination: Store, run: str, step: int) -> None:
    Repository(destination, source.master_keys).point_latest(run, step)
