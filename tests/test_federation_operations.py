"""What people do to a logical job beside the daemon (federation.operations and .output):
name it any way, cancel it, resubmit it once it failed, see it as on-call does, read its
output across incarnations. Against a whole daemon over FakeSlurm (the daemon tests'
`Site`); the display state is a pure table."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from slurm_geo.federation.act.resubmit import ScriptOptions
from slurm_geo.federation.model import (
    ClusterStatus,
    Health,
    Incarnation,
    JobStatus,
    LogicalJob,
    UnknownLogicalJob,
)
from slurm_geo.federation.operator.operations import (
    AmbiguousJobReference,
    Display,
    NotActionable,
    cancel,
    display_state,
    resolve,
    resubmit,
)
from slurm_geo.federation.operator.output import JobOutput, OutputFile, expand, output_file
from slurm_geo.federation.state.sqlite import FederationState
from slurm_geo.slurm import JobInfo, JobSpec, JobState
from slurm_geo.slurm.fake import FakeSlurm
from tests.kit import builders as kit
from tests.kit.federation import TTL, Site, lose_home

# --- helpers ------------------------------------------------------------------------------


@pytest.fixture
def site(tmp_path: Path) -> Site:
    return Site(tmp_path)


def failed_away(site: Site) -> str:
    """A job moved to rented that died there before its first lease: failed."""
    site.moved_away()
    (away_id, _), = site.rented.submitted
    site.rented.start(away_id)
    site.rented.finish(away_id, JobState.FAILED, exit_code=127)
    site.tick()
    job = site.job()
    assert job.status is JobStatus.FAILED
    return job.logical_job


def failed_at_home(site: Site) -> str:
    """A home job lost past max_restarts (2): failed, two lost restarts counted."""
    job_id = site.home_job_training()
    site.onprem.finish(job_id, JobState.NODE_FAIL)
    for generation in (1, 2):
        site.clock.advance(TTL + 1)
        site.tick(rounds=2)
        new_id = site.job().job_id
        site.onprem.start(new_id)
        site.lease("onprem", new_id, generation=generation)
        site.onprem.finish(new_id, JobState.NODE_FAIL)
    site.clock.advance(TTL + 1)
    site.tick()
    job = site.job()
    assert (job.status, job.lost_restarts) == (JobStatus.FAILED, 2)
    return job.logical_job


def audit(site: Site, kind: str) -> list:
    return [e for e in site.federation.audit.entries() if e.kind == kind]


# --- cancel -------------------------------------------------------------------------------


def test_cancel_cancels_every_incarnation_and_fences_the_trainer(site):
    home_id, away_id = site.moved_away()
    site.rented.start(away_id)
    assert site.lease("rented", away_id, generation=1)["verdict"] == "grant"
    site.onprem.come_back()
    site.federation.probe_all()  # home answers again; the stale incarnation is not fenced yet
    report = cancel(site.federation, resolve(site.state, f"rented:{away_id}"), "alice")
    assert [(o.cluster, o.result) for o in report.outcomes] == [("onprem", "cancelled"),
                                                                ("rented", "cancelled")]
    assert site.onprem.job(home_id).state is JobState.CANCELLED
    assert site.rented.job(away_id).state is JobState.CANCELLED
    job = site.job()
    assert job.status is JobStatus.CANCELLED
    assert site.state.lease(job.logical_job).released
    assert site.lease("rented", away_id, generation=1)["verdict"] == "fenced"
    assert [i.end_reason for i in site.state.incarnations(job.logical_job)] == [
        "cancelled", "cancelled"]
    (entry,) = audit(site, "cancel")
    assert (entry.what, entry.why, entry.detail["who"]) == (
        "cancelled at generation 1", "by alice", "alice")
    site.tick(rounds=3)  # the daemon leaves a cancelled job alone
    assert site.job().status is JobStatus.CANCELLED and len(site.rented.submitted) == 1


def test_cancel_reports_what_it_cannot_reach_and_a_second_cancel_finishes_it(site):
    home_id, away_id = site.moved_away()  # home is still out
    report = cancel(site.federation, site.job(), "alice")
    assert [(o.cluster, o.result) for o in report.outcomes] == [("onprem", "not reached"),
                                                                ("rented", "cancelled")]
    assert [f"{o.cluster}:{o.job_id}" for o in report.unreached()] == [f"onprem:{home_id}"]
    assert "not reached: onprem:" in audit(site, "cancel")[0].why
    assert site.lease("onprem", home_id, generation=0)["verdict"] == "fenced"
    site.onprem.come_back()
    site.federation.probe_all()
    again = cancel(site.federation, site.job(), "bob")
    assert [(o.cluster, o.result) for o in again.outcomes] == [("onprem", "cancelled")]
    assert site.onprem.job(home_id).state is JobState.CANCELLED
    assert audit(site, "cancel")[-1].what == "incarnations left open retried"
    with pytest.raises(NotActionable, match="is cancelled; there is nothing to cancel"):
        cancel(site.federation, site.job(), "bob")


def test_the_daemon_cancels_an_older_incarnation_left_open_once_its_cluster_answers(site):
    home_id, _ = site.moved_away()
    cancel(site.federation, site.job(), "alice")
    site.onprem.come_back()
    site.tick(rounds=3)
    assert site.onprem.job(home_id).state is JobState.CANCELLED
    assert [i.end_reason for i in site.state.incarnations(site.job().logical_job)] == [
        "cancelled: fenced", "cancelled"]


def test_the_daemon_cancels_the_current_incarnation_cancel_could_not_reach(site):
    home_id, away_id = site.moved_away()
    site.rented.start(away_id)
    site.rented.go_down()
    site.tick(rounds=2)  # rented is out now
    report = cancel(site.federation, site.job(), "alice")
    assert ("rented", "not reached") in [(o.cluster, o.result) for o in report.outcomes]
    site.rented.come_back()
    site.tick(rounds=3)
    assert site.rented.job(away_id).state is JobState.CANCELLED
    assert site.job().status is JobStatus.CANCELLED


def test_cancel_of_a_final_job_is_one_line(site):
    job_id = site.home_job_training()
    site.lease("onprem", job_id, last_step=100, release=True)
    site.onprem.finish(job_id)
    site.tick()
    with pytest.raises(NotActionable) as raised:
        cancel(site.federation, site.job(), "alice")
    assert str(raised.value).splitlines() == [
        f"logical job onprem-{job_id} is completed; there is nothing to cancel"]
    assert raised.value.exit_code != 0 and audit(site, "cancel") == []


class CancelsOnSubmit:
    """rented, whose next submission first lets a person cancel the job: a cancel that
    lands while the daemon is mid-move."""

    def __init__(self, inner: FakeSlurm, cancel_now):
        self.inner, self.cancel_now = inner, cancel_now

    def submit(self, spec: JobSpec) -> int:
        self.cancel_now()
        return self.inner.submit(spec)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def test_a_cancel_during_a_move_cancels_what_the_move_submits(site):
    site.home_job_training()
    site.checkpoint("away", 40)
    lose_home(site)
    clients = site.federation.wiring.clients
    clients["rented"] = CancelsOnSubmit(site.rented, lambda: cancel(
        site.federation, site.job(), "alice"))
    site.tick()
    (new_id, _), = site.rented.submitted
    assert site.rented.job(new_id).state is JobState.CANCELLED
    assert site.job().status is JobStatus.CANCELLED
    assert any(e.what == f"cancelled rented:{new_id} just submitted"
               for e in audit(site, "requeue"))


# --- resubmit -----------------------------------------------------------------------------


def test_resubmit_starts_a_failed_job_at_home_from_its_newest_verified_checkpoint(site):
    logical = failed_at_home(site)
    site.checkpoint("pfs", 20)
    site.checkpoint("pfs", 30)
    moved = resubmit(site.federation, site.job(), "alice")
    assert (moved.status, moved.generation, moved.cluster, moved.resume_step) == (
        JobStatus.RUNNING, 3, "onprem", 30)
    assert site.job().lost_restarts == 0
    (entry,) = audit(site, "resubmit")
    assert entry.logical_job == logical and entry.why.startswith("by alice")
    assert entry.detail["generation"] == 3


def test_resubmit_away_from_an_out_home_goes_where_the_plan_chooses(site):
    failed_away(site)  # home is still out
    moved = resubmit(site.federation, site.job(), "alice")
    assert (moved.status, moved.generation, moved.cluster, moved.resume_step) == (
        JobStatus.RUNNING, 2, "rented", 40)


def test_resubmit_refuses_a_job_that_has_not_failed(site):
    site.home_job_training()
    with pytest.raises(NotActionable, match="is running; only a failed job can be "
                       "resubmitted"):
        resubmit(site.federation, site.job(), "alice")
    assert site.job().generation == 0 and audit(site, "resubmit") == []


def test_resubmit_of_a_cancelled_job_says_a_cancel_is_final(site):
    site.home_job_training()
    cancel(site.federation, site.job(), "alice")
    with pytest.raises(NotActionable, match="is cancelled, and a cancel is final; to train "
                       "run .* on, submit a new job naming it"):
        resubmit(site.federation, site.job(), "alice")
    assert site.job().status is JobStatus.CANCELLED and audit(site, "resubmit") == []


# --- resolve ------------------------------------------------------------------------------


def add(state: FederationState, logical: str, run: str, cluster: str, job_id: int) -> None:
    state.add_job(LogicalJob(logical_job=logical, run=run, home=cluster, script="#!/bin/bash\n",
                             spec={}, directives={}, generation=0, cluster=cluster, job_id=job_id,
                             resume_step=None, status=JobStatus.RUNNING, created_at=1.0,
                             updated_at=1.0))


@pytest.fixture
def state(tmp_path: Path) -> FederationState:
    state = FederationState(tmp_path / "fed.db")
    add(state, "onprem-7", "run-a", "onprem", 7)
    state.begin_generation("onprem-7", 0, "rented", 40, 2.0)
    state.submitted("onprem-7", 1, 3, "digest", 2.0)
    add(state, "onprem-3", "run-b", "onprem", 3)
    add(state, "onprem-9", "run-c", "onprem", 9)
    add(state, "onprem-10", "run-c", "onprem", 10)
    return state


@pytest.mark.parametrize("ref", ["onprem-7", "onprem:7", "rented:3", "7", "run-a"])
def test_resolve_knows_a_job_by_every_name(state, ref):
    assert resolve(state, ref).logical_job == "onprem-7"


def test_a_bare_slurm_id_of_two_logical_jobs_is_ambiguous(state):
    with pytest.raises(AmbiguousJobReference) as raised:
        resolve(state, "3")
    assert str(raised.value) == ("'3' names more than one logical job: onprem:3 (onprem-3), "
                                 "rented:3 (onprem-7); name one by its logical job id or as "
                                 "CLUSTER:JOBID")
    assert raised.value.exit_code == 2
    with pytest.raises(AmbiguousJobReference, match="onprem-9 .run run-c., onprem-10"):
        resolve(state, "run-c")


@pytest.mark.parametrize("ref", ["onprem-404", "onprem:404", "rented:7", "404", "run-z", ""])
def test_an_unknown_reference_is_one_line(state, ref):
    with pytest.raises(UnknownLogicalJob) as raised:
        resolve(state, ref)
    assert len(str(raised.value).splitlines()) == 1 and raised.value.exit_code == 12


# --- what on-call sees --------------------------------------------------------------------


def job_in(status: JobStatus, cluster: str = "onprem",
           awaiting: str | None = None) -> LogicalJob:
    return LogicalJob(logical_job="onprem-7", run="run-a", home="onprem", script="", spec={},
                      directives={}, generation=1, cluster=cluster, job_id=7, resume_step=40,
                      status=status, awaiting_approval=awaiting)


def health(status: ClusterStatus) -> dict[str, Health]:
    return {"onprem": Health("onprem", status, 0 if status is ClusterStatus.UP else 3, 0.0,
                             None, None if status is ClusterStatus.UP else "ping timed out")}


def slurm(state: JobState, reason: str) -> JobInfo:
    return JobInfo("onprem", 7, "train", state, reason, "u", "a", "batch", "", 0, None, None,
                   None, None, None)


UP, OUT = health(ClusterStatus.UP), health(ClusterStatus.OUT)
HELD = slurm(JobState.PENDING, "JobHeldAdmin")


@pytest.mark.parametrize("job, where, info, shown", [
    (job_in(JobStatus.RUNNING), UP, None, Display("running")),
    (job_in(JobStatus.RUNNING), UP, slurm(JobState.PENDING, "Priority"), Display("running")),
    (job_in(JobStatus.RUNNING), UP, slurm(JobState.RUNNING, "None"), Display("running")),
    (job_in(JobStatus.RUNNING), UP, HELD, Display("held", "JobHeldAdmin")),
    (job_in(JobStatus.MOVING, cluster="rented"), UP, None, Display("moving", "to rented")),
    (job_in(JobStatus.MOVING), OUT, None, Display("moving", "to onprem")),
    (job_in(JobStatus.RUNNING, awaiting="rented"), OUT, None, Display(
        "awaiting-approval", "move to rented: `slurm-geo approve onprem-7 rented`")),
    (job_in(JobStatus.RUNNING), OUT, None, Display("cluster-out",
                                                   "onprem is out: ping timed out")),
    (job_in(JobStatus.RUNNING), OUT, HELD, Display("cluster-out",
                                                   "onprem is out: ping timed out")),
    (job_in(JobStatus.RUNNING, cluster="rented"), OUT, HELD, Display("held", "JobHeldAdmin")),
    (job_in(JobStatus.RUNNING), {}, None, Display("running")),
    (job_in(JobStatus.COMPLETED), OUT, None, Display("completed")),
    (job_in(JobStatus.FAILED), UP, HELD, Display("failed")),
    (job_in(JobStatus.CANCELLED), OUT, None, Display("cancelled")),
])
def test_display_state(job, where, info, shown):
    assert display_state(job, where, info) == shown


# --- where the output is ------------------------------------------------------------------


def incarnation(generation: int, job_id: int | None = 12) -> Incarnation:
    return kit.incarnation(generation=generation, cluster="rented", job_id=job_id,
                           submitted_at=0.0, training_at=None)


def spec(**options) -> dict:
    return ScriptOptions(**options).to_json()


@pytest.mark.parametrize("pattern, job_id, name, user, expanded", [
    ("slurm-%j.out", 12, None, None, "slurm-12.out"),
    ("%x-%j.log", 12, "train", None, "train-12.log"),
    ("/o/%u/%x.%5j", 12, "train", "alice", "/o/alice/train.00012"),
    ("100%%-%x", 12, None, None, "100%-%x"),
    ("%%j %N %j", None, None, None, "%j %N %j"),
    ("it's a 'file'; echo %j", 3, None, None, "it's a 'file'; echo 3"),
])
def test_expand(pattern, job_id, name, user, expanded):
    assert expand(pattern, job_id, name, user) == expanded


@pytest.mark.parametrize("options, generation, where", [
    ({}, 0, OutputFile("slurm-12.out", False)),
    ({"working_dir": "/home/a/run"}, 0, OutputFile("/home/a/run/slurm-12.out", True)),
    ({}, 1, OutputFile("/tmp/slurm-12.out", True)),
    ({"output": "out/%x-%j.txt"}, 1, OutputFile("/tmp/out/onprem-7-12.txt", True)),
    ({"output": "out/%x-%j.txt"}, 0, OutputFile("out/%x-12.txt", False)),
    ({"output": "/logs/%x-%j", "name": "train"}, 0, OutputFile("/logs/train-12", True)),
    ({"working_dir": "rel"}, 1, OutputFile("rel/slurm-12.out", False)),
])
def test_output_file(options, generation, where):
    job = LogicalJob(logical_job="onprem-7", run="r", home="onprem", script="",
                     spec=spec(**options), directives={}, generation=generation, cluster="rented",
                     job_id=12, resume_step=None, status=JobStatus.RUNNING)
    assert output_file(job, incarnation(generation)) == where


@pytest.mark.parametrize("options, generation, cluster, where", [
    # the home job's submit directory, from Slurm's record: a relative --output is there
    ({"output": "first.out", "submit_dir": "/home/a/w"}, 0, "onprem",
     OutputFile("/home/a/w/first.out", True)),
    # and every incarnation on the home cluster runs there again
    ({"output": "first.out", "submit_dir": "/home/a/w"}, 2, "onprem",
     OutputFile("/home/a/w/first.out", True)),
    # away from home that filesystem may not exist: /tmp
    ({"output": "first.out", "submit_dir": "/home/a/w"}, 1, "rented",
     OutputFile("/tmp/first.out", True)),
    # --chdir wins everywhere
    ({"working_dir": "/c", "submit_dir": "/home/a/w"}, 0, "onprem",
     OutputFile("/c/slurm-12.out", True)),
    ({"working_dir": "/c", "submit_dir": "/home/a/w"}, 1, "onprem",
     OutputFile("/c/slurm-12.out", True)),
])
def test_output_file_of_a_job_whose_submit_directory_is_known(options, generation, cluster,
                                                               where):
    job = LogicalJob(logical_job="onprem-7", run="r", home="onprem", script="",
                     spec=spec(**options), directives={}, generation=generation, cluster=cluster,
                     job_id=12, resume_step=None, status=JobStatus.RUNNING)
    at = kit.incarnation(generation=generation, cluster=cluster, job_id=12, submitted_at=0.0,
                         training_at=None)
    assert output_file(job, at) == where


# --- logs -----------------------------------------------------------------------------------


def output_script(out: Path) -> str:
    return ("#!/bin/bash\n#SBATCH --job-name=train\n"
            f"#SBATCH --output={out}/%x-%j.out\n#SBATCH --geo-ckpt-dir=/pfs/run-a\n"
            "#SBATCH --geo-failover=auto\n#SBATCH --geo-clusters=onprem,rented\n"
            "exec python train.py\n")


def training_with_output(site: Site) -> tuple[Path, int]:
    """A home job whose output goes to tmp/out/train-JOBID.out; rented's job ids start
    at 2, so the two incarnations' files differ."""
    out = site.tmp / "out"
    out.mkdir()
    site.rented.submit(JobSpec(script="#!/bin/bash\n"))
    job_id = site.submit_home(output_script(out))
    site.start_home(job_id)
    site.tick()
    assert site.lease("onprem", job_id)["verdict"] == "grant"
    return out, job_id


