"""Checking a whole store, as `restic check` does (docs/stores.md, "Checking a store").

Every run's wrapped key, latest pointer and manifests must open and parse, every
promotion marker must open under the promotion key and mark a checkpoint there, and every pack
a manifest references (delta bases included) must be listed at least as long as the last
entry read from it. With a `PackSelection` the chosen packs are also read, each once
however many checkpoints share it: its hash is checked, then every chunk stored in it that
a manifest references is decrypted, decoded and verified against its id. A chunk stored in
several packs (ranks of a multi-rank save each store their own copy, §7.5) is checked in
every one. Each damaged object is reported once, with the checkpoints that cannot be read
whole because of it.

A store that cannot be reached is not damage: its `StoreUnavailable` is raised.
"""

from __future__ import annotations

import random as _random
import re
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from slurm_geo.ckpt.errors import (
    CkptError,
    CorruptObject,
    ObjectMissing,
    StoreUnavailable,
    UnsafeObjectName,
)
from slurm_geo.ckpt.format.keys import MasterKeys
from slurm_geo.ckpt.format.manifest import ChunkRef, Manifest, with_bases
from slurm_geo.ckpt.format.names import (
    key_name,
    latest_name,
    manifest_name,
    pack_id_of_name,
    step_of_manifest_name,
)
from slurm_geo.ckpt.ops.usage import pack_sizes
from slurm_geo.ckpt.repo.reader import ChunkReader, ordered_map, worker_pool
from slurm_geo.ckpt.repo.repository import Repository
from slurm_geo.ckpt.stores.open_store import paced
from slurm_geo.ckpt.stores.parallel import run_all
from slurm_geo.ckpt.stores.store import LocalDirStore, Store
from slurm_geo.errors import ConfigError

# Delta bases mostly sit in the previous checkpoint's packs, checked just before: a
# checkpoint's worth of 16 MiB packs kept lets its successor's deltas find them there. A
# local store's bases are read by ranges instead (peak RSS of a check of 1 GB: 420-490 MB
# with these packs kept).
CHECK_CACHED_PACKS = 16
_SUBSET = re.compile(r"(?:(?P<percent>\d+(?:\.\d+)?)%|(?P<group>\d+)/(?P<groups>\d+))")


@dataclass(frozen=True)
class PackSelection:
    """Which packs to read: a `percent` chosen at random each time, or group `group` of
    `groups` (1-based), chosen by pack id, the same every time (restic's n/t)."""

    percent: float = 100.0
    group: int = 0
    groups: int = 0

    def choose(self, pack_ids: Sequence[str], random: _random.Random) -> list[str]:
        """The chosen packs (ids, or their object names), in the order given."""
        if self.groups:
            return [p for p in pack_ids
                    if int(_pack_id(p)[:8], 16) % self.groups == self.group - 1]
        if self.percent >= 100:
            return list(pack_ids)
        count = min(len(pack_ids), max(1, round(len(pack_ids) * self.percent / 100)))
        chosen = set(random.sample(range(len(pack_ids)), count)) if pack_ids else set()
        return [p for i, p in enumerate(pack_ids) if i in chosen]


READ_ALL = PackSelection()


def parse_subset(text: str) -> PackSelection:
    """`P%` (0 < P <= 100) or `n/t` (1 <= n <= t); ConfigError naming the value else."""
    match = _SUBSET.fullmatch(text.strip())
    if match and match["percent"] and 0 < float(match["percent"]) <= 100:
        return PackSelection(percent=float(match["percent"]))
    if match and match["group"] and 1 <= int(match["group"]) <= int(match["groups"]):
        return PackSelection(group=int(match["group"]), groups=int(match["groups"]))
    raise ConfigError(f"--read-data-subset {text!r}: give a percentage of the packs "
                      "(0 < P <= 100, e.g. 10%) or a group n/t of t (e.g. 1/5)")


@dataclass(frozen=True)
class Damage:
    object: str
    error: str
    checkpoints: tuple[str, ...]  # run@step, each a checkpoint that cannot be read whole


@dataclass(frozen=True)
class CheckReport:
    runs: int
    checkpoints: int
    packs: int              # referenced by some manifest
    unreferenced_packs: int  # garbage for `ckpt gc`, not damage
    packs_read: int
    bytes_read: int
    seconds: float
    damage: tuple[Damage, ...]

    @property
    def ok(self) -> bool:
        return not self.damage

    @property
    def affected(self) -> list[str]:
        return sorted({c for d in self.damage for c in d.checkpoints}, key=_checkpoint_order)


