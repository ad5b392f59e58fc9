"""Where a FederatedRun's checkpoints go, what the job is told of it, and the record it
leaves for the node epilog: pure, but for reading and writing that record.

A federated run saves to the store of the cluster it runs on (`[clusters.NAME] store`):
the federation daemon fences, verifies and moves runs there, and checkpoint-sync
replicates that store off-site when it is one of its `[sync] roots`. A job's
`--geo-ckpt-dir` is then the job's directory: the node prolog and epilog keep their
records in its `.slurm-geo/`, and the run adds `run-<cluster>-<job>.json` there, naming
the run, its store and its last committed step, so the epilog records the run's final
checkpoint from the store it is in and judges its replication by that store's
replicas, not by an empty directory (docs/training.md, "Where the checkpoints go").

`where` decides (from the site config alone) and says it in one stderr line at start,
with a warning line when the checkpoints go nowhere checkpoint-sync replicates;
`final_from_record` is the epilog's half. The record lies in a directory the user
controls: the epilog trusts it for nothing but a run name it lists as the user, in the
store the config gives the job's cluster. In a checkpoint directory users share, it lies in
the user's own records directory (`.slurm-geo-<uid>/`), and a record in a directory or file
of another user is never read (slurm_geo.jobrecords).
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from slurm_geo import jobrecords
from slurm_geo.atomic import write_atomic
from slurm_geo.ckpt.errors import UnsafeObjectName
from slurm_geo.ckpt.format.names import STEP_DIGITS, check_run_id, manifest_prefix

META_DIR = jobrecords.META_DIR  # the node hooks' records directory (in a private one)
CKPT_DIR_ENV = "SLURM_GEO_CKPT_DIR"
FILE = "file://"


@dataclass(frozen=True)
class Where:
    """Where a run's checkpoints go and whether checkpoint-sync replicates them there:
    `replicated` None where this incarnation cannot tell (no site config: the daemon
    placed it on another cluster)."""

    store: str          # the store's name in the site config ("" when unknown here)
    store_url: str
    cluster: str
    replicated: bool | None
    why: str            # "root", or why not / why unknown


@dataclass(frozen=True)
class SyncFacts:
    """What `where` needs of the site's checkpoint-sync ([sync]); None: no [sync]."""

    roots: Collection[str]     # names (or URLs) of its roots
    destination: str
    home_cluster: str          # "" when the site names none


def where(cluster: str, store: str, store_url: str, sync: SyncFacts | None) -> Where:
    """Is `store`, the store of `cluster`, replicated off-site by checkpoint-sync?"""
    def verdict(replicated: bool, why: str) -> Where:
        return Where(store, store_url, cluster, replicated, why)

    if sync is None:
        return verdict(False, "this site runs no checkpoint-sync ([sync] table)")
    if store and store == sync.destination:
        return verdict(False, f"store '{store}' is checkpoint-sync's destination, the "
                              "off-site copy itself")
    if sync.home_cluster and cluster != sync.home_cluster:
        return verdict(False, f"checkpoint-sync replicates the home cluster "
                              f"'{sync.home_cluster}''s stores only")
    if store in sync.roots or store_url in sync.roots:
        return verdict(True, "root")
    return verdict(False, f"store '{store or store_url}' of cluster '{cluster}' is not one "
                          "of checkpoint-sync's roots ([sync] roots)")


def unknown(cluster: str, store_url: str) -> Where:
    """An incarnation the daemon submitted: no site config to judge by."""
    return Where("", store_url, cluster, None,
                 "not known here: the federation daemon placed this incarnation")


def start_lines(run: str, place: Where, ckpt_dir: str | None) -> list[str]:
    """What the job says on stderr as it opens its store: one line of where its
    checkpoints go, and a warning line when checkpoint-sync does not replicate them."""
    named = f"'{place.store}' ({place.store_url})" if place.store else place.store_url
    line = (f"slurm-geo: run {run} saves its checkpoints to store {named} of cluster "
            f"'{place.cluster}', where the federation daemon can move it")
    if place.replicated:
        line += "; checkpoint-sync replicates them off-site"
    if ckpt_dir:
        line += f"; --geo-ckpt-dir {ckpt_dir} keeps this job's records, not its checkpoints"
    lines = [line]
    if place.replicated is False:
        lines.append(f"slurm-geo: warning: run {run}'s checkpoints are not replicated "
                     f"off-site ({place.why}): if cluster '{place.cluster}' is lost, so "
                     "are they")
    return lines


# --- the record in the job directory -------------------------------------------------------

