"""A moved job that declared a world runs through its preamble on the provider's stock Slurm
26.05 (issue 31 item 3): the daemon submits the wrapper (federation.resubmit), which runs
`python3 -m slurm_geo.stage.run` as geo-alice with her script; the preamble asks
nothing (the job never ran at home, a hopeless queue moved it, so it named no run and
staged nothing), says so, and runs the script, whose trainer takes the lease and key as
before and ends bit-identical to an uninterrupted run.

Runs on the sandbox SLURM_GEO_SANDBOX_DIR names (rented must be the provider's machine).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from slurm_geo.drills import drill, losses
from slurm_geo.sandbox import Sandbox, remote_site
from slurm_geo.sandbox.users import ALICE, BOB, job_environment
from slurm_geo.slurm import JobSpec, JobState
from tests.conftest import user_dir

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

SETTINGS = drill.DrillSettings(steps=60, ckpt_every=20, step_delay_s=0.02)


def test_a_queue_move_of_a_job_with_a_world_runs_its_script_through_the_preamble(
        sandbox: Sandbox) -> None:
    from slurm_geo.config.model import load_config
    from slurm_geo.slurm import connect

    if not remote_site.is_provider(sandbox.layout):
        pytest.skip("rented is not the provider's machine in this sandbox")
    site = load_config(sandbox.layout.site_config)
    onprem = connect(site.cluster("onprem"))
    blockers = [onprem.submit(JobSpec(script="#!/bin/bash\nsleep 900\n", name="blocker",
                                      time_limit_minutes=60, cpus_per_task=2,
                                      owner=BOB.owner, output="/dev/null",
                                      working_dir=user_dir(sandbox, BOB, "blockers")))
                for _ in range(2)]
    try:
        out_dir = user_dir(sandbox, ALICE, "preamble")
        run = f"world-{int(time.time())}"
        work = out_dir / run
        work.mkdir(parents=True, exist_ok=True)
        os.chown(work, ALICE.uid, ALICE.uid)
        script = drill.training_script(site, run, SETTINGS, work, work / "trace.log")
        script = script.replace("#SBATCH --geo-failover=auto",
                                f"#SBATCH --geo-failover=auto\n#SBATCH --geo-outputs={work}/out")
        job_id = onprem.submit(JobSpec(
            script=script, name="geo-drill", working_dir=work, owner=ALICE.owner,
            environment={**job_environment(sandbox.layout, ALICE),
                         "SLURM_GEO_CONFIG": str(site.source)}))
        logical = f"onprem-{job_id}"
        audit = losses.FederationView(site)
        deadline = time.time() + 240
        moved = drill.wait_for(lambda: drill.audit_entry(audit, "requeue", logical, "rented",
                                                         0), deadline, "the queue move")
        moved_id = int(moved.detail["job_id"])
        drill.wait_for(lambda: drill.audit_entry(audit, "finished", logical, "rented", 0),
                       deadline, "the job to finish on rented")
        assert onprem.job(job_id).state is JobState.CANCELLED
        account_dir = remote_site.operator_path(sandbox.layout, ALICE.name,
                                                remote_site.work_dir(ALICE.name))
        said = (account_dir / f"geo-drill-{moved_id}.slurm.out").read_text()
        assert "slurm-geo: world: the job named no run has no staged world yet" in said, said
        trained = drill.job_output([Path(account_dir / run)], moved_id, "rented")
        assert drill.final_line(trained)[1] == drill.reference_weights(SETTINGS), trained
    finally:
        for blocker in blockers:
            onprem.cancel(blocker)