class _Use(NamedTuple):
    """A stored chunk as some checkpoints name it, and how its id is checked."""

    run: str
    format: int
    ref: ChunkRef
    key: bytes | None  # the fingerprint of the run key its manifest (and pack) is under


class _Inventory:
    """What the manifests say: checkpoints, and per pack (by object name: where its
    manifest's format places it) the chunks read from it and the checkpoints that need it."""

    def __init__(self) -> None:
        self.checkpoints: list[tuple[str, int]] = []
        self.pack_order: dict[str, None] = {}  # first needed first: bases before deltas
        self.uses: dict[str, set[_Use]] = defaultdict(set)
        self.needed_by: dict[str, set[str]] = defaultdict(set)
        self.damage: dict[str, Damage] = {}

    def add(self, manifest: Manifest) -> None:
        where = f"{manifest.run}@{manifest.step}"
        for ref in with_bases(manifest.refs()):
            name = manifest.pack_object(ref.pack)
            self.pack_order.setdefault(name)
            self.uses[name].add(_Use(manifest.run, manifest.format, ref, manifest.key))
            self.needed_by[name].add(where)

    def found(self, name: str, error: CkptError, checkpoints: Iterable[str]) -> None:
        if isinstance(error, StoreUnavailable):
            raise error
        if name not in self.damage:
            self.damage[name] = Damage(name, str(error), tuple(sorted(
                set(checkpoints), key=_checkpoint_order)))


def check_store(store: Store, master_keys: bytes | MasterKeys,
                read: PackSelection | None = None, *, threads: int = 0,
                random: _random.Random | None = None,
                monotonic: Callable[[], float] = time.monotonic,
                on_manifests: Callable[[int, int], None] = lambda _d, _t: None,
                on_bytes: Callable[[int, int], None] = lambda _d, _t: None) -> CheckReport:
    """Check every run in `store`; read the packs `read` selects (none when None).
    `on_manifests(done, total)` follows the manifests opened, run by run; then
    `on_bytes(done, total)` the bytes of the packs read."""
    started = monotonic()
    counted = paced(store, "store")
    repository = Repository(counted, master_keys)
    workers = threads or repository.options.threads
    inventory = _Inventory()
    runs = repository.runs()
    steps = {run: repository.steps(run) for run in runs}
    opened, manifests = 0, sum(map(len, steps.values()))
    # Manifests before the pack listing: a pack is put before any manifest naming it.
    for run in runs:
        _check_run(repository, run, steps[run], inventory, workers)
        opened += len(steps[run])
        on_manifests(opened, manifests)
    _check_markers(repository, counted.list("promoted/"), steps, inventory)
    sizes = pack_sizes(counted)
    present = [p for p in inventory.pack_order if _check_size(p, sizes, inventory)]
    referenced = set(inventory.pack_order)
    chosen = [] if read is None else read.choose(present, random or _random.Random())
    if chosen:
        read_bytes, total = 0, sum(sizes[p] for p in chosen)

        def pack_read(name: str) -> None:
            nonlocal read_bytes
            read_bytes += sizes[name]
            on_bytes(read_bytes, total)
        local = store if isinstance(store, LocalDirStore) else None
        _read_packs(repository, counted, chosen, inventory, workers, pack_read, local)
    return CheckReport(
        runs=len(runs), checkpoints=len(inventory.checkpoints), packs=len(referenced),
        unreferenced_packs=len(set(sizes) - referenced), packs_read=len(chosen),
        bytes_read=counted.bytes_read, seconds=monotonic() - started,
        damage=tuple(sorted(inventory.damage.values(), key=lambda d: d.object)))


def _check_run(repository: Repository, run: str, steps: list[int], inventory: _Inventory,
               workers: int) -> None:
    every = [f"{run}@{step}" for step in steps]
    inventory.checkpoints += [(run, step) for step in steps]
    try:
        repository.run_keys(run)
    except CkptError as exc:
        inventory.found(key_name(run), exc, every)
        return
    opened = run_all(lambda step: _manifest(repository, run, step), steps, workers)
    for step, manifest in zip(steps, opened, strict=True):
        if isinstance(manifest, CkptError):
            inventory.found(manifest_name(run, step), manifest, [f"{run}@{step}"])
        else:
            inventory.add(manifest)
    try:
        pointed = repository.pointer(run)
    except CkptError as exc:
        inventory.found(latest_name(run), exc, [])
        return
    if pointed is not None and pointed not in steps:
        inventory.found(latest_name(run), CorruptObject(
            latest_name(run), f"names step {pointed}, which has no manifest"), [])


