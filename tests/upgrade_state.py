"""The state of a small federation, written through the public interfaces, and read back
as plain JSON: tests/data/release-0.1/make_state.py runs `populate_*` with the last
release's code, and test_upgrade.py reads the same files with this one's `readback_*`
and compares. Nothing here may use what the last release lacks."""

from __future__ import annotations

import dataclasses
import enum
import struct
from pathlib import Path
from typing import Any

NOW = 1_800_000_000.0
MOVED, AT_HOME = "onprem-7", "onprem-8"  # a job moved once (generation 1), one at home
HOME, CLOUD = "onprem", "cloud"
TOKEN = "key-token-of-onprem-7-generation-1"  # the state keeps its SHA-256 only
MASTER_KEY = bytes(range(32))  # the tests' master key (tests/etcd_server.py MASTER_KEY)
RUN = "run-7"
ETCD_PREFIX = "/slurm-geo/federation"  # the default [federation] etcd_prefix


def plain(value: Any) -> Any:
    """JSON-ready: dataclasses as dicts, enums as values, tuples as lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, bytes):
        return value.hex()
    return value


# --- the federation state (SQLite or etcd: one interface) ---------------------------------

def populate_federation(state: Any) -> None:
    from slurm_geo.federation.model import (
        ClusterStatus,
        Health,
        JobStatus,
        Lease,
        LeftHome,
        LogicalJob,
        RunOwner,
    )
    from slurm_geo.slurm.models import Owner

    alice = Owner("alice", 2001, 2001)
    for name, job_id in ((MOVED, 7), (AT_HOME, 8)):
        state.add_job(LogicalJob(logical_job=name, run=f"run-{job_id}", home=HOME,
                                 script=f"#!/bin/bash\nsrun train.py  # {name}\n",
                                 spec={"nodes": 2, "gres": "gpu:4"},
                                 directives={"--geo-failover": "auto",
                                             "--geo-ckpt-dir": "/ckpt/x"},
                                 generation=0, cluster=HOME, job_id=job_id, resume_step=None,
                                 status=JobStatus.RUNNING, created_at=NOW - 3600,
                                 updated_at=NOW - 3600))
        state.identities.claim_owner(name, alice, {"PATH": "/usr/bin:/bin", "LANG": "C"})
        state.identities.put_secret(name, 0, f"bootstrap-{name}-0")
    state.put_lease(Lease(AT_HOME, 0, HOME, 8, 0, NOW - 5, 50, False), True)
    # The moved job: planned, moved to the cloud after an outage (generation 1), submitted
    # there as job 42 with a key token, training under its lease; generation 0 ended.
    state.plan_move(MOVED, 0, CLOUD, 100, NOW - 600)
    state.begin_generation(MOVED, 0, CLOUD, 100, NOW - 500, left_home=LeftHome.OUTAGE,
                           recovery=True)
    from slurm_geo.federation.model import token_digest

    state.submitted(MOVED, 1, 42, token_digest(TOKEN), NOW - 490)
    state.identities.put_secret(MOVED, 1, f"bootstrap-{MOVED}-1")
    state.put_lease(Lease(MOVED, 1, CLOUD, 42, 0, NOW - 10, 120, False), True)
    state.end_incarnation(MOVED, 0, "moved: outage", NOW - 495)
    state.put_health(Health(HOME, ClusterStatus.OUT, 4, NOW - 520, NOW - 560, "timeout"))
    state.put_health(Health(CLOUD, ClusterStatus.UP, 0, NOW - 9000, NOW - 5, None))
    state.identities.assign_run(RunOwner(RUN, alice, "root", NOW - 7000))
    state.put_bandwidth_snapshot([{"source": "pfs", "destination": "offsite",
                                   "mb_s": 21.5, "samples": 3}])
    state.put_bandwidth_probe_at(NOW - 300)
    state.put_sync_transfer_id(17)


def readback_federation(state: Any) -> dict[str, Any]:
    from slurm_geo.federation.act.fencing import known_fence

    jobs = {job.logical_job: job for job in state.jobs()}
    token = state.identities.token_owner(TOKEN)
    return {
        "jobs": {name: plain(job) for name, job in sorted(jobs.items())},
        "incarnations": {name: plain(state.incarnations(name)) for name in sorted(jobs)},
        "leases": {name: plain(state.lease(name)) for name in sorted(jobs)},
        "fences": {name: plain(known_fence(job)) for name, job in sorted(jobs.items())},
        "secrets": {f"{name}/{g}": state.identities.secret(name, g)
                    for name in sorted(jobs) for g in range(jobs[name].generation + 1)},
        "token": plain(token),
        "run_owner": plain(state.identities.run_owner(RUN)),
        "health": plain(dict(sorted(state.health().items()))),
        "bandwidth": plain(state.bandwidth_snapshot()),
        "bandwidth_probe_at": state.bandwidth_probe_at(),
        "sync_transfer_id": state.sync_transfer_id(),
    }


# --- the audit log ------------------------------------------------------------------------

def populate_audit(log: Any) -> None:
    log.append("decision", MOVED, "move to cloud", "home out: 4 probes failed")
    log.append("transfer", MOVED, "carried step 100", "3 packs, 12 MB")
    log.append("requeue", None, "refused 403", "a job of another owner")


def readback_audit(log: Any) -> dict[str, Any]:
    entries = [entry.to_json() for entry in log.entries()]
    report = log.verify()
    return {"entries": entries, "head": list(log.head()), "ok": report.ok}


# --- checkpoint-sync's state, the registry, billing --------------------------------------

def populate_sync(state: Any) -> None:
    ids = state.add([{"root": "pfs", "run": RUN, "step": step, "destination": "offsite",
                      "sequence": i, "status": "pending"} for i, step in enumerate((100, 120))],
                    NOW - 100)
    state.set_mark("source:pfs", "cursor-1")
    assert len(ids) == 2


def readback_sync(state: Any) -> dict[str, Any]:
    keep = ("root", "run", "step", "destination", "sequence", "status", "attempts", "bytes")
    return {"replicas": [{k: plain(getattr(r, k)) for k in keep} for r in state.replicas()],
            "mark": state.mark("source:pfs")}


def populate_registry(registry: Any) -> None:
    registry.job_started(HOME, 7, 0, name="train", user="alice", nodes="n[1-2]",
                         directives={"--geo-failover": "auto"}, now=NOW - 3600)
    registry.job_ended(HOME, 7, 0, "0:15", now=NOW - 500)
    registry.job_started(HOME, 8, 0, name="train", user="alice", nodes="n3",
                         directives={}, now=NOW - 3500)


def readback_registry(registry: Any) -> dict[str, Any]:
    return {f"{HOME}:{job_id}": plain(registry.incarnations(HOME, job_id)) for job_id in (7, 8)}


def populate_billing(db: Any) -> None:
    from slurm_geo.billing.db import JOB_COLUMNS, JOB_KEY

    row = {"cluster": HOME, "job_id": 7, "submit_ts": int(NOW) - 3600, "restarts": 0,
           "logical_id": MOVED, "name": "train", "user": "alice", "account": "ml",
           "cost_center": "ml-research", "cost_center_source": "directive",
           "partition": "gpu", "start_ts": int(NOW) - 3590, "end_ts": int(NOW) - 500,
           "elapsed_s": 3090, "cpus": 16, "gpus": 4, "alloc_tres": "gres/gpu=4",
           "state": "REQUEUED", "settled": 1, "flags": "", "as_of": int(NOW)}
    with db.conn:
        db.upsert("jobs", list(JOB_COLUMNS), JOB_KEY, [[row[c] for c in JOB_COLUMNS]])
        db.set_watermark(f"sacct:{HOME}", int(NOW) - 400)


def readback_billing(db: Any) -> dict[str, Any]:
    dump = db.dump()
    return {"jobs": plain(dump.get("jobs")), "watermark": db.watermark(f"sacct:{HOME}")}


# --- a checkpoint store (file://) with a run's key, a checkpoint and a fence -------------

def _repository(root: Path) -> Any:
    from slurm_geo.ckpt import Repository
    from slurm_geo.ckpt.stores.store import LocalDirStore

    return Repository(LocalDirStore(root), MASTER_KEY)


WEIGHTS = struct.pack("<8f", *(0.5 * i for i in range(8)))


def populate_store(root: Path) -> None:
    from slurm_geo.ckpt.format.manifest import Metadata
    from slurm_geo.ckpt.repo.fence import Fence, write_fence
    from slurm_geo.ckpt.repo.repository import Tensor

    repository = _repository(root)
    for step in (100, 120):
        repository.write_checkpoint(
            RUN, [Tensor("model.w", "float32", (8,), WEIGHTS)], b"extra",
            Metadata(step, step, 0, 2.5, "2026-11-29T15:02:11Z", HOME, "7"))
    write_fence(repository, Fence(RUN, 1, CLOUD, 100, "2026-11-29T16:00:00Z"))


def readback_store(root: Path) -> dict[str, Any]:
    from slurm_geo.ckpt.repo.fence import read_fence

    repository = _repository(root)
    steps = repository.steps(RUN)
    checkpoint = repository.read_checkpoint(RUN, steps[-1])
    return {"steps": list(steps), "format": checkpoint.manifest.format,
            "tensors": [[t.path, t.dtype, list(t.shape), bytes(t.data).hex()]
                        for t in checkpoint.tensors],
            "extra_state": checkpoint.extra_state.hex(),
            "fence": plain(read_fence(repository, RUN))}
