"""The sandbox's main job for now: one batch job of alice's on each cluster, read back from
accounting."""

from __future__ import annotations

import time
from collections.abc import Callable

from slurm_geo.config import SiteConfig
from slurm_geo.errors import SlurmGeoError
from slurm_geo.sandbox.users import ALICE
from slurm_geo.slurm import AccountingRecord, JobSpec, JobState, SlurmClient, connect

JOB_SCRIPT = "#!/bin/bash\necho \"hello from $SLURM_CLUSTER_NAME on $(hostname)\"\nsleep 1\n"
WAIT_S = 120


def run_job_on_each_cluster(
    site: SiteConfig, progress: Callable[[str], None] = lambda _msg: None
) -> list[AccountingRecord]:
    """Submit one small job per cluster, wait for all, return their accounting rows."""
    submitted: list[tuple[SlurmClient, int]] = []
    for cluster in site.clusters.values():
        client = connect(cluster)
        spec = JobSpec(script=JOB_SCRIPT, name="slurm-geo-hello", time_limit_minutes=5,
                       output="/dev/null", owner=ALICE.owner)
        job_id = client.submit(spec)
        progress(f"{cluster.name}: submitted job {job_id} as {ALICE.name} ({cluster.access})")
        submitted.append((client, job_id))
    return [record for client, job_id in submitted
            for record in _wait_for_accounting(client, job_id)]


def _wait_for_accounting(client: SlurmClient, job_id: int) -> list[AccountingRecord]:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        records = client.accounting([job_id])
        last = records[-1] if records else None
        if last and last.state.is_terminal() and last.end_time and last.settled:
            return records
        time.sleep(1)
    raise SlurmGeoError(
        f"cluster '{client.cluster}': job {job_id} did not finish within {WAIT_S} s; "
        f"check `squeue` there (state: {client.job(job_id).state.value})"
    )


def all_completed(records: list[AccountingRecord]) -> bool:
    return bool(records) and all(r.state is JobState.COMPLETED for r in records)
