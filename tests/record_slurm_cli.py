"""Record what Slurm 24.11's commands print into tests/data/slurm-24.11.

Run as root from the checkout: `PYTHONPATH=. python tests/record_slurm_cli.py [DIR]`.
Brings up a home cluster on Debian 13's Slurm (sandbox.home24) in DIR (default
/var/tmp/slurm-geo-record-24.11, ports from 27050), runs each command the CLI backend runs
(as its service account, submissions as alice through slurm-geo-submit-as) around one job's
life (submitted held, released, running, requeued, held, cancelled) and two nodes (one
drained), saves each command's argv, exit status, stdout and stderr as JSON, then takes the
cluster down and removes DIR. tests/test_slurm_cli_recorded.py reads them; job ids and times are the
recording's, its times in UTC.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from slurm_geo.sandbox import home24, provider
from slurm_geo.slurm import parse, submit_as
from slurm_geo.slurm.cli_backend import (
    PARSABLE_DELIMITER,
    sbatch_arguments,
    window_queries,
)
from slurm_geo.slurm.models import DEFAULT_JOB_PATH, JobSpec, Owner

OUT = Path(__file__).parent / "data" / "slurm-24.11"
ALICE = Owner("alice", 2001, 2001)
SPEC = JobSpec(script="#!/bin/bash\necho started\nsleep 300\n", name="rec-24.11",
               working_dir=Path("/home/alice"), environment={"GEO_RECORDED": "yes"}, owner=ALICE,
               time_limit_minutes=10, requeue=True, signal="B:USR1@60",
               output="/home/alice/rec-%j.out", hold=True, comment="c1")


class Recorder:
    def __init__(self, home: provider.ProviderSite):
        self.prefix = home24.command_prefix(home)
        self.root_prefix = home24.command_prefix(home, as_root=True)
        self.env = {"PATH": DEFAULT_JOB_PATH, "SLURM_CONF": str(home24.SLURM_CONF),
                    "TZ": "UTC"}

    def run(self, name: str, argv: list[str], stdin: bytes | None = None,
            as_root: bool = False) -> str:
        prefix = self.root_prefix if as_root else self.prefix
        done = subprocess.run([*prefix, *argv], input=stdin, capture_output=True,
                              env=self.env, timeout=60, check=False)
        stdout = done.stdout.decode()
        doc = {"argv": argv, "rc": done.returncode, "stdout": stdout,
               "stderr": done.stderr.decode()}
        (OUT / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
        return stdout

    def submit(self, name: str, extra: list[str]) -> str:
        data = submit_as.request(ALICE, home24.SLURM_CONF, [*extra, *sbatch_arguments(SPEC)],
                                 {"PATH": DEFAULT_JOB_PATH, **SPEC.environment}, SPEC.script)
        return self.run(name, [str(home24.HELPER)], stdin=data)


def wait_state(rec: Recorder, job_id: int, state: str) -> None:
    for _ in range(60):
        out = subprocess.run([*rec.prefix, "squeue", "-h", "-j", str(job_id), "-o", "%T"],
                             capture_output=True, text=True, env=rec.env, check=False).stdout
        if out.strip() == state:
            return
        time.sleep(0.5)
    raise SystemExit(f"job {job_id} never reached {state}")


def record(rec: Recorder) -> None:
    began = datetime.now(UTC)
    rec.run("ping", ["scontrol", "ping"])
    rec.run("version", ["sbatch", "--version"])
    job_id = parse.submitted_job_id(rec.submit("sbatch-parsable", ["--parsable"]))
    rec.run("squeue-held", ["squeue", "--json", "--states=all"])
    rec.run("release", ["scontrol", "release", str(job_id)])
    wait_state(rec, job_id, "RUNNING")
    rec.run("squeue-running", ["squeue", "--json"])
    rec.submit("sbatch-test-only", ["--test-only"])
    rec.run("batch-script", ["scontrol", "write", "batch_script", str(job_id), "-"])
    time.sleep(3)  # the job's record reaches slurmdbd
    rec.run("sacct-env-vars", ["sacct", "--env-vars", "--noheader", f"--jobs={job_id}"])
    rec.run("sacct-env-vars-none", ["sacct", "--env-vars", "--noheader", "--jobs=999999"])
    rec.run("requeue", ["scontrol", "requeue", str(job_id)])
    time.sleep(1)
    rec.run("squeue-requeued", ["squeue", "--json", "--states=all"])
    rec.run("hold", ["scontrol", "hold", str(job_id)])
    rec.run("update-comment", ["scontrol", "update", f"JobId={job_id}", "Comment=held"])
    rec.run("squeue-admin-held", ["squeue", "--json", "--states=all"])
    rec.run("cancel", ["scancel", "--verbose", str(job_id)])
    rec.run("cancel-unknown", ["scancel", "--verbose", "999999"])
    rec.run("requeue-unknown", ["scontrol", "requeue", "999999"])
    # Draining is an admin's (slurm_geo.slurm.admin, as root); an operator may not.
    rec.run("drain-as-operator", ["scontrol", "update", f"NodeName={home24.CLUSTER}-n2",
                                  "State=DRAIN", "Reason=recorded drain"])
    rec.run("drain", ["scontrol", "update", f"NodeName={home24.CLUSTER}-n2", "State=DRAIN",
                      "Reason=recorded drain"], as_root=True)
    rec.run("sinfo-drained", ["sinfo", "--json"])
    rec.run("resume", ["scontrol", "update", f"NodeName={home24.CLUSTER}-n2", "State=RESUME"],
            as_root=True)
    time.sleep(3)
    rec.run("squeue-cancelled", ["squeue", "--json", "--states=all"])
    rec.run("sacct-jobs", ["sacct", "--json", "--duplicates", "--allusers", "--allocations",
                           f"--jobs={job_id}"])
    end = datetime.now(UTC) + timedelta(seconds=5)
    plain, ended = window_queries(parse.sacct_parsable_argv(PARSABLE_DELIMITER), began, end)
    rec.run("sacct-parsable", plain)
    rec.run("sacct-parsable-ended", ended)
    rec.run("sinfo", ["sinfo", "--json"])


def main() -> None:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/var/tmp/slurm-geo-record-24.11")
    home = home24.site(root, 27050)
    if root.exists():  # a fresh cluster: job ids from 1, no other job in the windows
        provider.down(home)
        shutil.rmtree(root)
    home24.up(home, progress=print)
    try:
        OUT.mkdir(parents=True, exist_ok=True)
        record(Recorder(home))
    finally:
        provider.down(home)
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
