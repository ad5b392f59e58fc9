"""Where a staged tree domain's bytes may reside (issue 31 item 5; docs/format.md §11.10).

tree-residency/<domain>: sealed (kind 2) under R = HKDF(M, absent, "slurm-geo/v1/tree-residency")

The federation daemon writes it when it grants a job a domain at home
(slurm_geo.federation.act.worldgrants): the data classes of the roots it was granted for and
the regions they may reside in. checkpoint-sync, which copies a run's world off-site under
its own account, never trusts what a user's job wrote (the world record is the job's): it
opens this object under the master key before it copies a pinned snapshot of the domain
and copies nothing of a world any of whose domains may not reside in the destination's
region. No job holds `R`: an object a user put there (forged, or another domain's moved
here) does not open, and a domain without a sound object is not copied (fail closed).

A domain's residency only narrows: a later grant keeps the classes it had and the regions
both allow (`narrowed`), so a second job that declares the same root without its class
does not widen where the first one's restricted bytes may go.

`decide` is pure; `read_residency` and `write_residency` do the store I/O.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from slurm_geo.ckpt.errors import CkptError, CorruptObject, ObjectMissing, StoreUnavailable
from slurm_geo.ckpt.format.keys import (
    SALT_SIZE,
    MasterKeys,
    RandomBytes,
    fingerprint,
    residency_key,
)
from slurm_geo.ckpt.format.seal import Kind, open_sealed, seal, sealing_fingerprint
from slurm_geo.ckpt.stores.store import Store
from slurm_geo.stage.names import check_tree_id

TREE_RESIDENCY = "tree-residency"
FORMAT = 1


def residency_name(domain: str) -> str:
    return f"{TREE_RESIDENCY}/{check_tree_id(domain, 'domain')}"


@dataclass(frozen=True)
class TreeResidency:
    """The data classes a domain's roots were granted with, and the regions all of them
    may reside in (sorted; empty: nowhere but where they are)."""

    domain: str
    classes: tuple[str, ...]
    regions: tuple[str, ...]

    def to_payload(self) -> bytes:
        return json.dumps({"format": FORMAT, "domain": self.domain,
                           "classes": list(self.classes), "regions": list(self.regions)},
                          sort_keys=True).encode()

    @classmethod
    def from_payload(cls, payload: bytes, name: str) -> TreeResidency:
        try:
            data = json.loads(payload)
            if not isinstance(data, dict) or data.get("format") != FORMAT:
                raise ValueError("not format 1")
            classes, regions = data["classes"], data["regions"]
            if not all(isinstance(v, list) and all(isinstance(s, str) for s in v)
                       for v in (classes, regions)):
                raise ValueError("classes and regions are lists of names")
            found = cls(str(data["domain"]), tuple(sorted(set(classes))),
                        tuple(sorted(set(regions))))
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptObject(name, f"not a residency record: {exc}") from None
        if residency_name(found.domain) != name:
            raise CorruptObject(name, f"names domain '{found.domain}', not its own")
        return found


def narrowed(old: TreeResidency | None, new: TreeResidency) -> TreeResidency:
    """What a domain may do once granted again with `new`: every class either named, the
    regions both allow. Pure."""
    if old is None:
        return new
    return TreeResidency(new.domain, tuple(sorted(set(old.classes) | set(new.classes))),
                         tuple(sorted(set(old.regions) & set(new.regions))))


def decide(residency: TreeResidency | None, error: str | None, region: str,
           class_regions: Mapping[str, tuple[str, ...]]) -> str | None:
    """Why a snapshot of the domain may not be copied to a store in `region`; None when it
    may. `residency` as read (None: missing or refused, `error` says which);
    `class_regions`: the reader's own policy (`[policy.data_classes]`), which can narrow
    the record further but never widen it. Pure."""
    if residency is None:
        return error or "no residency record from the federation daemon"
    if region not in residency.regions:
        classes = ", ".join(residency.classes) or "-"
        return (f"data class {classes} may not reside in region '{region}' (allowed: "
                f"{', '.join(residency.regions) or 'none'})")
    for data_class in residency.classes:
        allowed = class_regions.get(data_class)
        if allowed is not None and region not in allowed:
            return (f"data class {data_class} may not reside in region '{region}' "
                    f"(allowed: {', '.join(allowed) or 'none'})")
    return None


def read_residency(store: Store, master_keys: MasterKeys, domain: str) -> TreeResidency | None:
    """The domain's residency as the daemon sealed it; None when there is none.
    CorruptObject or WrongKey for an object that does not open under `R` (forged, moved,
    altered)."""
    name = residency_name(domain)
    try:
        sealed = store.get(name)
    except ObjectMissing:
        return None
    found = sealing_fingerprint(sealed)
    keys = [residency_key(k) for k in master_keys.keys()]
    key = next((k for k in keys if fingerprint(k) == found), keys[0])
    return TreeResidency.from_payload(open_sealed(key, Kind.MANIFEST, sealed, name), name)


def write_residency(store: Store, master_keys: MasterKeys, residency: TreeResidency,
                    random_bytes: RandomBytes = os.urandom) -> TreeResidency:
    """Narrow the domain's residency by `residency` (a new grant's); written only when
    it changes. An object there that does not open is replaced (it was not the daemon's:
    its last sound one is lost, so the grant's own stands). The residency now."""
    try:
        old = read_residency(store, master_keys, residency.domain)
    except StoreUnavailable:
        raise  # never written over unseen: that could widen what it allowed
    except CkptError:
        old = None
    now = narrowed(old, residency)
    if now != old:
        name = residency_name(residency.domain)
        store.put(name, seal(residency_key(master_keys.keys()[0]), Kind.MANIFEST,
                             random_bytes(SALT_SIZE), now.to_payload(), name))
    return now


class ResidencyChecker:
    """`domain -> why not` (`__call__`) for copies from `store` to a store in `region`,
    and whether a domain's copies already there must go (`forbids`). `remember` narrows
    what was read by what the reader read of the domain before and keeps the result
    (checkpoint-sync's state): an older, wider object of the daemon's put back in place of
    the current one (where users may write the store) gains nothing. Each domain is read
    once per checker."""

    def __init__(self, store: Store, master_keys: MasterKeys, region: str,
                 class_regions: Mapping[str, tuple[str, ...]],
                 remember: Callable[[TreeResidency], TreeResidency] | None = None):
        self._store, self._master_keys, self._region = store, master_keys, region
        self._class_regions, self._remember = class_regions, remember
        self._read: dict[str, tuple[TreeResidency | None, str | None]] = {}

    def __call__(self, domain: str) -> str | None:
        residency, error = self._residency(domain)
        return decide(residency, error, self._region, self._class_regions)

    def forbids(self, domain: str) -> bool:
        """Whether the domain's residency, read and sound, keeps it out of the region: its
        copies there are withdrawn. A record missing or refused (forged, unreadable) only
        stops new copies: anyone able to spoil the home store's object must not be able
        to delete a site's off-site world with it."""
        residency, error = self._residency(domain)
        return residency is not None and error is None and \
            decide(residency, None, self._region, self._class_regions) is not None

    def _residency(self, domain: str) -> tuple[TreeResidency | None, str | None]:
        if domain not in self._read:
            try:
                residency, error = read_residency(self._store, self._master_keys,
                                                  domain), None
            except StoreUnavailable:
                raise
            except CkptError as exc:
                residency, error = None, f"its residency record is refused: {exc}"
            if residency is not None and self._remember is not None:
                residency = self._remember(residency)
            self._read[domain] = (residency, error)
        return self._read[domain]


def checker(store: Store, master_keys: MasterKeys, region: str,
            class_regions: Mapping[str, tuple[str, ...]],
            remember: Callable[[TreeResidency], TreeResidency] | None = None
            ) -> ResidencyChecker:
    """A `ResidencyChecker` for copies from `store` to a store in `region`."""
    return ResidencyChecker(store, master_keys, region, class_regions, remember)
