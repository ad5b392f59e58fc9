"""Node Prolog and Epilog of geo jobs: the checkpoint directory before and after a job.

Prolog, before each incarnation of a job with --geo-ckpt-dir:
  1. creates the checkpoint directory (owned by the job's user) and the job's records
     directory in it: `.slurm-geo/`, or in a directory users share `.slurm-geo-<uid>/`
     (slurm_geo.jobrecords, which says which records are trusted);
  2. on a resumed incarnation (SLURM_JOB_RESTART_COUNT > 0), lists what it may resume
     from: each run's newest step, by the manifest names alone. The node holds no key
     (docs/security.md, "Where each secret lives"): the job's own resume verifies the
     checkpoint as it reads it, with the key the job holds (its run's data key, from the
     federation daemon), and falls back to the newest older one that reads back intact;
  3. writes `.slurm-geo/prolog-<cluster>-<job>-<restart>.json`: what it saw.
Epilog, after each incarnation:
  1. finds the job's final checkpoint (the run with the newest manifest, its last step);
     a job whose FederatedRun recorded its run there (`.slurm-geo/run-<cluster>-<job>.json`,
     slurm_geo.lease.places) has it in its cluster's store, and is judged by that store;
  2. tells why the incarnation ended (requeued, completed, failed) from the restart count
     the prolog saw and the exit code;
  3. hands the checkpoint to checkpoint-sync: the directory is one of its roots, or a
     registered job's directory it replicates too (both on its next scan), or the record
     says why it is not replicated (the job's residency, no checkpoint-sync);
  4. appends all that to `.slurm-geo/job-<cluster>-<job>.json` (and removes the
     `staging-*` directories an earlier release's prolog left).

The records directory starts with a dot, which stores never list: it is not part of the
checkpoint repository. Both hooks are correct to run twice. `.slurm-geo/` below stands for
it.

The hooks run as root, in a directory the job's user chose: everything they do there they
do as that user (`as_user`), so a symbolic link planted in the directory leads nowhere
the user could not write anyway. Neither opens a key or a store's credentials: a compute
node holds no master key, no run key and no daemon's store key.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from slurm_geo import jobrecords
from slurm_geo.atomic import write_atomic
from slurm_geo.ckpt.format.names import run_of_manifest_name, step_of_manifest_name
from slurm_geo.ckpt.stores.store import LocalDirStore, Store
from slurm_geo.hooks.context import JobContext
from slurm_geo.lease import places  # imported as root: the epilog reads as the job's owner
from slurm_geo.sync.jobdirs import Protection

log = logging.getLogger("slurm_geo.hooks")

META_DIR = jobrecords.META_DIR


@dataclass(frozen=True)
class Newest:
    """A run's newest checkpoint in the directory, by its manifest's name: what a resumed
    incarnation may resume from. Not verified here (the node holds no key): the job's
    resume verifies it and falls back to an older step if it does not read back intact."""

    run: str
    step: int


@dataclass(frozen=True)
class ClusterStore:
    """The store the site config gives the job's cluster, where a FederatedRun saves
    (slurm_geo.lease.places), with checkpoint-sync's answer for it: `protected` as the
    configuration says, `judge` as its state says, given the run."""

    name: str
    url: str
    protected: Protection
    judge: Callable[[Protection, str | None], Protection] | None = None


# --- checkpoints, without the key ---------------------------------------------------------

def newest_steps(store: Store) -> dict[str, list[int]]:
    """{run: steps ascending} from the manifest names alone (no key needed)."""
    runs: dict[str, list[int]] = {}
    for name in store.list("manifests/"):
        run = run_of_manifest_name(name)
        step = step_of_manifest_name(run, name) if run else None
        if run is not None and step is not None:
            runs.setdefault(run, []).append(step)
    return {run: sorted(steps) for run, steps in runs.items()}


def final_checkpoint(ckpt_dir: Path) -> tuple[str, int] | None:
    """(run, step) of the manifest written last in a local checkpoint directory."""
    store = LocalDirStore(ckpt_dir)
    newest: tuple[float, str, int] | None = None
    for run, steps in newest_steps(store).items():
        path = ckpt_dir / "manifests" / run / f"{steps[-1]:020d}"
        try:
            written = path.stat().st_mtime
        except OSError:
            continue
        if newest is None or written > newest[0]:
            newest = (written, run, steps[-1])
    return None if newest is None else (newest[1], newest[2])


# --- prolog --------------------------------------------------------------------------------

class UnknownJobUser(ValueError):
    """Root with no job user to act as: the hook must not go on as root."""


@contextmanager
def as_user(uid: int | None, gid: int | None) -> Iterator[None]:
    """Run the block with the job user's effective ids and groups (when we are root and
    the job is not); root's come back afterwards. Unknown ids, as root, raise: the block
    never runs as root for a job whose user is not known."""
    if os.geteuid() != 0:
        yield
        return
    if uid is None or gid is None:
        raise UnknownJobUser(f"the job's uid/gid are unknown ({uid}/{gid}); not acting as root")
    if uid == 0:  # root's own job
        yield
        return
    groups = os.getgroups()
    try:
        name = pwd.getpwuid(uid).pw_name
        os.setgroups(os.getgrouplist(name, gid))
    except KeyError:
        os.setgroups([gid])
    os.setegid(gid)
    os.seteuid(uid)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)
        os.setgroups(groups)


def prepare_directory(ckpt_dir: Path) -> Path:
    """Create the checkpoint directory and the job's records directory in it (as the job's
    user: see `as_user`); returns the latter. In a directory users share it is the user's
    own `.slurm-geo-<uid>/`, never a `.slurm-geo/` another user's job made (whose owner
    could remove everyone's records in it): slurm_geo.jobrecords. RecordsRefused (one
    line) when the one there is not the user's."""
    ckpt_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
    return jobrecords.ensure_dir(ckpt_dir)


