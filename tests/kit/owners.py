"""alice's training job in the sandbox and the owner verbs run as a user runs them (the
owner-verb and output sandbox tests)."""

from __future__ import annotations

import uuid
from pathlib import Path

from helpers import eventually, sbatch_as

from slurm_geo.drills import drill
from slurm_geo.exitcodes import ExitCode
from slurm_geo.federation.state.sqlite import FederationState
from slurm_geo.sandbox import Sandbox
from slurm_geo.sandbox.sites import Site
from slurm_geo.sandbox.stages import federation_daemon_name
from slurm_geo.sandbox.users import ALICE, SandboxUser, job_environment, run_as
from tests.kit.sandbox import user_dir

SETTINGS = drill.DrillSettings(steps=6000, ckpt_every=40, step_delay_s=0.05)


def geo(sandbox: Sandbox, person: SandboxUser, *args: str, cwd: Path | None = None):
    """`slurm-geo ARGS` as `person` types it: her uid, her login environment."""
    return run_as(person, [str(sandbox.layout.site_python), "-m", "slurm_geo", *args],
                  env=job_environment(sandbox.layout, person), capture_output=True,
                  text=True, timeout=120, check=False, cwd=cwd)


def one_line_refusal(done, code: ExitCode) -> None:
    assert done.returncode == code, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("slurm-geo: error: "), done.stderr


def alices_training_job(sandbox: Sandbox, site, directory: str, trained_steps: int):
    """alice's training job at home, typed with plain sbatch, yielded (logical job, run,
    work directory) once it has trained `trained_steps`, cancelled after unless it ended;
    the daemon runs this checkout's code (started again once the site Python holds it)."""
    sandbox.processes.stop(federation_daemon_name(Site.HOME))
    sandbox.up(progress=lambda _msg: None)
    work = user_dir(sandbox, ALICE, directory)
    run = f"alice-{uuid.uuid4().hex[:8]}"
    trace = work / "trace.log"
    submitted = sbatch_as(sandbox, ALICE, drill.training_script(site, run, SETTINGS, work,
                                                                 trace))
    assert submitted.returncode == 0, submitted.stderr
    job_id = int(submitted.stdout.strip())

    def steps() -> int:
        return max((line.step for line in drill.trace_lines(trace)), default=0)

    eventually(steps, lambda n: n >= trained_steps, 180)
    yield f"onprem-{job_id}", run, work
    state = FederationState(site.federation.state, readonly=True)
    if not state.job(f"onprem-{job_id}").status.is_final():
        geo(sandbox, ALICE, "cancel", f"onprem-{job_id}")
