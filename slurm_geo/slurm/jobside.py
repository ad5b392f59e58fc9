"""The Slurm commands a job runs on itself, from inside it (the training side's requeue,
slurm_geo.torch.signals): `scontrol requeue $SLURM_JOB_ID`, after marking the requeue as
planned in the job's comment (`squeue --format=%k`, then `scontrol update Comment=`,
what the user wrote kept: slurm_geo.policy.restarts), so that it never counts toward the
site's max_restarts. They need nothing but the job's own variables (slurm_geo.jobenv).
Failures are logged, never raised: the caller exits EXIT_REQUEUE for the batch script.
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Callable, Mapping
from typing import Any

from slurm_geo.exitcodes import ExitCode
from slurm_geo.jobenv import JobEnv
from slurm_geo.policy.restarts import with_planned_mark

EXIT_REQUEUE = ExitCode.REQUEUE

log = logging.getLogger(__name__)

Runner = Callable[..., "subprocess.CompletedProcess[Any]"]


def requeue_self(env: Mapping[str, str] = os.environ, run: Runner = subprocess.run) -> bool:
    """Ask Slurm to requeue the job this process runs in; False outside Slurm or on failure."""
    job_id = JobEnv.from_environ(env).job_id
    if not job_id:
        log.info("not in a Slurm job (SLURM_JOB_ID is unset); nothing to requeue")
        return False
    _mark_planned(job_id, env, run)
    command = ["scontrol", "requeue", job_id]
    try:
        result = run(command, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("%s failed: %s; exiting %d for the batch script", command, exc, EXIT_REQUEUE)
        return False
    if result.returncode != 0:
        log.warning("%s exited %d: %s; exiting %d for the batch script", command,
                    result.returncode, (result.stderr or "").strip(), EXIT_REQUEUE)
        return False
    log.info("job %s requeued", job_id)
    return True


def _mark_planned(job_id: str, env: Mapping[str, str], run: Runner) -> None:
    """Mark this incarnation's requeue as planned; without the mark it merely counts."""
    restart = JobEnv.from_environ(env).restart_count or "0"
    read = ["squeue", "--noheader", f"--jobs={job_id}", "--format=%k"]
    try:
        shown = run(read, capture_output=True, text=True, timeout=60, check=False)
        current = (shown.stdout or "").strip() if shown.returncode == 0 else ""
        comment = with_planned_mark("" if current == "(null)" else current,
                                    int(restart) if restart.isdigit() else 0)
        update = ["scontrol", "update", f"JobId={job_id}", f"Comment={comment}"]
        marked = run(update, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("marking the requeue of job %s as planned failed: %s; it counts toward "
                    "max_restarts", job_id, exc)
        return
    if marked.returncode != 0:
        log.warning("marking the requeue of job %s as planned failed: %s; it counts toward "
                    "max_restarts", job_id, (marked.stderr or "").strip())
