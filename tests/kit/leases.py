"""The lease tests' job: onprem-1, moved to rented at generation 1 as Slurm job 7, its lease
and its lease request (the keyword builders in tests.kit.builders describe another)."""

from __future__ import annotations

from slurm_geo.federation.model import JobStatus, Lease, LogicalJob
from slurm_geo.lease.protocol import LeaseRequest

TTL = 10.0
NOW = 1000.0


def job(generation=1, cluster="rented", job_id=7, status=JobStatus.RUNNING, move_to=None,
        move_after=None) -> LogicalJob:
    return LogicalJob(logical_job="onprem-1", run="run", home="onprem", script="#!/bin/bash\n",
                      spec={}, directives={}, generation=generation, cluster=cluster, job_id=job_id,
                      resume_step=40, status=status, move_to=move_to, move_after_step=move_after,
                      created_at=0.0, updated_at=0.0)


def lease(generation=1, restart=0, renewed=NOW - 1, released=False, last_step=40) -> Lease:
    return Lease("onprem-1", generation, "rented", 7, restart, renewed, last_step, released)


def ask(generation=1, cluster="rented", job_id=7, restart=0, last_step=40,
        release=False) -> LeaseRequest:
    return LeaseRequest("run", cluster, job_id, restart, generation, last_step, release)
