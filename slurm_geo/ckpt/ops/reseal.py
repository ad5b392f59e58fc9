"""`slurm-geo ckpt reseal`: the one reader of version 1 promotion markers (format.md §8.4).

Version 1 markers were sealed under the run's data key, which every job of the run holds,
so readers refuse them. At the upgrade, an operator holding the master key runs this once
per store: each version 1 marker whose payload names its checkpoint, and whose checkpoint's
manifest opens, is sealed again under the promotion key with the same payload. Markers a
job may have forged since cannot be told from real ones, which is why this runs once, at
the upgrade, and not in a daemon. Version 1 fences are only counted: the federation daemon
rewrites the fences its state knows (slurm_geo.federation.act.fencing).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from slurm_geo.ckpt.errors import CkptError, LegacyObject, UnsafeObjectName
from slurm_geo.ckpt.format.keys import SALT_SIZE, MasterKeys, RandomBytes, promotion_key
from slurm_geo.ckpt.format.names import run_of_manifest_name, step_of_manifest_name
from slurm_geo.ckpt.format.seal import Kind, open_legacy, seal, sealing_fingerprint
from slurm_geo.ckpt.repo.repository import Repository, check_promotion
from slurm_geo.ckpt.repo.runkey import unwrap_run_keys
from slurm_geo.ckpt.stores.store import Store


@dataclass
class ResealReport:
    resealed: list[str] = field(default_factory=list)   # version 1 markers sealed anew
    current: list[str] = field(default_factory=list)    # already version 2
    refused: dict[str, str] = field(default_factory=dict)  # name -> why it was left alone
    old_fences: list[str] = field(default_factory=list)  # version 1 fences, left alone


def reseal(store: Store, master_key: bytes | MasterKeys, dry_run: bool = False,
           random_bytes: RandomBytes = os.urandom) -> ResealReport:
    repository = Repository(store, master_key)
    sealing_key = promotion_key(repository.master_keys.keys()[0])
    report = ResealReport()
    for name in sorted(store.list("promoted/")):
        checkpoint = _checkpoint_of(name)
        if checkpoint is None:
            report.refused[name] = "not the name of a promotion marker"
            continue
        try:
            repository.is_promoted(*checkpoint)
            report.current.append(name)
            continue
        except LegacyObject:
            pass
        except CkptError as exc:
            report.refused[name] = str(exc)
            continue
        try:
            payload = _legacy_payload(store, repository, name, *checkpoint)
        except CkptError as exc:
            report.refused[name] = str(exc)
            continue
        if not dry_run:
            salt = random_bytes(SALT_SIZE)
            store.put(name, seal(sealing_key, Kind.PROMOTED, salt, payload, name))
        report.resealed.append(name)
    report.old_fences = [n for n in sorted(store.list("fences/")) if _is_legacy_fence(
        repository, n)]
    return report


def _legacy_payload(store: Store, repository: Repository, name: str, run: str,
                    step: int) -> bytes:
    """The marker's payload, read under the old rule and checked; raises what is wrong."""
    sealed = store.get(name)
    ring = unwrap_run_keys(store, repository.master_keys, run)
    payload = open_legacy(ring.opening(sealing_fingerprint(sealed)).data_key, Kind.PROMOTED,
                          sealed, name)
    check_promotion(payload, name, run, step)
    repository.manifest(run, step)  # a marker of a checkpoint that opens, only
    return payload


def _checkpoint_of(name: str) -> tuple[str, int] | None:
    as_manifest = "manifests/" + name.removeprefix("promoted/")
    run = run_of_manifest_name(as_manifest)
    if run is None:
        return None
    try:
        step = step_of_manifest_name(run, as_manifest)
    except UnsafeObjectName:
        return None
    return None if step is None else (run, step)


def _is_legacy_fence(repository: Repository, name: str) -> bool:
    run = name.removeprefix("fences/")
    try:
        repository.fence_payload(run)
    except LegacyObject:
        return True
    except CkptError:
        return False
    return False
