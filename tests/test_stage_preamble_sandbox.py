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
from slurm_geo.sandbox.users import ALICE, BOB
from slurm_geo.slurm import JobSpec, JobState
from tests.helpers import teed_trainer, with_directive
from tests.kit.sandbox import user_dir

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
        script = with_directive(script, f"--geo-outputs={work}/out")
        job_id = onprem.submit(drill.job_spec(site, sandbox.layout, script, work))
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


WORLD_SETTINGS = drill.DrillSettings(steps=240, ckpt_every=40, step_delay_s=0.25)


def test_a_job_moved_off_a_lost_cluster_reads_its_staged_input_at_its_home_path(
        sandbox: Sandbox) -> None:
    """The whole path of a world: alice's job at home declares a dataset only her account
    at home may read; it stages it (stage.home) and checkpoint-sync copies it and the
    run's world record to rented's store; onprem is lost; the daemon resubmits on the
    provider through the wrapper; the preamble materialises the pinned snapshot as
    geo-alice, presents it, and the script hashes the dataset at its home path (or
    $SLURM_GEO_WORLD_ROOT's), and so does the task of an srun step (in the world step's
    world of its node): byte-identical; training ends bit-identical."""
    import hashlib

    from slurm_geo.config.model import load_config
    from slurm_geo.slurm import connect
    from slurm_geo.sync.worldstate import read_worlds, world_offsite

    if not remote_site.is_provider(sandbox.layout):
        pytest.skip("rented is not the provider's machine in this sandbox")
    site = load_config(sandbox.layout.site_config)
    assert site.sync is not None
    state = site.sync.state
    onprem = connect(site.cluster("onprem"))
    data = user_dir(sandbox, ALICE, "world-data")
    tokens = os.urandom(3 << 20)
    (data / "tokens.bin").write_bytes(tokens)
    (data / "tokens.bin").chmod(0o600)
    os.chown(data / "tokens.bin", ALICE.uid, ALICE.uid)
    out_dir = user_dir(sandbox, ALICE, "preamble-world")
    run = f"world-{int(time.time())}"
    work = out_dir / run
    work.mkdir(parents=True, exist_ok=True)
    os.chown(work, ALICE.uid, ALICE.uid)
    script = drill.training_script(site, run, WORLD_SETTINGS, work, work / "trace.log")
    lines, trainer = teed_trainer(with_directive(script, f"--geo-inputs={data}"))
    lines.insert(trainer, f'echo "data-sha $(sha256sum < "$SLURM_GEO_WORLD_ROOT{data}'
                          '/tokens.bin")"')
    # A task of an srun step, which Slurm starts outside the batch step's world (stage.steps)
    lines.insert(trainer, f"srun --ntasks=1 bash -c 'echo \"task-sha $(sha256sum < "
                          f"\"$SLURM_GEO_WORLD_ROOT{data}/tokens.bin\") $SLURM_GEO_WORLD_MODE\"'")
    job_id = onprem.submit(drill.job_spec(site, sandbox.layout, "\n".join(lines) + "\n",
                                          work))
    logical = f"onprem-{job_id}"
    audit = losses.FederationView(site)
    deadline = time.time() + 420
    try:
        drill.wait_for(lambda: world_offsite(read_worlds(state, run), run)
                       and len(drill.verified_offsite(site, run)) >= 2 or None,
                       deadline, f"{run}'s world and two checkpoints off-site")
        killed_at = time.time()
        drill.kill_cluster(sandbox, "onprem")
        moved = drill.wait_for(lambda: drill.audit_entry(audit, "requeue", logical, "rented",
                                                         killed_at), deadline, "the move")
        moved_id = int(moved.detail["job_id"])
        drill.wait_for(lambda: drill.audit_entry(audit, "finished", logical, None,
                                                 killed_at), deadline, "the job to finish")
    finally:
        sandbox.up(progress=lambda _msg: None)  # onprem back
    account_dir = remote_site.operator_path(sandbox.layout, ALICE.name,
                                            remote_site.work_dir(ALICE.name))
    said = (account_dir / f"geo-drill-{moved_id}.slurm.out").read_text()
    assert "slurm-geo: world: namespace (" in said or "slurm-geo: world: mapped (" in said, said
    assert f"data-sha {hashlib.sha256(tokens).hexdigest()}  -" in said, said
    assert f"task-sha {hashlib.sha256(tokens).hexdigest()}  - namespace" in said \
        or f"task-sha {hashlib.sha256(tokens).hexdigest()}  - mapped" in said, said
    assert drill.final_line(said)[1] == drill.reference_weights(WORLD_SETTINGS), said
