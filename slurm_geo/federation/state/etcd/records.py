"""The federation state's values as the JSON records etcd holds (sealed, by
federation.etcd.kv), and back. Pure.

A record has the fields of its model type under the same names; enums are their values,
an owner is {"user", "uid", "gid"}.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from typing import Any

from slurm_geo.federation.model import (
    ClusterStatus,
    Health,
    Incarnation,
    IncarnationEnd,
    JobStatus,
    Lease,
    LeftHome,
    LogicalJob,
)
from slurm_geo.slurm.models import Owner

Record = dict[str, Any]


def loads(value: bytes) -> Record:
    record = json.loads(value)
    if not isinstance(record, dict):
        raise ValueError("a federation state record is a JSON object")
    return record


def job_record(job: LogicalJob) -> Record:
    record = asdict(job)
    record["status"] = job.status.value
    record["left_home"] = None if job.left_home is None else job.left_home.value
    return record


def job_from(record: Record) -> LogicalJob:
    owner = record["owner"]
    return LogicalJob(**{
        **record, "status": JobStatus(record["status"]),
        "left_home": None if record["left_home"] is None else LeftHome(record["left_home"]),
        "owner": None if owner is None else Owner(owner["user"], owner["uid"], owner["gid"])})


def incarnation_record(incarnation: Incarnation) -> Record:
    return asdict(incarnation)


def incarnation_from(record: Record) -> Incarnation:
    return Incarnation(**{**record, "end_reason": IncarnationEnd.read(record["end_reason"])})


def lease_record(lease: Lease) -> Record:
    return asdict(lease)


def lease_from(record: Record) -> Lease:
    return Lease(**record)


def health_record(health: Health) -> Record:
    return {**asdict(health), "status": health.status.value}


def health_from(record: Record) -> Health:
    return Health(**{**record, "status": ClusterStatus(record["status"])})


def first_incarnation(job: LogicalJob) -> Incarnation:
    """What registering `job` records of the incarnation it is."""
    return Incarnation(job.logical_job, job.generation, job.cluster, job.job_id,
                       job.resume_step, job.created_at, None, None, None)


def moved_on(job: LogicalJob, *, generation: int, cluster: str, resume_step: int | None,
             left_home: LeftHome | None, recovery: bool, now: float) -> LogicalJob:
    """`job` at its next generation, moving to `cluster`: what begin_generation writes.
    Home again clears why it left; elsewhere keeps it unless a new reason is given."""
    return replace(job, generation=generation, cluster=cluster, job_id=None,
                   resume_step=resume_step, status=JobStatus.MOVING, move_to=None,
                   move_after_step=None, awaiting_approval=None,
                   left_home=None if cluster == job.home else (left_home or job.left_home),
                   recoveries=job.recoveries + int(recovery), updated_at=now)
