"""Where a job's world is staged, as `slurm-geo status JOB` shows it (issue 31 item 7): each
root (input, env, workdir), its size, the stores that hold its pinned snapshot verified,
the staging lag and bytes pending per store, and why the job is not movable while its
world is staged nowhere but home.

The daemon reads only stores (never a user's path), as federation.worldstaged does: the
run's world record at home (`worlds/<run>`, the home job's pins) and in every other store
(checkpoint-sync puts it there last, once every snapshot it pins is read back whole there:
a pin a store's record names is verified there), the pinned manifests at home (the roots'
sizes) and the packs each store holds. `observe` does that I/O; `summarise` is pure.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from slurm_geo.ckpt.errors import CkptError
from slurm_geo.ckpt.format.keys import MasterKeys
from slurm_geo.ckpt.repo.runkey import unwrap_run_keys
from slurm_geo.ckpt.stores.store import Store
from slurm_geo.federation.act.worldgrants import root_residency, world_roots
from slurm_geo.federation.model import LogicalJob
from slurm_geo.policy.geo import rules_for
from slurm_geo.stage.keys import MasterTreeKeys
from slurm_geo.stage.names import tree_pack_name, tree_packs_prefix
from slurm_geo.stage.record import PinnedTree, WorldRecord, read_world_record, world_record_name
from slurm_geo.stage.trees import Trees

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from slurm_geo.config.model import SiteConfig

Residency = Mapping[str, tuple[str, tuple[str, ...]]]  # path -> (data class, regions)


@dataclass(frozen=True)
class PinSize:
    """A pin's snapshot at home: its files' bytes, and its packs with their sizes there."""

    bytes: int
    packs: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Observed:
    """What the stores hold of one run's world (None: no record there, or unreadable)."""

    home_store: str
    home: WorldRecord | None
    sizes: Mapping[str, PinSize]                  # pin label -> its size at home
    records: Mapping[str, WorldRecord | None]     # other store -> its record
    packs: Mapping[str, frozenset[str]]           # other store -> pinned packs it holds
    errors: Mapping[str, str] = field(default_factory=dict)  # store -> why not read


def label(pin: PinnedTree) -> str:
    return f"{pin.tree}/{pin.snapshot}/{pin.manifest_sha256}"


def _where(pin: PinnedTree, store: str, record: WorldRecord | None, region: str | None,
           residency: Residency) -> str:
    data_class, regions = residency.get(pin.path, ("", ()))
    there = None if record is None else record.pinned(pin.path)
    if there is not None and label(there) == label(pin):
        return "verified"
    if region is not None and pin.path in residency and region not in regions:
        return f"refused: data class {data_class} may not reside in region {region}"
    if there is not None:
        return f"snapshot {there.snapshot} (older)"
    return "pending"


def summarise(observed: Observed, roots: list[tuple[str, str]], residency: Residency,
              store_regions: Mapping[str, str], now: float) -> dict[str, Any]:
    """The world's status (JSON): `roots` are `(what, path)` as the daemon grants them.
    Pure."""
    home = observed.home
    others = sorted(observed.records)
    rows: list[dict[str, Any]] = []
    pending = {name: 0 for name in others}
    for what, path in roots:
        pin = None if home is None else home.pinned(path)
        data_class = residency.get(path, ("-", ()))[0]
        if pin is None:
            rows.append({"what": what, "path": path, "data_class": data_class,
                         "bytes": None, "snapshot": None, "stores": {
                             name: "not staged at home yet" for name in others}})
            continue
        size = observed.sizes.get(label(pin), PinSize(0))
        stores = {}
        for name in others:
            stores[name] = _where(pin, name, observed.records[name], store_regions.get(name),
                                  residency)
            if stores[name] == "pending" or stores[name].endswith("(older)"):
                held = observed.packs.get(name, frozenset())
                pending[name] += sum(n for p, n in size.packs.items() if p not in held)
        rows.append({"what": what, "path": path, "data_class": data_class,
                     "bytes": size.bytes, "snapshot": pin.snapshot, "stores": stores})
    complete = [name for name in others if observed.records[name] is not None]
    current = [name for name in complete if all(r["stores"].get(name) == "verified"
                                                for r in rows)]
    lag = None if home is None else 0.0 if current or not others \
        else max(0.0, now - home.staged_at)
    return {"home_store": observed.home_store,
            "staged_at_home": None if home is None else home.staged_at,
            "roots": rows, "complete_at": complete, "current_at": current,
            "lag_s": lag, "pending_bytes": {n: pending[n] for n in others
                                            if n not in current},
            "errors": dict(observed.errors), "why_not_movable": _why_not(
                home, rows, complete, others, store_regions)}