def _check_markers(repository: Repository, names: list[str], steps: dict[str, list[int]],
                   inventory: _Inventory) -> None:
    """Every promotion marker must open under the promotion key, name its own checkpoint
    (docs/format.md §8.1) and mark one that exists: one that does not protects nothing,
    so retention may delete what was meant to be kept."""
    for name in names:
        marked = marker_checkpoint(name)
        if marked is None:
            inventory.found(name, CorruptObject(name, "not a promotion marker's name "
                                                "(promoted/<run>/<20-digit step>)"), [])
            continue
        run, step = marked
        try:
            repository.is_promoted(run, step)
        except StoreUnavailable:
            raise
        except CkptError as exc:
            inventory.found(name, exc, [f"{run}@{step}"])
            continue
        if step not in steps.get(run, ()):
            inventory.found(name, CorruptObject(
                name, f"promotes {run}@{step}, which has no manifest: the checkpoint it kept "
                "is gone"), [])


def marker_checkpoint(name: str) -> tuple[str, int] | None:
    """The (run, step) a name under `promoted/` stands for, or None."""
    parts = name.split("/")
    if len(parts) != 3 or parts[0] != "promoted":
        return None
    try:
        step = step_of_manifest_name(parts[1], f"manifests/{parts[1]}/{parts[2]}")
    except UnsafeObjectName:
        return None
    return None if step is None else (parts[1], step)


def _manifest(repository: Repository, run: str, step: int) -> Manifest | CkptError:
    try:
        return repository.manifest(run, step)
    except StoreUnavailable:
        raise
    except CkptError as exc:
        return exc


def _check_size(name: str, sizes: dict[str, int], inventory: _Inventory) -> bool:
    """Whether the pack is listed, long enough for every entry read from it."""
    needs = max(u.ref.offset + u.ref.length for u in inventory.uses[name])
    if name not in sizes:
        inventory.found(name, ObjectMissing(name), inventory.needed_by[name])
        return False
    if sizes[name] < needs:
        inventory.found(name, CorruptObject(
            name, f"truncated: {sizes[name]} bytes, its entries reach byte {needs}"),
            inventory.needed_by[name])
        return False
    return True


def _pack_id(name: str) -> str:
    """The pack id of a pack's object name (or of a bare id)."""
    return pack_id_of_name(name) or name


def _read_packs(repository: Repository, store: Store, chosen: list[str],
                inventory: _Inventory, workers: int, on_read: Callable[[str], None],
                local: LocalDirStore | None) -> None:
    """Each chosen pack (by object name) read once, on `workers` threads, a few packs in
    flight; `on_read(name)` as each one is done with. `local`: the local store `store` wraps,
    if it is one, from which delta bases are read by ranges."""
    readers: dict[tuple[str, int, bytes | None], ChunkReader] = {}
    last_use: dict[tuple[str, int, bytes | None], int] = {}
    for index, name in enumerate(chosen):
        for use in inventory.uses[name]:
            key = (use.run, use.format, use.key)
            if key not in readers:
                ring = repository.run_keys(use.run)
                keys = ring.current if use.key is None else ring.sealed_under(use.key, name)
                readers[key] = ChunkReader(store, keys, use.format, use.run,
                                           CHECK_CACHED_PACKS, ranges_from=local)
            last_use[key] = index

    def check(name: str) -> list[CkptError]:
        try:
            data = store.get(name)
        except StoreUnavailable:
            raise
        except CkptError as exc:
            return [exc]
        by_reader: dict[tuple[str, int, bytes | None], list[ChunkRef]] = defaultdict(list)
        for use in inventory.uses[name]:
            by_reader[(use.run, use.format, use.key)].append(use.ref)
        faults = []
        for key, refs in by_reader.items():
            faults += readers[key].check_pack(_pack_id(name), data,
                                              sorted(refs, key=_by_offset))
        return faults

    with worker_pool(workers, "slurm-geo-check") as pool:
        checked = ordered_map(check, chosen, pool, workers + 1)
        for index, (name, faults) in enumerate(zip(chosen, checked, strict=True)):
            for fault in faults:
                # A delta's base may lie in another pack: the fault names that pack.
                pack = fault.name if fault.name in inventory.needed_by else name
                inventory.found(fault.name, fault, inventory.needed_by.get(pack, ()))
            on_read(name)
            for key in [k for k, last in last_use.items() if last == index]:
                del readers[key]  # its run is done: let its cached packs go


def _by_offset(ref: ChunkRef) -> int:
    return ref.offset


def _checkpoint_order(name: str) -> tuple[str, int]:
    run, _, step = name.rpartition("@")
    return run, int(step)
