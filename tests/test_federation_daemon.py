"""The federation daemon's whole loop against in-memory Slurm clusters (FakeSlurm) and
directory stores: registration, outage and failover, the stale incarnation fenced,
failback at a checkpoint, a lost job restarted and given up, a hopeless queue left, a
move awaiting approval, a move cut short by a crash, cancel and resubmit. Seconds, not
minutes; the same paths run against real Slurm in the sandbox tests.

Every lease request is authenticated as lease protocol 2 has it: a home job's with a
credential of a fake munged for its user (alice unless told), an incarnation the daemon
submitted with the secret it was given (tests/test_federation_authn.py: who is refused)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_geo.ckpt import LocalDirStore, Repository
from slurm_geo.federation.model import JobStatus, LeftHome
from slurm_geo.lease.protocol import ENV_GENERATION, ENV_RESUME_STEP
from slurm_geo.slurm import JobState, SlurmRejected
from slurm_geo.slurm.fake import FakeSlurm
from tests.kit.federation import KEY, RUN, TTL, Site, lose_home


@pytest.fixture
def site(tmp_path: Path) -> Site:
    return Site(tmp_path)


def test_a_home_job_registers_at_its_first_lease_and_trains(site):
    job_id = site.home_job_training()
    job = site.job()
    assert (job.logical_job, job.status, job.generation) == (f"onprem-{job_id}",
                                                             JobStatus.RUNNING, 0)
    assert site.lease("onprem", job_id, last_step=10)["action"] == "train"
    assert any(k.startswith("register") for k in site.kinds())


def test_an_outage_moves_the_job_to_its_newest_verified_checkpoint_off_site(site):
    job_id = site.home_job_training()
    site.checkpoint("away", 20)
    site.checkpoint("away", 40)
    site.onprem.go_down()
    site.tick(rounds=2)
    assert site.job().generation == 0  # the lease is still live: it may be training
    assert any("waiting to move until the lease runs out" in k for k in site.kinds())
    site.clock.advance(TTL + 1)
    site.tick()
    job = site.job()
    assert (job.cluster, job.generation, job.resume_step, job.status) == (
        "rented", 1, 40, JobStatus.RUNNING)
    assert (job.left_home, job.recoveries) == (LeftHome.OUTAGE, 1)
    (new_id, spec), = site.rented.submitted
    assert spec.environment[ENV_GENERATION] == "1"
    assert spec.environment[ENV_RESUME_STEP] == "40"
    # The stale home incarnation is refused a lease and, once home answers, cancelled.
    assert site.lease("onprem", job_id, generation=0)["verdict"] == "fenced"
    site.onprem.come_back()
    site.tick(rounds=2)
    assert site.onprem.job(job_id).state is JobState.CANCELLED
    assert site.state.incarnations(job.logical_job)[0].end_reason == "cancelled: fenced"


def test_a_job_away_fails_back_at_its_next_checkpoint_and_its_checkpoint_goes_home(site):
    _, away_id = site.moved_away()
    site.rented.start(away_id)
    assert site.lease("rented", away_id, generation=1)["verdict"] == "grant"
    site.checkpoint("away", 60)
    site.onprem.come_back()
    site.tick(rounds=8)  # home must be up failback_stable_s before the failback is planned
    assert site.job().move_to == "onprem"
    assert site.lease("rented", away_id, generation=1, last_step=60)["action"] == "release"
    site.lease("rented", away_id, generation=1, last_step=60, release=True)
    site.tick()
    job = site.job()
    assert (job.cluster, job.generation, job.resume_step) == ("onprem", 2, 60)
    assert job.left_home is None
    assert Repository(site.stores["pfs"], KEY).steps(RUN) == [60]  # carried home
    assert any(k.startswith("transfer: copied run-a@60 from away to pfs") for k in site.kinds())


def test_a_lost_job_restarts_until_max_restarts_then_gives_up(site):
    job_id = site.home_job_training()
    site.onprem.finish(job_id, JobState.NODE_FAIL)
    site.tick()
    assert site.job().generation == 0  # its lease has not run out yet
    for generation in (1, 2):
        site.clock.advance(TTL + 1)
        site.tick(rounds=2)  # the restart, then the lost incarnation's fence
        job = site.job()
        assert (job.generation, job.cluster, job.lost_restarts) == (generation, "onprem",
                                                                    generation)
        new_id = job.job_id
        site.onprem.start(new_id)
        site.lease("onprem", new_id, generation=generation)
        site.onprem.finish(new_id, JobState.NODE_FAIL)
    site.clock.advance(TTL + 1)
    site.tick()
    assert site.job().status is JobStatus.FAILED
    assert any(k == "decision: give up" for k in site.kinds())


def test_a_job_completed_after_releasing_its_lease_finishes(site):
    job_id = site.home_job_training()
    site.lease("onprem", job_id, last_step=100, release=True)
    site.onprem.finish(job_id)
    site.tick()
    assert site.job().status is JobStatus.COMPLETED


def test_a_hopeless_queue_is_left_for_the_rented_cluster(site):
    job_id = site.submit_home()
    site.onprem.set_expected_start(7200.0)  # home would start it in two hours
    site.tick()
    assert site.job().generation == 0  # queued for less than the margin
    site.clock.advance(120)
    site.tick()
    job = site.job()
    assert (job.cluster, job.generation, job.left_home) == ("rented", 1, LeftHome.QUEUE)
    assert site.onprem.job(job_id).state is JobState.CANCELLED
    (away_id, _), = site.rented.submitted
    site.rented.start(away_id)
    site.lease("rented", away_id, generation=1)
    site.tick(rounds=10)
    assert site.job().move_to is None  # a job that left a queue does not fail back


def test_a_move_without_consent_waits_for_approval(site):
    site.home_job_training(failover="manual")
    site.checkpoint("away", 40)
    lose_home(site)
    site.tick(rounds=3)
    job = site.job()
    assert (job.generation, job.awaiting_approval) == (0, "rented")
    assert sum("needs approval" in k for k in site.kinds()) == 1  # said once
    site.federation.approve(job.logical_job, "rented", "operator")
    site.tick()
    job = site.job()
    assert (job.cluster, job.generation, job.awaiting_approval) == ("rented", 1, None)


def test_an_approval_never_moves_a_job_where_its_policy_forbids(site):
    """Consent is not a way round the site's rules: a job submitted
    --geo-failover=never (or outside its residency, --geo-clusters, an owner with no
    account there: planner.policy_refusal) is refused in one line, nothing planned."""
    from slurm_geo.federation.model import NotActionable

    site.home_job_training(failover="never")
    site.checkpoint("away", 40)
    logical = site.job().logical_job
    with pytest.raises(NotActionable, match="may not move to rented: --geo-failover=never"):
        site.federation.approve(logical, "rented", "operator")
    assert site.job().move_to is None
    assert not [k for k in site.kinds() if "approv" in k]


def test_a_move_cut_short_by_a_crash_is_finished_by_the_next_daemon(site):
    site.home_job_training()
    site.checkpoint("away", 40)
    lose_home(site)
    logical = site.job().logical_job
    site.state.begin_generation(logical, 0, "rented", 40, site.clock())  # then killed
    site.restart()
    site.tick()
    job = site.job()
    assert (job.status, job.generation, job.resume_step) == (JobStatus.RUNNING, 1, 40)
    assert len(site.rented.submitted) == 1


def test_a_submission_refused_is_audited_and_retried(site):
    site.home_job_training()
    site.checkpoint("away", 40)
    lose_home(site)
    site.rented.reject_next_submit("QOSMaxSubmitJobPerUserLimit")
    site.tick()
    assert site.job().status is JobStatus.MOVING
    assert any("could not be submitted on rented" in k for k in site.kinds())
    site.tick()
    assert site.job().status is JobStatus.RUNNING


def test_a_moved_job_that_dies_before_its_first_lease_says_so(site):
    _, away_id = site.moved_away()
    site.rented.start(away_id)
    site.rented.finish(away_id, JobState.FAILED, exit_code=127)
    site.tick()
    assert site.job().status is JobStatus.FAILED
    assert any("ended FAILED before its first lease" in k for k in site.kinds())


class RenewsDuringVerify:
    """The away store, whose first read lets the frozen trainer at home renew its lease,
    as a thawed process would while the daemon verifies a large checkpoint."""

    def __init__(self, inner: LocalDirStore, renew):
        self.inner, self.renew, self.renewed = inner, renew, False

    def get(self, name: str) -> bytes:
        if not self.renewed:
            self.renewed = True
            self.renew()
        return self.inner.get(name)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def test_a_lease_renewed_while_the_move_verifies_abandons_the_move(site):
    job_id = site.home_job_training()
    site.checkpoint("away", 40)
    lose_home(site)
    away = RenewsDuringVerify(site.stores["away"], lambda: site.lease("onprem", job_id))
    site.federation.wiring.paced_stores["away"] = away
    site.tick()
    assert away.renewed
    job = site.job()
    assert (job.generation, job.cluster, job.status) == (0, "onprem", JobStatus.RUNNING)
    assert site.rented.submitted == []
    assert any(k == "decision: move to rented abandoned" for k in site.kinds())


def test_metrics_gauges_are_set_afresh_each_round(site):
    from slurm_geo.federation.daemon.service import Metrics

    metrics = Metrics()
    job_id = site.home_job_training()
    metrics.observe(site.federation)

    def jobs(status: str) -> float | None:
        return metrics.registry.get_sample_value("slurm_geo_federation_jobs",
                                                 {"status": status})

    assert (jobs("running"), jobs("completed")) == (1.0, 0.0)
    site.lease("onprem", job_id, last_step=100, release=True)
    site.onprem.finish(job_id)
    site.tick()
    site.onprem.go_down()
    site.tick()
    metrics.observe(site.federation)
    assert (jobs("running"), jobs("completed")) == (0.0, 1.0)
    nodes = metrics.registry.get_sample_value("slurm_geo_federation_nodes_available",
                                              {"cluster": "onprem"})
    assert nodes is None  # no probe of it answered this round


class EnvironmentRecordedLate:
    """slurmdbd records a job's environment a few seconds after its submission: the first
    `rounds` reads of it fail, as `sacct --env-vars` does before the record exists."""

    def __init__(self, inner: FakeSlurm, rounds: int):
        self.inner, self.rounds = inner, rounds

    def batch_environment(self, job_id: int) -> dict[str, str]:
        if self.rounds > 0:
            self.rounds -= 1
            raise SlurmRejected("onprem", "read the batch environment", "no record yet")
        return self.inner.batch_environment(job_id)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def test_a_pending_job_recorded_late_is_still_registered_and_leaves_the_queue(site):
    site.federation.wiring.clients["onprem"] = EnvironmentRecordedLate(site.onprem, rounds=2)
    job_id = site.submit_home()
    site.onprem.set_expected_start(7200.0)
    site.tick(rounds=2)
    assert site.state.jobs() == []  # not recorded yet: looked at again, not given up
    site.tick()
    assert site.job().job_id == job_id
    site.clock.advance(120)
    site.tick()
    assert (site.job().cluster, site.job().left_home) == ("rented", LeftHome.QUEUE)


def test_a_store_rolled_back_under_a_job_is_said_and_never_resumed_from(site):
    """Issue 28: the provider of the store a job away writes to deletes its newest
    checkpoint and pointer. The daemon resumed the run from step 40 there, so a restart
    from the 20 that is left would silently lose steps: it is said once, and not done."""
    site.home_job_training()
    site.checkpoint("away", 20)
    site.checkpoint("away", 40)
    lose_home(site)
    site.tick()
    (away_id, _), = site.rented.submitted
    assert site.job().resume_step == 40
    away = site.stores["away"]
    away.delete("manifests/run-a/00000000000000000040")  # the provider's doing
    away.delete("latest/run-a")
    site.rented.start(away_id)
    site.lease("rented", away_id, generation=1)
    site.rented.finish(away_id, JobState.NODE_FAIL)
    site.clock.advance(TTL + 1)
    site.tick(rounds=3)
    job = site.job()
    assert (job.generation, job.resume_step) == (1, 40)  # no incarnation from step 20
    assert len(site.rented.submitted) == 1
    said = [e for e in site.federation.audit.entries() if "rolled back" in e.what]
    assert len(said) == 1 and "holds checkpoints up to step 20" in said[0].why
    assert "step 40 was saved" in said[0].why and "\n" not in said[0].why
