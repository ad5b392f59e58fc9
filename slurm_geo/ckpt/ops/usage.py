"""What checkpoints cost in a store, from their manifests (`slurm-geo ckpt ls` and `stats`).

Pure functions over manifests and a pack listing; no pack is read. The words, exactly:

- A checkpoint's **logical bytes** are those of its tensors and its extra state: what a
  pull writes out.
- A **stored copy** is one entry of a pack, named by (pack, offset); its bytes are the
  entry's `length` (the encoded, encrypted chunk with its id, length and tag: what the
  pack holds for it). A checkpoint **references** every stored copy its chunk refs name,
  delta bases included (they are read with it), each counted once however often the
  checkpoint names it.
- Its **added bytes** are those of the stored copies it references that no checkpoint of
  the same run with a lower step references: what it cost the store on top of the ones
  before it, as they stand now (a pruned predecessor's chunks count for the first
  survivor that still uses them).
- Its **dedup ratio** is logical / added: how many bytes of checkpoint each stored byte
  carries, counting compression, deltas and chunks shared with earlier checkpoints
  alike. None when it added nothing (every chunk shared with an earlier checkpoint).
- A run's, or the store's, **stored bytes** are those of every stored copy any of its
  checkpoints references, once (for a run: the sum of its checkpoints' added bytes), and
  its ratio is logical / stored. Its **pack bytes** are the sizes of the listed packs
  holding those copies, whole (pack headers, and entries no checkpoint references any
  more, included); the store's also count packs no checkpoint references, which
  `ckpt gc` would delete.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from slurm_geo.ckpt.format.manifest import Manifest, tensor_nbytes, with_bases
from slurm_geo.ckpt.format.names import PACK_PREFIXES
from slurm_geo.ckpt.stores.store import Store

StoredCopy = tuple[str, int]  # (pack object name, offset)


def dedup_ratio(logical: int, stored: int) -> float | None:
    """logical / stored; None when nothing is stored."""
    return logical / stored if stored else None


@dataclass(frozen=True)
class CheckpointUsage:
    run: str
    step: int
    logical_bytes: int
    referenced_bytes: int
    added_bytes: int

    @property
    def dedup_ratio(self) -> float | None:
        return dedup_ratio(self.logical_bytes, self.added_bytes)


@dataclass(frozen=True)
class RunUsage:
    run: str
    checkpoints: int
    logical_bytes: int
    stored_bytes: int
    pack_bytes: int

    @property
    def dedup_ratio(self) -> float | None:
        return dedup_ratio(self.logical_bytes, self.stored_bytes)


@dataclass(frozen=True)
class StoreUsage:
    runs: tuple[RunUsage, ...]
    checkpoints: int
    logical_bytes: int
    stored_bytes: int
    pack_bytes: int
    unreferenced_pack_bytes: int

    @property
    def dedup_ratio(self) -> float | None:
        return dedup_ratio(self.logical_bytes, self.stored_bytes)


def logical_bytes(manifest: Manifest) -> int:
    return (sum(tensor_nbytes(t.dtype, t.shape) for t in manifest.tensors)
            + manifest.extra_state.size)


def stored_copies(manifest: Manifest) -> dict[StoredCopy, int]:
    """Every stored copy the manifest references, delta bases included, and its bytes."""
    return {(manifest.pack_object(ref.pack), ref.offset): ref.length
            for ref in with_bases(manifest.refs())}


def checkpoint_usage(manifests: Iterable[Manifest]) -> list[CheckpointUsage]:
    """One entry per manifest, by run, then step (manifests may come in any order)."""
    usage = []
    for run_manifests in _by_run(manifests).values():
        seen: set[StoredCopy] = set()
        for manifest in run_manifests:
            copies = stored_copies(manifest)
            added = sum(length for copy, length in copies.items() if copy not in seen)
            seen.update(copies)
            usage.append(CheckpointUsage(manifest.run, manifest.step, logical_bytes(manifest),
                                         sum(copies.values()), added))
    return usage


def pack_sizes(store: Store) -> dict[str, int]:
    """Every pack of the store, under either prefix (names.PACK_PREFIXES), and its bytes."""
    return {name: size for prefix in PACK_PREFIXES for name, size in store.sizes(prefix).items()}


def run_usage(manifests: Iterable[Manifest], pack_sizes: Mapping[str, int]) -> list[RunUsage]:
    """One entry per run, sorted; `pack_sizes` is the store's listing of packs (object
    name -> bytes, as `pack_sizes` gives it). A pack missing from it counts 0."""
    return [_run_totals(run, run_manifests, pack_sizes)
            for run, run_manifests in _by_run(manifests).items()]


def store_usage(manifests: Iterable[Manifest], pack_sizes: Mapping[str, int]) -> StoreUsage:
    """Every run of the store, and its totals; `manifests` must be all of the store's."""
    manifests = list(manifests)
    runs = tuple(run_usage(manifests, pack_sizes))
    copies: dict[StoredCopy, int] = {}
    for manifest in manifests:
        copies.update(stored_copies(manifest))
    referenced = {pack for pack, _offset in copies}
    return StoreUsage(
        runs=runs, checkpoints=len(manifests),
        logical_bytes=sum(r.logical_bytes for r in runs), stored_bytes=sum(copies.values()),
        pack_bytes=sum(pack_sizes.values()),
        unreferenced_pack_bytes=sum(size for name, size in pack_sizes.items()
                                    if name not in referenced))


def _run_totals(run: str, manifests: list[Manifest], pack_sizes: Mapping[str, int]
                ) -> RunUsage:
    copies: dict[StoredCopy, int] = {}
    for manifest in manifests:
        copies.update(stored_copies(manifest))
    packs = {pack for pack, _offset in copies}
    return RunUsage(run, len(manifests), sum(map(logical_bytes, manifests)),
                    sum(copies.values()), sum(pack_sizes.get(name, 0) for name in packs))


def _by_run(manifests: Iterable[Manifest]) -> dict[str, list[Manifest]]:
    """Runs sorted, each run's manifests by step."""
    grouped: dict[str, list[Manifest]] = defaultdict(list)
    for manifest in manifests:
        grouped[manifest.run].append(manifest)
    return {run: sorted(grouped[run], key=lambda m: m.step) for run in sorted(grouped)}
