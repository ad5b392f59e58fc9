"""Staging into a shared domain, where every grantee holds the key (docs/format.md §11.2,
docs/security.md "Shared staged trees").

A world-readable root is staged in one tree of a domain whose key every job that declares
it is given (slurm_geo.federation.act.worldgrants), so a second user's job on the same
dataset stores no new chunk. Every holder of that key can also write the domain's
objects, so a stager there trusts nothing it did not write itself:

* **No stat reuse from another's snapshot.** A file is taken without a read only from
  the snapshot its own run pinned (`worlds/<run>`, sealed under the run key, the manifest
  bound by its SHA-256: §11.8), and only while that snapshot's packs are still there.
  A snapshot another grantee wrote could claim an unchanged file has chunks he chose.
* **Chunks by id, read back once.** Any other snapshot of the tree only offers chunk ids
  to reference; a chunk is referenced only after it was read back from the store and its
  plaintext checked against its keyed id (the id this stager computed from its own
  bytes), once per pass. One planted under a guessed id with other bytes does not open
  to it: the stager stores its own copy, and its job never reads the planted one.

`Vetted` is the known-chunks map the chunk writer consults; `plan` picks what a shared
staging may lean on.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from slurm_geo.ckpt.errors import CkptError
from slurm_geo.ckpt.format.manifest import ChunkRef
from slurm_geo.ckpt.stores.store import Store
from slurm_geo.stage.manifest import FILE, TreeManifest
from slurm_geo.stage.names import snapshot_name, tree_pack_name
from slurm_geo.stage.walk import StageSourceError

log = logging.getLogger("slurm_geo.stage")

CANDIDATES = 3  # the newest snapshots of a shared tree whose chunks a stager may reference


class NotPublic(StageSourceError):
    """A root staged into a shared domain that has an entry not every user may read."""


@dataclass(frozen=True)
class Shared:
    """Stage into a shared domain. `pinned`: (snapshot, manifest SHA-256) of the snapshot
    of this tree that the stager's own run pinned: the one whose stat it trusts."""

    pinned: tuple[int, str] | None = None


class Vetted(dict[str, ChunkRef]):
    """Known chunks: `trusted` ones as given; a `candidate` only once `read` has read it
    back and checked it against its id (then kept), never when that failed. Candidates of
    one id are tried in the order given (newest snapshot first) until one is sound."""

    def __init__(self, trusted: Iterable[ChunkRef], candidates: Iterable[ChunkRef],
                 read: Callable[[ChunkRef], object]):
        super().__init__((r.id, r) for r in trusted)
        self._candidates: dict[str, list[ChunkRef]] = {}
        for ref in candidates:
            same = self._candidates.setdefault(ref.id, [])
            if ref.base is None and ref not in same:
                same.append(ref)
        self._read = read
        self._refused: set[str] = set()
        self._lock = threading.Lock()
        self.read_back = 0  # chunks read back and found sound
        self.refused = 0    # chunks that did not open to their id

    def __contains__(self, cid: object) -> bool:
        if dict.__contains__(self, cid):
            return True
        if not isinstance(cid, str) or cid in self._refused:
            return False
        for ref in self._candidates.get(cid, ()):
            try:
                self._read(ref)
            except CkptError as exc:
                log.warning("a chunk of a shared staged tree does not open to its id (%s)",
                            exc)
                with self._lock:
                    self.refused += 1
                continue
            with self._lock:
                dict.__setitem__(self, cid, ref)
                self.read_back += 1
            return True
        with self._lock:
            self._refused.add(cid)  # none sound: this staging stores its own copy
        return False


@dataclass(frozen=True)
class Plan:
    trusted: TreeManifest | None  # the pinned snapshot, less files whose packs are gone
    newest: TreeManifest | None   # the newest snapshot that opens (anyone's)
    candidates: tuple[TreeManifest, ...]


def pinned_sealed(store: Store, tree: str, pinned: tuple[int, str] | None) -> bytes | None:
    """The sealed manifest the run pinned, if it still hashes to the pin."""
    if pinned is None:
        return None
    snapshot, digest = pinned
    try:
        sealed = store.get(snapshot_name(tree, snapshot))
    except CkptError:
        return None
    return sealed if hashlib.sha256(sealed).hexdigest() == digest else None


def plan(store: Store, tree: str, domain: str, listed: Sequence[int],
         pinned: TreeManifest | None, open_manifest: Callable[[int], TreeManifest],
         usable: Callable[[TreeManifest], bool]) -> Plan:
    """What a shared staging of `tree` may lean on: its run's `pinned` snapshot (already
    checked against the pin) for stat reuse, where its packs are all still there; the
    newest few snapshots that open, usable, for chunk ids only."""
    trusted = None
    if pinned is not None and usable(pinned):
        trusted = _with_packs_present(store, domain, pinned)
    candidates: list[TreeManifest] = []
    for number in sorted(listed, reverse=True):
        if len(candidates) == CANDIDATES:
            break
        try:
            manifest = open_manifest(number)
        except CkptError as exc:
            log.warning("snapshot %d of a shared staged tree does not open (%s): not used",
                        number, exc)
            continue
        if usable(manifest):
            candidates.append(manifest)
    return Plan(trusted, candidates[0] if candidates else None, tuple(candidates))


def _with_packs_present(store: Store, domain: str, manifest: TreeManifest) -> TreeManifest:
    """`manifest` without the files some chunk of which is in a pack no longer there (a
    grantee may remove the packs he wrote): those files are read again."""
    packs = {ref.pack for ref in manifest.refs()}
    gone = {p for p in packs if not store.exists(tree_pack_name(domain, p))}
    if not gone:
        return manifest
    log.warning("%d pack(s) of the pinned snapshot are gone: their files are read again",
                len(gone))
    return replace(manifest, entries=tuple(
        e for e in manifest.entries
        if e.type != FILE or not any(c.pack in gone for c in e.chunks)))