def newest(ckpt_dir: Path) -> list[Newest]:
    """Each run's newest step in `ckpt_dir`, from the manifest names (no key needed)."""
    return [Newest(run, steps[-1])
            for run, steps in sorted(newest_steps(LocalDirStore(ckpt_dir)).items())]


def prolog(job: JobContext, now: float) -> dict[str, Any]:
    """Prepare the job's checkpoint directory; returns the marker it wrote."""
    assert job.directives.ckpt_dir is not None
    with as_user(job.uid, job.gid):
        return _prolog(job, Path(job.directives.ckpt_dir), now)


def _prolog(job: JobContext, ckpt_dir: Path, now: float) -> dict[str, Any]:
    meta = prepare_directory(ckpt_dir)
    resumes = newest(ckpt_dir) if job.restart > 0 else []
    marker = {
        "cluster": job.cluster, "job_id": job.job_id, "restart": job.restart,
        "node": job.node, "at": now, "directives": job.directives.as_options(),
        "newest": [asdict(n) for n in resumes],
    }
    write_json(meta / f"prolog-{job.tag}-{job.restart}.json", marker)
    return marker


# --- epilog --------------------------------------------------------------------------------

def end_reason(prolog_restart: int | None, job: JobContext) -> str:
    """Why an incarnation ended: Slurm counts the restart before the epilog runs."""
    if prolog_restart is not None and job.restart > prolog_restart:
        return "requeued"
    return "completed" if job.exit_code in ("", "0", "0:0") else "failed"


def epilog(job: JobContext, protected: Protection, now: float,
           judge: Callable[[Protection, str | None], Protection] | None = None,
           cluster_store: ClusterStore | None = None) -> dict[str, Any]:
    """Record the incarnation's end and final checkpoint, and whether checkpoint-sync
    replicates the directory: `protected` as the configuration says, then as `judge`
    finds from checkpoint-sync's state, given the final checkpoint's run
    (slurm_geo.sync.truth, read beforehand); returns the record written. A job whose
    FederatedRun left its run's record in the directory has its final checkpoint in
    `cluster_store`, and is judged by that store's replication instead."""
    assert job.directives.ckpt_dir is not None
    with as_user(job.uid, job.gid):
        return _epilog(job, Path(job.directives.ckpt_dir), protected, now, judge,
                       cluster_store)


