"""Copying one run's world off-site, and its moved jobs' outputs home (issue 31, items 2
and 6; docs/checkpoint-sync.md, "A run's world").

The home job stages its world into the home store and pins each snapshot in
`worlds/<run>` (docs/format.md §11.8). checkpoint-sync, which holds the master key, copies
from there to its destination, ciphertext only: the run's key ring (as a checkpoint
carries it), then each pinned snapshot (`copy_snapshot`: the domain's key, the missing
packs, the manifest, the latest pointer), each read back whole at the destination and its
manifest checked against the pin; the record itself last, once every snapshot it pins is
there and verified, so that a reader at the destination never finds a record naming a
snapshot that is not. A cut copy resumes with what is missing (packs are put only where
the destination lacks them; a snapshot verified once is not read again).

The other way, a moved incarnation's `outputs/<run>/` objects (slurm_geo.stage.outputs)
come home from the destination: the parts first, the indexes (the commit points) after.

Nothing here decides when: `slurm_geo.sync.worldpass` runs this behind the checkpoints,
with a guard that stops it before its next object when a checkpoint is due or the pass's
byte budget is spent.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from slurm_geo.ckpt.errors import CkptError, CorruptObject, ObjectMissing, StoreUnavailable
from slurm_geo.ckpt.format.keys import MasterKeys, RunKeyRing
from slurm_geo.ckpt.format.pack import check_pack_id
from slurm_geo.ckpt.ops.replicate import copy_object
from slurm_geo.ckpt.repo.repository import Repository
from slurm_geo.ckpt.repo.runkey import carry_run_keys
from slurm_geo.ckpt.stores.store import Bytes, Store
from slurm_geo.stage.keys import MasterTreeKeys
from slurm_geo.stage.names import (
    snapshot_name,
    snapshot_prefix,
    tree_latest_name,
    tree_pack_name,
    tree_packs_prefix,
)
from slurm_geo.stage.record import PinnedTree, WorldRecord, read_world_record, world_record_name
from slurm_geo.stage.replicate import copy_snapshot
from slurm_geo.stage.trees import Trees
from slurm_geo.sync.worldstate import WorldRow

OUTPUTS = "outputs"
INDEX = "/index/"  # outputs/<run>/<incarnation>/index/<n>: the commit points


def pin_label(pin: PinnedTree) -> str:
    """A pin as the state keeps it: a snapshot verified under one manifest digest."""
    return f"{pin.tree}/{pin.snapshot}/{pin.manifest_sha256}"


@dataclass(frozen=True)
class WorldCopy:
    """Where one run's world goes: from `source` (the home store) to `destination`."""

    source: Store
    destination: Store
    master_keys: MasterKeys
    streams: int = 1
    home_writer: Store | None = None  # writes outputs home; None: the source may not be
    # Packs already read back whole at the destination (any run's: a shared dataset's are
    # read once), and what to call as each is, and with the bytes each read took.
    verified_packs: set[str] = field(default_factory=set)
    on_verified: Callable[[str], None] = lambda _name: None
    on_read: Callable[[int], None] = lambda _size: None
    # `domain -> why it may not go to the destination` (slurm_geo.stage.residency.checker);
    # None: not asked (a library copy; checkpoint-sync always asks).
    why_not: Callable[[str], str | None] | None = None
    clock: Callable[[], float] = time.time
    # `domain -> whether its copies at the destination must go` (the residency, read and
    # sound, keeps it out: `ResidencyChecker.forbids`); None: nothing is withdrawn.
    forbids: Callable[[str], bool] | None = None
    on_withdrawn: Callable[[int], None] = lambda _count: None

    def __post_init__(self) -> None:
        if self.home_writer is None and not isinstance(self.source, _NeverWritten):
            object.__setattr__(self, "home_writer", self.source)

    def copy(self, row: WorldRow, progress: Callable[[WorldRow], None]) -> WorldRow:
        """Bring `row`'s outputs home, then copy its world, calling `progress` with the row
        as it stands after each step; the final row. Raises what the stores raise (a
        damaged object at the destination is deleted first, so the next copy replaces it)."""
        row = replace(row, outputs_home=row.outputs_home + self._outputs_home(row.run))
        name = world_record_name(row.run)
        if not self.source.exists(name):
            return replace(row, record_sha256=None, trees=0, verified=(), bytes_total=0,
                           bytes_there=0, complete=False, last_error=None, refused=None,
                           record_seen_at=None)
        sealed = self.source.get(name)
        digest = hashlib.sha256(sealed).hexdigest()
        repository = Repository(self.source, self.master_keys)
        record = _open_record(sealed, repository.run_keys(row.run), row.run)
        seen = row.record_seen_at if digest == row.record_sha256 and \
            row.record_seen_at is not None else self.clock()
        row = replace(row, record_seen_at=seen)
        refused = self._refused(record)
        if refused is not None:
            withdrawn = self._withdraw(row.run, record)
            return replace(row, record_sha256=digest, trees=len(record.trees), verified=(),
                           complete=False, refused=refused,
                           bytes_there=0 if withdrawn else row.bytes_there)
        verified = {label for label in row.verified
                    if label in {pin_label(p) for p in record.trees}}
        row = replace(row, record_sha256=digest, trees=len(record.trees), refused=None,
                      verified=tuple(sorted(verified)),
                      complete=self._record_there(name, sealed) and
                      len(verified) == len(record.trees))
        if row.complete:
            return row
        home = self._trees(self.source)
        total, held, there = self._sizes(home, record)
        row = replace(row, bytes_total=total, bytes_there=held)
        progress(row)
        carry_run_keys(repository, self.destination, row.run)
        for pin in record.trees:
            if pin_label(pin) in verified:
                continue
            _check_pin(self.source, pin, "the home store")
            report = copy_snapshot(home, self.source, self.destination,
                                   MasterTreeKeys(self.destination, self.master_keys),
                                   pin.tree, pin.snapshot, pin.domain, self.streams,
                                   present=there)
            total, held, there = self._sizes(home, record)
            row = replace(row, bytes_copied=row.bytes_copied + report.bytes_copied,
                          bytes_total=total, bytes_there=held)
            progress(row)
            self._verify_there(home, pin)
            verified.add(pin_label(pin))
            row = replace(row, verified=tuple(sorted(verified)))
            progress(row)
        if not self._record_there(name, sealed):
            self.destination.put(name, sealed)
        return replace(row, complete=True)

    # --- the world ----------------------------------------------------------------------

    def _refused(self, record: WorldRecord) -> str | None:
        """Why nothing of the world may go to the destination: the first pinned root whose
        domain's residency keeps it out (a world is copied whole or not at all: a record
        naming a snapshot the destination may not hold is of no use there)."""
        if self.why_not is None:
            return None
        for pin in record.trees:
            why = self.why_not(pin.domain)
            if why is not None:
                return f"{pin.what} {pin.path}: {why}"
        return None

    def _withdraw(self, run: str, record: WorldRecord) -> int:
        """Remove what the destination holds of each pinned root whose domain it may no
        longer hold (its residency was narrowed after the copy): the run's record there
        first (no reader finds it naming what is going), then the tree's snapshots and
        pointer (the commit points), then the domain's packs. The count removed."""
        if self.forbids is None:
            return 0
        names: list[str] = []
        for pin in record.trees:
            if self.forbids(pin.domain):
                for tree in dict.fromkeys((pin.tree, pin.domain)):
                    names += self.destination.list(snapshot_prefix(tree))
                    names += self._present(tree_latest_name(tree))
                names += self.destination.list(tree_packs_prefix(pin.domain))
        if not names:
            return 0
        names = [*self._present(world_record_name(run)), *dict.fromkeys(names)]
        for name in names:
            self.destination.delete(name)
            self.verified_packs.discard(name)
        self.on_withdrawn(len(names))
        return len(names)

    def _present(self, name: str) -> list[str]:
        return [name] if self.destination.exists(name) else []

    def _trees(self, store: Store) -> Trees:
        return Trees(store, MasterTreeKeys(store, self.master_keys))

    def _record_there(self, name: str, sealed: bytes) -> bool:
        try:
            return self.destination.get(name) == sealed
        except ObjectMissing:
            return False

    def _sizes(self, home: Trees, record: WorldRecord) -> tuple[int, int, set[str]]:
        """The pack bytes of the pinned snapshots at home, those the destination has, and
        the names of those it has."""
        needed: dict[str, set[str]] = {}
        for pin in record.trees:
            manifest = home.manifest(pin.tree, pin.snapshot, pin.domain)
            needed.setdefault(pin.domain, set()).update(
                tree_pack_name(pin.domain, ref.pack) for ref in manifest.refs())
        total = there = 0
        held: set[str] = set()
        for domain, names in needed.items():
            at_home = self.source.sizes(tree_packs_prefix(domain))
            at_destination = self.destination.sizes(tree_packs_prefix(domain))
            total += sum(at_home.get(n, 0) for n in names)
            there += sum(at_home.get(n, 0) for n in names if n in at_destination)
            held.update(n for n in names if n in at_destination)
        return total, there, held

    def _verify_there(self, home: Trees, pin: PinnedTree) -> None:
        """Check the snapshot at the destination: its manifest hashes to the pin, and each
        of its packs not read back yet is read whole and hashes to its name (so it is the
        pack staging wrote at home, bit for bit; a reader there checks every chunk against
        its id again). A damaged pack or manifest is deleted there (the next copy puts a
        good one) and raised. Packs are read one by one, each remembered once sound, so a
        pass cut short (a checkpoint due) does not read them again."""
        manifest = home.manifest(pin.tree, pin.snapshot, pin.domain)
        names = sorted({tree_pack_name(pin.domain, ref.pack) for ref in manifest.refs()})
        try:
            _check_pin(self.destination, pin, "the destination")
            for name in names:
                if name in self.verified_packs:
                    continue
                data = self.destination.get(name)
                self.on_read(len(data))
                check_pack_id(name, name.rpartition("/")[2], data)
                self.verified_packs.add(name)
                self.on_verified(name)
        except StoreUnavailable:
            raise
        except CorruptObject as exc:
            if exc.name.startswith(("tree-packs/", "trees/")):
                self.destination.delete(exc.name)
            raise

    # --- outputs home -------------------------------------------------------------------

    def _outputs_home(self, run: str) -> int:
        """Copy the destination's `outputs/<run>/` objects the home store lacks, every part
        before any index; the count copied."""
        writer = self.home_writer
        if writer is None:
            return 0
        prefix = f"{OUTPUTS}/{run}/"
        missing = set(self.destination.list(prefix)) - set(self.source.list(prefix))
        ordered = sorted(missing, key=lambda n: (INDEX in n, n))
        for name in ordered:
            copy_object(self.destination, writer, name)
        return len(ordered)