@dataclass(frozen=True)
class RunRecord:
    """`.slurm-geo/run-<cluster>-<job>.json` (`.slurm-geo-<uid>/` in a shared directory):
    the run a job's FederatedRun trains."""

    run: str
    cluster: str
    job_id: int
    restart: int
    store: str
    store_url: str
    step: int | None            # the last step it reported committed
    replicated: bool | None
    why: str

    @classmethod
    def from_json(cls, value: Any) -> RunRecord | None:
        """The record, or None when it is not one (it is the user's file)."""
        try:
            record = cls(**{name: value[name] for name in cls.__dataclass_fields__})
            check_run_id(record.run)
        except (KeyError, TypeError, UnsafeObjectName):
            return None
        ints = (record.job_id, record.restart) + (() if record.step is None
                                                  else (record.step,))
        if not all(type(n) is int and n >= 0 for n in ints) or not all(
                isinstance(s, str) for s in (record.cluster, record.store,
                                             record.store_url, record.why)):
            return None
        return record


def record_name(cluster: str, job_id: int) -> str:
    return f"run-{cluster}-{job_id}.json"


def record_path(ckpt_dir: Path, cluster: str, job_id: int) -> Path:
    """Where the record of whoever runs this (the job's user) lies (jobrecords)."""
    return jobrecords.records_dir(ckpt_dir) / record_name(cluster, job_id)


def write_record(ckpt_dir: Path, record: RunRecord) -> None:
    """Atomically, into the records directory the prolog made for the job's user (OSError
    when there is none, or one that is not theirs)."""
    directory = jobrecords.trusted_dir(ckpt_dir)
    if directory is None:
        raise FileNotFoundError(f"no records directory in {ckpt_dir}")
    path = directory / record_name(record.cluster, record.job_id)
    write_atomic(path, json.dumps(asdict(record), indent=1, sort_keys=True) + "\n")


def own_mark(record: RunRecord | None, run: str, store_url: str) -> int | None:
    """The step a job's own record, left by an earlier start of the same Slurm job (a
    requeue), last noted committed for `run` in `store_url`: part of the run's high-water
    mark there (docs/format.md §8.6); None when the record names another run or store.
    The user's own file: it protects the user against the store, nothing more."""
    if record is None or record.run != run or record.store_url != store_url:
        return None
    return record.step


def read_record(ckpt_dir: Path, cluster: str, job_id: int) -> RunRecord | None:
    """The job's user's record (whoever runs this), None when there is none they may trust:
    in a directory, or a file, of another user (jobrecords)."""
    try:
        directory = jobrecords.trusted_dir(ckpt_dir)
    except OSError:
        return None
    if directory is None:
        return None
    value = jobrecords.read_json(directory / record_name(cluster, job_id))
    return None if value is None else RunRecord.from_json(value)


# --- the epilog's half ---------------------------------------------------------------------

@dataclass(frozen=True)
class Final:
    """The final checkpoint the epilog records for a federated run."""

    run: str
    step: int | None
    store: str
    source: str          # "store": listed there; "trainer": as the run reported it
    note: str = ""

    def as_json(self) -> dict[str, Any] | None:
        if self.step is None:
            return None
        found = {"run": self.run, "step": self.step, "store": self.store}
        return found | ({"note": self.note} if self.note else {})


def final_from_record(record: RunRecord, store: str, store_url: str,
                      steps: list[int] | None) -> Final:
    """The run's final checkpoint: the newest of `steps`, listed in the job cluster's
    configured store (`store`, `store_url`), when the record names that store and it
    could be listed (None: it could not), else the step the run reported (said so)."""
    if not store_url:
        return Final(record.run, record.step, record.store or record.store_url, "trainer",
                     "no store is configured for this cluster here: as the trainer "
                     "reported it")
    if record.store_url != store_url:
        return Final(record.run, record.step, record.store or record.store_url, "trainer",
                     f"the run saves to {record.store_url}, not this cluster's store "
                     f"{store_url or '-'}: as the trainer reported it")
    if steps is None:
        return Final(record.run, record.step, store, "trainer",
                     "the store cannot be listed here: as the trainer reported it")
    return Final(record.run, max(steps) if steps else None, store, "store")


def listed_steps(store_url: str, run: str) -> list[int] | None:
    """The steps of `run`'s manifests in a file:// store, by their names alone (run as
    the job's user: what the user may list); None for another kind of store, or one
    that cannot be listed."""
    if not store_url.startswith(FILE):
        return None
    root = Path(store_url.removeprefix(FILE))
    directory = root / manifest_prefix(run)
    try:
        if not root.is_dir():
            return None
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    except OSError:
        return None
    return sorted(int(name) for name in names
                  if len(name) == STEP_DIGITS and name.isascii() and name.isdigit())


def unreplicated_stores(stores: Mapping[str, tuple[str, str]], sync: SyncFacts) -> list[str]:
    """For `slurm-geo sync status`: one line per cluster (`stores`: cluster -> (store,
    url)) whose store a FederatedRun saves to and checkpoint-sync does not replicate; a
    cluster other than home, or one whose store is the destination, is no such case."""
    lines = []
    for cluster, (store, url) in sorted(stores.items()):
        if (sync.home_cluster and cluster != sync.home_cluster) or store == sync.destination:
            continue
        place = where(cluster, store, url, sync)
        if not place.replicated:
            lines.append(f"cluster '{cluster}': the checkpoints a FederatedRun saves there "
                         f"are not replicated off-site ({place.why})")
    return lines