def _epilog(job: JobContext, ckpt_dir: Path, protected: Protection, now: float,
            judge: Callable[[Protection, str | None], Protection] | None = None,
            cluster_store: ClusterStore | None = None) -> dict[str, Any]:
    meta = prepare_directory(ckpt_dir)
    prolog_restart = _last_prolog_restart(meta, job)
    federated = _federated_final(job, ckpt_dir, cluster_store)
    if federated is not None:
        found, protected, judge = federated
    else:
        final = final_checkpoint(ckpt_dir)
        found = None if final is None else {"run": final[0], "step": final[1]}
    if judge is not None:
        protected = judge(protected, None if found is None else found["run"])
    sync: dict[str, Any] = {"root": protected.root, "replicated": True, "as": protected.how} \
        if protected.replicated else {"root": None, "replicated": False, "why": protected.how}
    if protected.note:
        sync["note"] = protected.note
    entry = {
        "restart": prolog_restart if prolog_restart is not None else job.restart,
        "node": job.node, "ended_at": now, "reason": end_reason(prolog_restart, job),
        "exit_code": job.exit_code,
        "final_checkpoint": found,
        "sync": sync,
    }
    record_path = meta / f"job-{job.tag}.json"
    record = read_json(record_path)
    if not isinstance(record, dict) or not isinstance(record.get("incarnations"), list):
        record = {"cluster": job.cluster, "job_id": job.job_id, "incarnations": []}
    record["incarnations"] = [i for i in record["incarnations"] if isinstance(i, dict)
                              and i.get("restart") != entry["restart"]] + [entry]
    write_json(record_path, record)
    for staged in meta.glob(f"staging-{job.tag}-*"):  # an earlier release's prolog's
        shutil.rmtree(staged, ignore_errors=True)
    if not protected.replicated:
        log.info("job %s: checkpoint-sync does not replicate %s (%s); its checkpoints stay "
                 "on this cluster only", job.tag, ckpt_dir, protected.how)
    return record


def _federated_final(job: JobContext, ckpt_dir: Path, cluster_store: ClusterStore | None
                     ) -> tuple[dict[str, Any] | None, Protection, Any] | None:
    """(final checkpoint, protection, judge) of the run a FederatedRun recorded in the
    directory, read from the store it saves to; None when no run was recorded."""
    record = places.read_record(ckpt_dir, job.cluster, job.job_id)
    if record is None:
        return None
    if cluster_store is None:
        final = places.final_from_record(record, "", "", None)
        return final.as_json(), Protection(None, False, "no slurm-geo config on this node "
                                           "names the run's store"), None
    final = places.final_from_record(record, cluster_store.name, cluster_store.url,
                                     places.listed_steps(cluster_store.url, record.run))
    if final.source == "trainer" and record.store_url != cluster_store.url:
        return final.as_json(), Protection(None, False, final.note), None
    return final.as_json(), cluster_store.protected, cluster_store.judge


def _last_prolog_restart(meta: Path, job: JobContext) -> int | None:
    restarts = []
    for marker in meta.glob(f"prolog-{job.tag}-*.json"):
        tail = marker.stem.rsplit("-", 1)[-1]
        # Only the user's own markers count (jobrecords.read_json): a name alone is not one.
        if tail.isdigit() and int(tail) <= job.restart and read_json(marker) is not None:
            restarts.append(int(tail))
    return max(restarts, default=None)


# --- files ---------------------------------------------------------------------------------

def write_json(path: Path, value: Any) -> None:
    """Atomically: temp file, fsync, rename, fsync the directory."""
    write_atomic(path, json.dumps(value, indent=1, sort_keys=True) + "\n")


def read_json(path: Path) -> Any:
    """A record of whoever reads it (the job's user), else None: jobrecords.read_json."""
    return jobrecords.read_json(path)