def move_to_rented(site: Site) -> int:
    site.checkpoint("away", 40)
    lose_home(site)
    site.tick()
    return site.job().job_id


def test_logs_print_each_incarnation_in_order_under_a_header(site):
    out, home_id = training_with_output(site)
    (out / f"train-{home_id}.out").write_text("step 10\nstep 20")
    away_id = move_to_rented(site)
    (out / f"train-{away_id}.out").write_text("started at step 40\n")
    printed: list[str] = []
    JobOutput(site.state, site.job().logical_job, printed.append).print_all()
    assert "".join(printed).splitlines() == [
        f"==> onprem:{home_id} generation 0: {out}/train-{home_id}.out <==",
        "step 10", "step 20",
        f"==> rented:{away_id} generation 1: {out}/train-{away_id}.out <==",
        "started at step 40"]


def test_logs_name_an_incarnation_whose_file_is_not_here(site):
    out, home_id = training_with_output(site)
    away_id = move_to_rented(site)
    (out / f"train-{away_id}.out").write_text("started at step 40\n")
    printed: list[str] = []
    JobOutput(site.state, site.job().logical_job, printed.append).print_all()
    lines = "".join(printed).splitlines()
    assert lines[1] == (f"(cannot be read here yet: {out}/train-{home_id}.out is not written "
                        "yet, or on onprem's filesystem)")
    assert lines[3] == "started at step 40"


