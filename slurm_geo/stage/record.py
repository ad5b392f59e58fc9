"""A run's world record (docs/format.md §11.8): which staged snapshot of each root of the
job's world a moved incarnation materialises, pinned by the job that staged it.

    worlds/<run>    the record, sealed under the run's key (kind 2, as a manifest)

The home job stages its own world as its owner and writes this record; checkpoint-sync
copies it with the run's checkpoints; the moved job's preamble reads it with the run key
it is handed, fetches each pinned snapshot and checks that the snapshot's sealed manifest
hashes to what the record says. So a holder of a shared domain's key (another user who
declared the same public dataset) cannot swap a snapshot under this run: the pin is under
a key only this run's jobs hold, and `tree-latest` is never followed at the destination.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any, Literal

from slurm_geo.ckpt.errors import CorruptObject, UnsafeObjectName
from slurm_geo.ckpt.format.keys import SALT_SIZE, RandomBytes, RunKeyRing
from slurm_geo.ckpt.format.names import check_run_id
from slurm_geo.ckpt.format.seal import Kind, open_sealed, seal, sealing_fingerprint
from slurm_geo.ckpt.stores.store import Store
from slurm_geo.stage.names import check_tree_id, snapshot_name

WORLDS = "worlds"
RECORD_FORMAT = 1
What = Literal["input", "env", "workdir", "script"]
_WHATS = ("input", "env", "workdir", "script")


def world_record_name(run: str) -> str:
    return f"{WORLDS}/{check_run_id(run)}"


@dataclass(frozen=True)
class PinnedTree:
    """One root of the job's world as staged: its home path, the tree and domain it was
    staged to, the snapshot, and the SHA-256 of that snapshot's sealed manifest object."""

    what: What
    path: str
    tree: str
    domain: str
    snapshot: int
    manifest_sha256: str

    def check(self) -> PinnedTree:
        check_tree_id(self.tree)
        check_tree_id(self.domain, "domain")
        snapshot_name(self.tree, self.snapshot)
        if self.what not in _WHATS or not self.path.startswith("/") or \
                len(self.manifest_sha256) != 64:
            raise ValueError(f"not a pinned tree: {self!r}")
        return self


@dataclass(frozen=True)
class WorldRecord:
    run: str
    trees: tuple[PinnedTree, ...]
    staged_at: float = 0.0  # when the newest of them was staged (unix time)

    def pinned(self, path: str) -> PinnedTree | None:
        return next((t for t in self.trees if t.path == path), None)

    def to_payload(self) -> bytes:
        body: dict[str, Any] = {"format": RECORD_FORMAT, "run": self.run,
                                "staged_at": self.staged_at,
                                "trees": [asdict(t) for t in self.trees]}
        return json.dumps(body, sort_keys=True).encode()

    @classmethod
    def from_payload(cls, payload: bytes, name: str) -> WorldRecord:
        try:
            body = json.loads(payload)
            if body["format"] != RECORD_FORMAT:
                raise CorruptObject(name, f"world record format {body['format']!r}; this "
                                    f"release reads format {RECORD_FORMAT}")
            trees = tuple(PinnedTree(**t).check() for t in body["trees"])
            return cls(check_run_id(body["run"]), trees, float(body["staged_at"]))
        except (ValueError, KeyError, TypeError, UnsafeObjectName) as exc:
            raise CorruptObject(name, f"not a world record: {exc}") from None


def manifest_digest(store: Store, tree: str, snapshot: int) -> str:
    """The SHA-256 of the snapshot's sealed manifest object, as it lies in `store`."""
    return hashlib.sha256(store.get(snapshot_name(tree, snapshot))).hexdigest()


def write_world_record(store: Store, ring: RunKeyRing, record: WorldRecord,
                       random_bytes: RandomBytes) -> None:
    name = world_record_name(record.run)
    store.put(name, seal(ring.current.data_key, Kind.MANIFEST, random_bytes(SALT_SIZE),
                         record.to_payload(), name))


def read_world_record(store: Store, ring: RunKeyRing, run: str) -> WorldRecord | None:
    """The run's world record, or None where the run staged none."""
    name = world_record_name(run)
    if not store.exists(name):
        return None
    sealed = store.get(name)
    keys = ring.sealed_under(sealing_fingerprint(sealed), name)
    record = WorldRecord.from_payload(open_sealed(keys.data_key, Kind.MANIFEST, sealed, name),
                                      name)
    if record.run != run:
        raise CorruptObject(name, f"the record names run {record.run!r}, not {run!r}")
    return record
