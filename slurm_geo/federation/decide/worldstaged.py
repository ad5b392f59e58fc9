"""Where a run's world is staged, as the planner counts it (issue 31 item 4;
federation.planner.WorldStaging), read from the stores themselves.

checkpoint-sync copies a run's world to a destination store with the world record
(`worlds/<run>`, docs/format.md §11.8) last, after every pinned snapshot was put and read
back whole: a store holding the record holds the whole world. So the daemon asks each
store other than home's for the record (under the run's key, which it opens with the
master key), and counts the ciphertext of the pinned domains' packs there as the world's
size. A store that does not answer, or holds no record, is not counted; a record found is
remembered (a world once complete at a store stays so until a newer one is copied). It
reads stores only; it never reads a user's path.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

from slurm_geo.ckpt.errors import CkptError
from slurm_geo.ckpt.format.keys import MasterKeys
from slurm_geo.ckpt.repo.runkey import unwrap_run_keys
from slurm_geo.ckpt.stores.store import Store
from slurm_geo.federation.decide.planner import WorldStaging
from slurm_geo.stage.names import tree_packs_prefix
from slurm_geo.stage.record import read_world_record, world_record_name

log = logging.getLogger(__name__)

_found: dict[tuple[str, str], int] = {}  # (store, run) -> bytes of the world there
_lock = threading.Lock()


def staged_bytes(store: Store, master_keys: MasterKeys, run: str) -> int | None:
    """The bytes of `run`'s world in `store` when its record is there; None otherwise."""
    if not store.exists(world_record_name(run)):
        return None
    record = read_world_record(store, unwrap_run_keys(store, master_keys, run), run)
    if record is None:
        return None
    domains = {pin.domain for pin in record.trees}
    return sum(sum(store.sizes(tree_packs_prefix(domain)).values()) for domain in domains)


def world_staging(stores: Mapping[str, Store], master_keys: MasterKeys, source_store: str,
                  run: str | None, *, source_up: bool = False) -> WorldStaging:
    """The job's world as the stores hold it: complete (missing 0) in each store other
    than `source_store` (home's) that holds the run's record; of unknown size while none
    does. `source_up`: home answers, so its store is read too: a world its job staged
    there has that size (what a move while home is up must stage first), and is missing
    in full from every store that does not hold the record yet."""
    at_home = _at_home(stores, master_keys, source_store, run) if source_up else None
    staged: dict[str, int] = {}
    for name, store in stores.items():
        if name == source_store or not run:
            continue
        with _lock:
            known = _found.get((name, run))
        if known is None:
            try:
                known = staged_bytes(store, master_keys, run)
            except (CkptError, OSError) as exc:
                log.debug("world of %s in %s not read: %s", run, name, exc)
                known = None
            if known is not None:
                with _lock:
                    _found[(name, run)] = known
        if known is not None:
            staged[name] = known
    sizes = [*staged.values(), *([] if at_home is None else [at_home])]
    if not sizes:
        return WorldStaging(source_store=source_store)
    total = max(sizes)
    # A store holding the record holds the whole world (its pinned domains may hold fewer
    # of the owner's other packs than home's): complete there.
    return WorldStaging(source_store, total, {name: total for name in staged})


def _at_home(stores: Mapping[str, Store], master_keys: MasterKeys, source_store: str,
             run: str | None) -> int | None:
    """The bytes of the world in home's store (never remembered: the home job restages
    it); None when it holds no record yet or does not answer."""
    if not run or source_store not in stores:
        return None
    try:
        return staged_bytes(stores[source_store], master_keys, run)
    except (CkptError, OSError) as exc:
        log.debug("world of %s in %s not read: %s", run, source_store, exc)
        return None
