"""An owner's verbs on her own job, through the federation daemon (issue 29, item 3), on
the real sandbox: alice, who reads neither the daemon's state nor the master key, sees her
job (`status`, `logs`), lists, verifies and pulls her run's checkpoints (`ckpt ls`,
`verify`, `pull` to .pt, loaded with `torch.load(weights_only=True)`), resubmits and
cancels it, each by MUNGE to the daemon (federation.ownerverbs); bob's attempts at each
are refused in one line with `NOT_OWNER`, and nothing is a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import eventually

from slurm_geo.drills import drill
from slurm_geo.exitcodes import ExitCode
from slurm_geo.federation.state.sqlite import FederationState
from slurm_geo.sandbox import Sandbox
from slurm_geo.sandbox.users import ALICE, BOB
from tests.kit.owners import SETTINGS, alices_training_job, geo, one_line_refusal

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]


@pytest.fixture(scope="module")
def alice_job(sandbox: Sandbox, site):
    yield from alices_training_job(sandbox, site, "owner-verbs", 2 * SETTINGS.ckpt_every)


def test_alice_sees_her_job_and_bob_is_refused(sandbox, alice_job):
    logical_job, run, _work = alice_job
    listed = geo(sandbox, ALICE, "status", "--json")
    assert listed.returncode == 0, listed.stderr
    views = json.loads(listed.stdout)
    assert logical_job in [v["logical_job"] for v in views]
    assert {v["owner"]["user"] for v in views} == {"alice"}  # hers alone
    one = geo(sandbox, ALICE, "status", logical_job)
    assert one.returncode == 0 and one.stderr == "", one.stderr
    assert one.stdout.startswith(f"{logical_job}  run {run}")
    logs = geo(sandbox, ALICE, "logs", logical_job)
    assert logs.returncode == 0 and "Traceback" not in logs.stderr, logs.stderr
    assert logs.stdout.startswith(f"==> onprem:{logical_job.split('-')[1]} generation 0")

    theirs = geo(sandbox, BOB, "status", "--json")
    assert theirs.returncode == 0, theirs.stderr
    assert logical_job not in theirs.stdout
    for verb in ("status", "logs", "cancel", "resubmit"):
        refused = geo(sandbox, BOB, verb, logical_job)
        one_line_refusal(refused, ExitCode.NOT_OWNER)
        assert "another user's" in refused.stderr


def test_alice_lists_verifies_and_pulls_her_run_and_bob_is_refused(sandbox, alice_job):
    import torch

    _logical_job, run, work = alice_job
    listed = geo(sandbox, ALICE, "ckpt", "ls", run, "--store", "pfs", "--json")
    assert listed.returncode == 0, listed.stderr
    steps = [row["step"] for row in json.loads(listed.stdout)]
    assert steps and all(row["run"] == run for row in json.loads(listed.stdout))
    mine = geo(sandbox, ALICE, "ckpt", "ls", "--store", "pfs", "--json")
    assert mine.returncode == 0, mine.stderr
    assert run in {r["run"] for r in json.loads(mine.stdout)}

    verified = geo(sandbox, ALICE, "ckpt", "verify", f"{run}@{steps[0]}", "--store", "pfs")
    assert verified.returncode == 0, verified.stderr
    pulled = geo(sandbox, ALICE, "ckpt", "pull", f"{run}@{steps[0]}", "--from", "pfs",
                 "--to", str(work / "weights.pt"))
    assert pulled.returncode == 0, pulled.stderr
    state = torch.load(work / "weights.pt", weights_only=True)
    assert "model" in state and state["model"]

    for args in (["ckpt", "ls", run, "--store", "pfs"],
                 ["ckpt", "verify", run, "--store", "pfs"],
                 ["ckpt", "pull", run, "--from", "pfs", "--to", "/tmp/bob-took-it.pt"]):
        one_line_refusal(geo(sandbox, BOB, *args), ExitCode.NOT_OWNER)
    assert not Path("/tmp/bob-took-it.pt").exists()


def test_alice_cancels_her_job_and_it_stays_cancelled(sandbox, site, alice_job):
    logical_job, _run, _work = alice_job
    resubmit = geo(sandbox, ALICE, "resubmit", logical_job)  # it runs: nothing to resubmit
    one_line_refusal(resubmit, ExitCode.NOT_ACTIONABLE)
    cancelled = geo(sandbox, ALICE, "cancel", logical_job, "--json")
    assert cancelled.returncode == 0, cancelled.stderr
    report = json.loads(cancelled.stdout)
    assert report["status"] == "cancelled" and report["by"].startswith("alice")
    state = FederationState(site.federation.state, readonly=True)
    assert state.job(logical_job).status.value == "cancelled"
    again = geo(sandbox, ALICE, "status", logical_job, "--json")
    assert json.loads(again.stdout)["status"] == "cancelled"


@pytest.fixture(scope="module")
def approved_job(sandbox: Sandbox, site):
    yield from alices_training_job(sandbox, site, "approved-move", 2 * SETTINGS.ckpt_every)


def test_a_job_moved_off_a_healthy_home_by_approval_stays_where_it_was_moved(
        sandbox, site, approved_job):
    """alice approves her own job's move from her login shell (bob may not); a person's
    move is not undone: before, the daemon planned a failback home at the moved job's
    next checkpoint, 2-3 s after the move (home was healthy all along)."""
    import time

    from slurm_geo.drills import losses
    from slurm_geo.federation.model import LeftHome

    logical_job, _run, _work = approved_job
    audit = losses.FederationView(site)
    began = time.time()
    one_line_refusal(geo(sandbox, BOB, "approve", logical_job, "rented"), ExitCode.NOT_OWNER)
    approved = geo(sandbox, ALICE, "approve", logical_job, "rented")
    assert approved.returncode == 0 and approved.stderr == "", approved.stderr
    assert f"{logical_job}: move to rented approved by alice" in approved.stdout
    deadline = time.time() + 240
    moved = drill.wait_for(lambda: drill.audit_entry(audit, "requeue", logical_job, "rented",
                                                     began), deadline, "the move to rented")
    resumed = moved.detail["resume_step"]

    def lease():
        return FederationState(site.federation.state, readonly=True).lease(logical_job)

    # Two checkpoints on rented: a failback is planned at the first one after a move.
    eventually(lease, lambda held: held is not None and held.generation == 1
               and (held.last_step or 0) >= resumed + 2 * SETTINGS.ckpt_every, 180)
    job = FederationState(site.federation.state, readonly=True).job(logical_job)
    assert (job.cluster, job.left_home, job.move_to) == ("rented", LeftHome.CHOSEN, None)
    assert not [e.what for e in audit.entries(logical_job=logical_job)
                if e.kind == "decision" and "fail back" in e.what]
