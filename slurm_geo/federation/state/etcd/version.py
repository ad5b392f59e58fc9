"""The version of the federation state's layout in etcd, as the SQLite state has its
PRAGMA user_version (federation.schema).

`<prefix>/layout-version` holds `{"version": N}` (sealed, as every value). Version 1 is
the layout of docs/federation.md, "Key layout"; slurm-geo 0.1 wrote no version key, and a
state without one is version 1. A replica that opens the state refuses a version newer
than LAYOUT_VERSION, in one line (`LayoutTooNew`), and never campaigns to lead it; the
replica that wins the leader key settles it: writes the version where there is none, and
runs the migrations from an older one (MIGRATIONS[n] takes version n to n + 1; each is
its own etcd transactions and must be safe to run again), then writes the new version.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from slurm_geo import __version__
from slurm_geo.federation.model import FederationStateError
from slurm_geo.federation.state.etcd.kv import ABSENT, EtcdKV, Request, created_at, modified_at
from slurm_geo.federation.state.etcd.layout import Layout

LAYOUT_VERSION = 1
UNVERSIONED = 1  # what a state with no version key is: slurm-geo 0.1's layout
# version n -> what takes it to n + 1; none yet.
MIGRATIONS: dict[int, Callable[[EtcdKV, Layout], None]] = {}


class LayoutTooNew(FederationStateError):
    def __init__(self, layout: Layout, version: int):
        super().__init__(
            f"the federation state in etcd ({layout.prefix}) is layout version {version}, "
            f"written by a newer slurm-geo (this one reads {LAYOUT_VERSION}); upgrade "
            "slurm-geo on this host")


def read_version(kv: EtcdKV, layout: Layout) -> int | None:
    """The state's layout version; None where no version key is written yet."""
    found = kv.get(layout.version)
    return None if found is None else _version_of(found.value, layout)


def check_layout(kv: EtcdKV, layout: Layout) -> int:
    """The version this slurm-geo reads the state as; LayoutTooNew if it is newer."""
    version = read_version(kv, layout)
    if version is not None and version > LAYOUT_VERSION:
        raise LayoutTooNew(layout, version)
    return UNVERSIONED if version is None else version


def settle_layout(kv: EtcdKV, layout: Layout, guard: Request | None = None) -> int:
    """Bring the state to LAYOUT_VERSION: migrate an older one, write the version where
    none is; `guard` (the leader's compare) makes the write the leader's only. Returns
    the version the state is at now."""
    found = kv.get(layout.version)
    version = UNVERSIONED if found is None else _version_of(found.value, layout)
    if version > LAYOUT_VERSION:
        raise LayoutTooNew(layout, version)
    if found is not None and version == LAYOUT_VERSION:
        return version
    for step in range(version, LAYOUT_VERSION):
        MIGRATIONS[step](kv, layout)
    value = json.dumps({"version": LAYOUT_VERSION, "written_by": __version__}).encode()
    compare = created_at(layout.version, 0) if found is None \
        else modified_at(layout.version, found.mod_revision)
    outcome = kv.commit([compare, *([guard] if guard is not None else [])],
                        [kv.put(layout.version, value, at=ABSENT if found is None
                                else found.at)], [])
    return LAYOUT_VERSION if outcome.succeeded else check_layout(kv, layout)


def _version_of(value: bytes, layout: Layout) -> int:
    try:
        version = json.loads(value)["version"]
    except (ValueError, KeyError, TypeError):
        version = None
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise FederationStateError(f"the federation state in etcd ({layout.version}) holds "
                                   "no layout version this slurm-geo can read; restore it "
                                   "from a backup of etcd")
    return version
