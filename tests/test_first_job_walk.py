"""docs/training.md's first geo job, walked end to end as alice from her login shell on the
real sandbox (issue 29, "Done when"): the page's own trainer and job script, submitted with
plain `sbatch` and a two-minute time limit; watched with `slurm-geo status` and `logs`;
requeued by its time limit (Slurm's warning signal, a final checkpoint, a planned requeue)
and resumed from that checkpoint; cancelled with her own `scancel`, which the federation
daemon takes for a cancel (never restarted, audited as hers); `slurm-geo resubmit` of the
cancelled job refused in one line (a cancel is final: only a failed job is resubmitted);
`ckpt ls` of her run, `ckpt pull` to `.pt`, loaded with `torch.load(weights_only=True)`.
bob's `status`, `logs`, `cancel`, `resubmit`, `ckpt ls` and `ckpt pull` of alice's job and
run are each refused in one line, without a traceback."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_geo.exitcodes import ExitCode
from slurm_geo.sandbox import Sandbox, login
from slurm_geo.sandbox.users import ALICE, BOB, SandboxUser
from tests.helpers import eventually
from tests.kit.docs import first_job_blocks
from tests.kit.sandbox import user_dir

pytestmark = [pytest.mark.sandbox, pytest.mark.slow, pytest.mark.timeout(1800)]

# The page's trainer trains 40 steps: here long enough that no incarnation finishes before
# its time limit's warning (the walk cancels the job once it resumed from a checkpoint).
# Its defaults, not arguments of the job script: the daemon's resubmissions do not carry
# sbatch's script arguments.
PAGE_DEFAULTS = "def main(run_name, total_steps=40, ckpt_every=10):"
LONGER = "def main(run_name, total_steps=10**7, ckpt_every=2000):"


def login_shell(sandbox: Sandbox, person: SandboxUser, command: str,
                timeout_s: float = 120) -> subprocess.CompletedProcess:
    """`su - PERSON -c COMMAND`: their login shell (the site's profile.d), nothing of root's
    environment."""
    login.ensure_profile(sandbox.layout, sandbox.env_lines(sandbox.layout.onprem.name, False))
    return subprocess.run(["su", "-", person.name, "-c", command], capture_output=True,
                          text=True, timeout=timeout_s, check=False,
                          env={"PATH": "/usr/bin:/bin"})


def geo(sandbox: Sandbox, person: SandboxUser, *args: str,
        cwd: Path | None = None) -> subprocess.CompletedProcess:
    where = f"cd {shlex.quote(str(cwd))} && " if cwd else ""
    return login_shell(sandbox, person, where + shlex.join(["slurm-geo", *args]))


def ok(done: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert done.returncode == 0, (done.args, done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    return done


def one_line_refusal(done: subprocess.CompletedProcess, code: ExitCode) -> str:
    assert done.returncode == code, (done.args, done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("slurm-geo: error: "), done.stderr
    return lines[0]


def incarnations(out: Path) -> list[dict[str, int]]:
    """The trainer's lines in first.out (opened for append), one dict per incarnation."""
    found: list[dict[str, int]] = []
    for line in (out.read_text() if out.exists() else "").splitlines():
        if m := re.fullmatch(r"started at step (\d+)", line):
            found.append({"started": int(m[1])})
        elif (m := re.fullmatch(r"final step (\d+)", line)) and found:
            found[-1]["final"] = int(m[1])
    return found


def page_job(sandbox: Sandbox, name: str) -> Path:
    """A fresh directory of alice's with the page's train.py (trained longer) and first.sh."""
    trainer, script = first_job_blocks()
    assert trainer.count(PAGE_DEFAULTS) == 1, "the page's trainer changed its defaults"
    work = user_dir(sandbox, ALICE, name)
    for file, body in (("train.py", trainer.replace(PAGE_DEFAULTS, LONGER)),
                       ("first.sh", script)):
        (work / file).write_text(body)
        (work / file).chmod(0o644)
        os.chown(work / file, ALICE.uid, ALICE.uid)
    return work


@pytest.fixture(scope="module")
def daemon_runs_this_checkout(sandbox: Sandbox) -> None:
    """The federation daemon at home runs this checkout's code: `up` copies it into the
    site Python and starts the stopped daemon again (as tests/test_owner_verbs.py)."""
    from slurm_geo.sandbox.sites import Site
    from slurm_geo.sandbox.stages import federation_daemon_name

    sandbox.processes.stop(federation_daemon_name(Site.HOME))
    sandbox.up(progress=lambda _msg: None)


def test_alice_walks_the_first_geo_job_page_and_bob_is_refused(sandbox, site, request,
                                                              daemon_runs_this_checkout):
    import torch

    from slurm_geo.federation.state.audit import AuditLog
    from slurm_geo.federation.state.sqlite import FederationState
    from slurm_geo.slurm import CliSlurmClient
    from slurm_geo.slurm.models import JobState

    work = page_job(sandbox, request.node.name)
    out = work / "first.out"
    onprem = CliSlurmClient("onprem", sandbox.layout.onprem.slurm_conf, timeout_s=10)

    # submit: the page's job script with plain sbatch, a two-minute limit of her own (the
    # warning comes 60 s before it: a one-minute limit would signal Python before it runs)
    submitted = ok(login_shell(sandbox, ALICE, f"cd {work} && sbatch --parsable --time=2 "
                                               "first.sh"))
    job_id = int(submitted.stdout.strip().split(";")[0])
    logical, run = f"onprem-{job_id}", f"first-{job_id}"
    try:
        # watch: status and logs, hers, as soon as it trains
        eventually(lambda: incarnations(out), lambda seen: len(seen) >= 1, 300, 2)
        shown = eventually(lambda: geo(sandbox, ALICE, "status", logical),
                           lambda d: d.returncode == 0, 120, 2)
        assert shown.stdout.startswith(f"{logical}  run {run}"), shown.stdout
        logs = ok(geo(sandbox, ALICE, "logs", logical))
        assert logs.stdout.startswith(f"==> onprem:{job_id} generation 0"), logs.stdout
        assert "started at step 0" in logs.stdout
        mine = json.loads(ok(geo(sandbox, ALICE, "status", "--json")).stdout)
        assert logical in [v["logical_job"] for v in mine]

        # bob, while it runs: he sees none of it and may do nothing to it
        theirs = json.loads(ok(geo(sandbox, BOB, "status", "--json")).stdout)
        assert logical not in [v["logical_job"] for v in theirs]
        for verb in ("status", "logs", "cancel"):
            line = one_line_refusal(geo(sandbox, BOB, verb, logical), ExitCode.NOT_OWNER)
            assert "another user's" in line, line

        # the time limit: a final checkpoint at the warning, a requeue, a resume from it
        seen = eventually(lambda: incarnations(out),
                          lambda s: any(i["started"] > 0 for i in s[1:]), 600, 3)
        assert seen[0]["started"] == 0
        for before, after in zip(seen, seen[1:], strict=False):
            assert before["final"] == after["started"], seen  # nothing trained twice
        assert onprem.job(job_id).restart_count >= 1
        again = json.loads(ok(geo(sandbox, ALICE, "status", logical, "--json")).stdout)
        assert again["status"] == "running", again

        # her scancel is a cancel: the logical job ends cancelled and stays so
        ok(login_shell(sandbox, ALICE, f"scancel {job_id}"))
        cancelled = eventually(
            lambda: json.loads(ok(geo(sandbox, ALICE, "status", logical, "--json")).stdout),
            lambda v: v["status"] != "running", 300, 3)
        assert cancelled["status"] == "cancelled", cancelled
        state = FederationState(site.federation.state, readonly=True)
        time.sleep(30)  # a few of the daemon's rounds: nothing restarts it
        job = state.job(logical)
        assert (job.status.value, job.generation, job.lost_restarts) == ("cancelled", 0, 0)
        assert [i.generation for i in state.incarnations(logical)] == [0]
        assert onprem.job(job_id).state is JobState.CANCELLED
        assert not [j for j in onprem.jobs() if j.name == "first-geo-job"
                    and j.job_id != job_id and not j.state.is_terminal()]
        with AuditLog(site.federation.audit_path, readonly=True) as audit:
            entries = [f"{e.kind}: {e.what}" for e in audit.entries(logical)]
            (cancel,) = [e for e in audit.entries(logical) if e.kind == "cancel"]
        assert (cancel.detail["who"], cancel.detail["via"]) == ("alice", "scancel")
        assert not [k for k in entries if k.startswith(
            ("decision: restart", "finished", "requeue", "resubmit"))], entries

        # resubmit: a cancel is final; the refusal says so in one line
        line = one_line_refusal(geo(sandbox, ALICE, "resubmit", logical),
                                ExitCode.NOT_ACTIONABLE)
        assert "a cancel is final" in line and run in line, line

        # her checkpoints: listed, pulled to .pt and loaded with weights_only=True
        listed = json.loads(ok(geo(sandbox, ALICE, "ckpt", "ls", run, "--store", "pfs",
                                   "--json")).stdout)
        steps = sorted(row["step"] for row in listed)
        assert {row["run"] for row in listed} == {run}
        finals = [i["final"] for i in incarnations(out) if "final" in i]
        assert set(finals) <= set(steps), (finals, steps)
        ok(geo(sandbox, ALICE, "ckpt", "pull", run, "--from", "pfs", "--to", "first.pt",
               cwd=work))
        loaded = ok(login_shell(sandbox, ALICE, f"cd {work} && python -c 'import torch; "
                                "s = torch.load(\"first.pt\", weights_only=True); "
                                "print(sorted(s[\"model\"]))'"))
        assert loaded.stdout.strip() == str(sorted(
            f"{layer}.{p}" for layer in (0, 2) for p in ("bias", "weight"))), loaded.stdout
        state_dict = torch.load(work / "first.pt", weights_only=True)
        assert state_dict["model"]["0.weight"].shape == (32, 16)

        # bob, after: resubmit, ckpt ls and pull of hers are refused too
        line = one_line_refusal(geo(sandbox, BOB, "resubmit", logical), ExitCode.NOT_OWNER)
        assert "another user's" in line, line
        bobs = user_dir(sandbox, BOB, request.node.name)
        for args in (["ckpt", "ls", run, "--store", "pfs"],
                     ["ckpt", "pull", run, "--from", "pfs", "--to", str(bobs / "took.pt")]):
            one_line_refusal(geo(sandbox, BOB, *args), ExitCode.NOT_OWNER)
        assert not (bobs / "took.pt").exists()
    finally:  # an admin's cancel: root's scancel would be a lost job, restarted
        subprocess.run([sys.executable, "-m", "slurm_geo", "cancel", logical, "--config",
                        str(sandbox.layout.site_config)], capture_output=True, timeout=120,
                       check=False)


def test_a_lost_first_job_restarted_at_home_runs_where_alice_submitted_it(
        sandbox, site, request, daemon_runs_this_checkout):
    """root's scancel is a lost job (federation.cancels): the daemon restarts it at home as
    generation 1, in the directory alice ran sbatch in, so the page's `python train.py`
    and `--output=first.out` mean what they meant (in /tmp it failed: no train.py)."""
    from slurm_geo.federation.state.sqlite import FederationState
    from slurm_geo.slurm import CliSlurmClient

    work = page_job(sandbox, request.node.name)
    out = work / "first.out"
    onprem = CliSlurmClient("onprem", sandbox.layout.onprem.slurm_conf, timeout_s=10)
    submitted = ok(login_shell(sandbox, ALICE, f"cd {work} && sbatch --parsable first.sh"))
    job_id = int(submitted.stdout.strip().split(";")[0])
    logical = f"onprem-{job_id}"
    state = FederationState(site.federation.state, readonly=True)
    try:
        eventually(lambda: incarnations(out), lambda seen: len(seen) >= 1, 300, 2)
        eventually(lambda: geo(sandbox, ALICE, "ckpt", "ls", f"first-{job_id}", "--store",
                               "pfs", "--json"),
                   lambda d: d.returncode == 0 and json.loads(d.stdout) != [], 300, 3)
        onprem.cancel(job_id)  # root's: not her cancel, a lost job
        seen = eventually(lambda: incarnations(out),
                          lambda s: len(s) >= 2 and s[1]["started"] > 0, 600, 3)
        job = state.job(logical)
        assert (job.generation, job.cluster, job.status.value) == (1, "onprem", "running")
        assert seen[1]["started"] == job.resume_step
        logs = ok(geo(sandbox, ALICE, "logs", logical)).stdout
        restarted = f"==> onprem:{job.job_id} generation 1: {out} <=="
        assert restarted in logs.splitlines(), logs
    finally:
        subprocess.run([sys.executable, "-m", "slurm_geo", "cancel", logical, "--config",
                        str(sandbox.layout.site_config)], capture_output=True, timeout=120,
                       check=False)
