"""Residency per input on a sandbox (issue 31 item 5): alice's job at home declares a
dataset of data class `restricted` (the sandbox's policy: `home` only) with
--geo-failover=manual; the daemon grants it its tree and seals the domain's residency; the
home job stages it and pins it in its world record; checkpoint-sync copies the run's
checkpoints to `offsite` (region `remote`) but nothing of its world: its row says
refused and why, and `offsite` holds neither the record nor a pack of the domain.
`slurm-geo status JOB` says the job is not movable and why.

Runs on the sandbox SLURM_GEO_SANDBOX_DIR names.
"""

from __future__ import annotations

import json
import os
import time

import pytest
from click.testing import CliRunner

from slurm_geo.drills import drill
from slurm_geo.sandbox import Sandbox
from slurm_geo.sandbox.users import ALICE, job_environment, run_as
from slurm_geo.slurm import JobSpec
from tests.kit.sandbox import user_dir

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

SETTINGS = drill.DrillSettings(steps=400, ckpt_every=20, step_delay_s=0.1)


def test_a_restricted_input_is_never_staged_offsite_and_status_says_why(
        sandbox: Sandbox, monkeypatch) -> None:
    from slurm_geo.cli import cli
    from slurm_geo.config.model import load_config
    from slurm_geo.slurm import connect
    from slurm_geo.sync.worldstate import read_worlds

    site = load_config(sandbox.layout.site_config)
    assert site.sync is not None and site.sync.destination == "offsite"
    onprem = connect(site.cluster("onprem"))
    data = user_dir(sandbox, ALICE, "restricted-data")
    (data / "patients.bin").write_bytes(os.urandom(1 << 20))
    os.chown(data / "patients.bin", ALICE.uid, ALICE.uid)
    out_dir = user_dir(sandbox, ALICE, "restricted-world")
    run = f"restricted-{int(time.time())}"
    work = out_dir / run
    work.mkdir(parents=True, exist_ok=True)
    os.chown(work, ALICE.uid, ALICE.uid)
    script = drill.training_script(site, run, SETTINGS, work, work / "trace.log")
    script = script.replace("#SBATCH --geo-failover=auto",
                            f"#SBATCH --geo-failover=manual\n"
                            f"#SBATCH --geo-inputs={data}:restricted")
    job_id = onprem.submit(JobSpec(
        script=script, name="geo-residency", working_dir=work, owner=ALICE.owner,
        environment={**job_environment(sandbox.layout, ALICE),
                     "SLURM_GEO_CONFIG": str(site.source)}))
    state = site.sync.state
    try:
        row = drill.wait_for(
            lambda: next((r for r in read_worlds(state, run) if r.refused is not None),
                         None) if len(drill.verified_offsite(site, run)) >= 2 else None,
            time.time() + 300, f"{run}'s checkpoints off-site and its world refused")
        assert not row.complete and "restricted" in row.refused and str(data) in row.refused
        for key, value in sandbox.s3_env().items():
            monkeypatch.setenv(key, value)
        shown = CliRunner().invoke(cli, ["status", f"onprem-{job_id}", "--json",
                                         "--config", str(site.source)])
        assert shown.exit_code == 0, shown.output
        staging = json.loads(shown.stdout)["world_staging"]
        [root] = [r for r in staging["roots"] if r["path"] == str(data)]
        assert root["data_class"] == "restricted" and root["bytes"] == 1 << 20
        assert root["stores"]["offsite"].startswith("refused: data class restricted"), staging
        assert staging["complete_at"] == [] and "may not leave home" in \
            staging["why_not_movable"], staging
        text = CliRunner().invoke(cli, ["status", f"onprem-{job_id}", "--config",
                                        str(site.source)]).stdout
        assert "not movable: its world may not leave home" in text, text
        # alice asks the daemon, which reads the stores for her (never her paths)
        mine = run_as(ALICE, [str(sandbox.layout.site_python.parent / "slurm-geo"), "status",
                              f"onprem-{job_id}", "--json"],
                      env=job_environment(sandbox.layout, ALICE), capture_output=True,
                      text=True, timeout=60)
        assert mine.returncode == 0, mine.stderr
        hers = json.loads(mine.stdout)["world_staging"]
        assert hers["why_not_movable"] == staging["why_not_movable"], hers
    finally:
        onprem.cancel(job_id)