def _why_not(home: WorldRecord | None, rows: list[dict[str, Any]], complete: list[str],
             others: list[str], store_regions: Mapping[str, str]) -> str | None:
    if complete:
        return None
    refusals = sorted({f"{r['what']} {r['path']} (data class {r['data_class']})"
                       for r in rows for name in others
                       if r["stores"].get(name, "").startswith("refused")})
    if refusals and all(any(r["stores"].get(n, "").startswith("refused") for r in rows)
                        for n in others):
        regions = ", ".join(sorted({store_regions.get(n, "?") for n in others}))
        return (f"its world may not leave home: {'; '.join(refusals)} may not reside in "
                f"region {regions} of any other store")
    if home is None:
        return "its world is not staged yet: the home job has pinned nothing"
    return "its world is staged nowhere but home yet (checkpoint-sync is copying it)"


def observe(stores: Mapping[str, Store], master_keys: MasterKeys, home_store: str,
            run: str) -> Observed:
    """Read the run's world records and pinned packs from `stores` (never a user's path);
    a store that does not answer is left out with its error."""
    errors: dict[str, str] = {}
    home, sizes = None, {}
    try:
        store = stores[home_store]
        home = read_world_record(store, unwrap_run_keys(store, master_keys, run), run)
        if home is not None:
            sizes = _sizes(store, master_keys, home)
    except CkptError as exc:
        errors[home_store] = str(exc)
    wanted = {p for size in sizes.values() for p in size.packs}
    records: dict[str, WorldRecord | None] = {}
    packs: dict[str, frozenset[str]] = {}
    for name, other in sorted(stores.items()):
        if name == home_store:
            continue
        try:
            records[name] = read_world_record(other, unwrap_run_keys(other, master_keys, run),
                                              run) if other.exists(world_record_name(run)) \
                else None
            domains = {p.domain for p in (home.trees if home is not None else ())}
            held = {n for d in domains for n in other.sizes(tree_packs_prefix(d))}
            packs[name] = frozenset(held & wanted)
        except CkptError as exc:
            errors[name] = str(exc)
            records[name] = None
    return Observed(home_store, home, sizes, records, packs, errors)


def _sizes(store: Store, master_keys: MasterKeys, record: WorldRecord) -> dict[str, PinSize]:
    trees = Trees(store, MasterTreeKeys(store, master_keys))
    found = {}
    for pin in record.trees:
        manifest = trees.manifest(pin.tree, pin.snapshot, pin.domain)
        at_home = store.sizes(tree_packs_prefix(pin.domain))
        names = {tree_pack_name(pin.domain, ref.pack) for ref in manifest.refs()}
        found[label(pin)] = PinSize(manifest.total_bytes,
                                    {n: at_home.get(n, 0) for n in names})
    return found


def job_world_status(stores: Mapping[str, Store], master_keys: MasterKeys, site: SiteConfig,
                     job: LogicalJob, now: float) -> dict[str, Any] | None:
    """The world status of `job` (None when it declares no world or has no run yet)."""
    roots = world_roots(job)
    if not roots or not job.run:
        return None
    observed = observe(stores, master_keys, site.cluster(job.home).store, job.run)
    return summarise(observed, list(roots), root_residency(job, rules_for(site)),
                     {name: store.region for name, store in site.stores.items()}, now)