def _check_pin(store: Store, pin: PinnedTree, where: str) -> None:
    name = snapshot_name(pin.tree, pin.snapshot)
    digest = hashlib.sha256(store.get(name)).hexdigest()
    if digest != pin.manifest_sha256:
        raise CorruptObject(name, f"its manifest in {where} hashes to {digest[:12]}…, not to "
                            f"the {pin.manifest_sha256[:12]}… its run's world record pins")


class _NeverWritten:
    """A home store checkpoint-sync must not write (a job's own directory): outputs stay
    off-site, where the owner reads them (`slurm-geo outputs fetch --store`)."""

    def __init__(self, inner: Store):
        self.inner = inner

    def put(self, name: str, data: Bytes) -> None:
        raise CkptError(name, "checkpoint-sync never writes into a job's directory")

    def get(self, name: str) -> bytes:
        return self.inner.get(name)

    def list(self, prefix: str) -> list[str]:
        return self.inner.list(prefix)

    def delete(self, name: str) -> None:
        raise CkptError(name, "checkpoint-sync never writes into a job's directory")

    def exists(self, name: str) -> bool:
        return self.inner.exists(name)

    def sizes(self, prefix: str) -> dict[str, int]:
        return self.inner.sizes(prefix)


def read_only(store: Store) -> Store:
    """`store` as a world copy's source it may never write (no outputs come home)."""
    return _NeverWritten(store)


class _OneObject:
    """The record as it was read once: opened from these bytes, not read again."""

    def __init__(self, name: str, data: bytes):
        self._name, self._data = name, data

    def exists(self, name: str) -> bool:
        return name == self._name

    def get(self, name: str) -> bytes:
        if name != self._name:
            raise ObjectMissing(name)
        return self._data

    def put(self, name: str, data: Bytes) -> None:
        raise CkptError(name, "read-only")

    def list(self, prefix: str) -> list[str]:
        return [self._name] if self._name.startswith(prefix) else []

    def delete(self, name: str) -> None:
        raise CkptError(name, "read-only")

    def sizes(self, prefix: str) -> dict[str, int]:
        return {n: len(self._data) for n in self.list(prefix)}


def _open_record(sealed: bytes, ring: RunKeyRing, run: str) -> WorldRecord:
    record = read_world_record(_OneObject(world_record_name(run), sealed), ring, run)
    assert record is not None
    return record
