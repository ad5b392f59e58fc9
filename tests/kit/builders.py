"""Keyword builders for the records tests make by hand: a logical job, an incarnation, a
lease and a Slurm job's info, each with sane defaults a test overrides by name.

The defaults describe one job, "onprem-7" of run "run-7", running at home on onprem as
Slurm job 7 at generation 0, an hour before `NOW`."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from slurm_geo.federation.model import Incarnation, JobStatus, Lease, LogicalJob
from slurm_geo.slurm.models import JobInfo, JobState

NOW = 1_800_000_000.0
NAME = "onprem-7"
RUN = "run-7"
HOME, CLOUD, EDGE = "onprem", "cloud", "edge"
SCRIPT = "#!/bin/bash\necho 'hi'; echo \"$x\"\n"


def logical_job(**overrides: Any) -> LogicalJob:
    """`LogicalJob` onprem-7, running at home (generation 0, Slurm job 7)."""
    fields: dict[str, Any] = {
        "logical_job": NAME, "run": RUN, "home": HOME, "script": SCRIPT,
        "spec": {"nodes": 2}, "directives": {"--geo-failover": "auto"}, "generation": 0,
        "cluster": HOME, "job_id": 7, "resume_step": None, "status": JobStatus.RUNNING,
        "created_at": NOW - 3600, "updated_at": NOW - 3600}
    return LogicalJob(**{**fields, **overrides})


def incarnation(**overrides: Any) -> Incarnation:
    """onprem-7's generation 0 on onprem, submitted an hour before NOW and training."""
    fields: dict[str, Any] = {
        "logical_job": NAME, "generation": 0, "cluster": HOME, "job_id": 7,
        "resume_step": None, "submitted_at": NOW - 3600, "training_at": NOW - 3500,
        "ended_at": None, "end_reason": None}
    return Incarnation(**{**fields, **overrides})


def lease(**overrides: Any) -> Lease:
    """onprem-7's lease at generation 0, renewed at NOW, no step yet, not released."""
    fields: dict[str, Any] = {
        "logical_job": NAME, "generation": 0, "cluster": HOME, "job_id": 7, "restart": 0,
        "renewed_at": NOW, "last_step": None, "released": False}
    return Lease(**{**fields, **overrides})


def job_info(**overrides: Any) -> JobInfo:
    """Slurm job 7 on onprem, alice's, RUNNING since a minute after it was submitted."""
    submitted = datetime.fromtimestamp(NOW - 3600, UTC)
    fields: dict[str, Any] = {
        "cluster": HOME, "job_id": 7, "name": "train", "state": JobState.RUNNING,
        "reason": "None", "user": "alice", "account": "", "partition": "batch",
        "nodes": "node1", "restart_count": 0, "submit_time": submitted,
        "start_time": datetime.fromtimestamp(NOW - 3540, UTC), "end_time": None,
        "time_limit_minutes": 60, "exit_code": None, "uid": 2001, "gid": 2100}
    return JobInfo(**{**fields, **overrides})