def test_logs_follow_moves_to_the_next_incarnation_and_ends_with_the_job(site):
    out, home_id = training_with_output(site)
    home_file = out / f"train-{home_id}.out"
    home_file.write_text("step 10\n")
    printed: list[str] = []
    follower = threading.Thread(target=JobOutput(
        site.state, site.job().logical_job, printed.append).follow, kwargs={"poll_s": 0.01})
    follower.start()
    wait_for(printed, "step 10\n")
    with home_file.open("a") as file:
        file.write("step 20\n")
    wait_for(printed, "step 20\n")
    away_id = move_to_rented(site)
    wait_for(printed, f"==> rented:{away_id} generation 1")
    (out / f"train-{away_id}.out").write_text("started at step 40\n")
    wait_for(printed, "started at step 40\n")
    site.rented.start(away_id)
    site.lease("rented", away_id, generation=1, last_step=60, release=True)
    site.rented.finish(away_id)
    site.tick()
    follower.join(timeout=10)
    assert not follower.is_alive()
    text = "".join(printed)
    assert text.index("step 20") < text.index(f"rented:{away_id}") < text.index("step 40")
    assert site.job().status is JobStatus.COMPLETED


def wait_for(printed: list[str], text: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in "".join(printed):
        assert time.monotonic() < deadline, f"{text!r} never printed: {''.join(printed)!r}"
        time.sleep(0.01)
