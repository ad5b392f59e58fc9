"""Jobs run as their owner: the owner comes from Slurm's job record, the directives from
what Slurm validated (never an indented #SBATCH line), the environment from an
allow-list; every incarnation the daemon submits runs as the owner, with nothing of the
daemon's environment, and a REST cluster that maps the owner to no account is not
eligible. Pure rules first, then the whole daemon over FakeSlurm."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from slurm_geo.config.model import ClusterConfig, RemoteAccount
from slurm_geo.federation.act.registration import NotRegistered
from slurm_geo.federation.decide.owners import (
    accepted_directives,
    owner_environment,
    owner_refusal,
)
from slurm_geo.federation.model import JobStatus, LogicalJob
from slurm_geo.slurm import JobSpec, Owner
from tests.kit.federation import (
    ALICE,
    ALICE_ENV,
    RUN,
    TTL,
    Site,
    directives,
    lose_home,
    rest_site,
    script,
)

BOB = Owner("bob", 2002, 2002)
MARKER = "SLURM_GEO_DAEMON_ONLY_MARKER"

# --- the rules ------------------------------------------------------------------------------


@pytest.mark.parametrize("same_account, expected", [
    (True, {"PATH": "/home/alice/venv/bin:/usr/bin:/bin", "HOME": "/home/alice",
            "USER": "alice", "VIRTUAL_ENV": "/home/alice/venv", "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8", "MODULEPATH": "/etc/modules"}),
    (False, {"PATH": "/home/alice/venv/bin:/usr/bin:/bin",
             "VIRTUAL_ENV": "/home/alice/venv", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
             "MODULEPATH": "/etc/modules"}),
], ids=["same account (CLI)", "another account (REST)"])
def test_the_owners_environment_is_allow_listed(same_account, expected):
    env = {**ALICE_ENV, "CONDA_PREFIX": "/opt/conda", "SLURM_JOB_ID": "5",
           "SBATCH_PARTITION": "x", "SLURM_SPANK_GEO_FAILOVER": "auto", "PROMPT_COMMAND": "x"}
    kept = owner_environment(env, same_account=same_account)
    assert kept == {**expected, "CONDA_PREFIX": "/opt/conda"}


@pytest.mark.parametrize("env, expected", [
    ({"SLURM_SPANK_GEO_CKPT_DIR": "/pfs/a", "SLURM_SPANK_GEO_FAILOVER": "auto",
      "SLURM_GEO_FAILOVER": "never"}, {"geo-ckpt-dir": "/pfs/a", "geo-failover": "auto"}),
    ({"SLURM_GEO_CKPT_DIR": "/pfs/a", "SLURM_GEO_CLUSTERS": "a,b"},
     {"geo-ckpt-dir": "/pfs/a", "geo-clusters": "a,b"}),
    ({"PATH": "/bin", "SLURM_GEO_UNKNOWN": "x"}, {}),
], ids=["SPANK's hand-over first", "else SLURM_GEO_* as job_submit.lua reads", "none"])
def test_the_directives_slurm_accepted_come_from_the_stored_environment(env, expected):
    assert accepted_directives(env) == expected


REST = ClusterConfig("rented", "eu", "rest", rest_url="https://r", rest_user="geo",
                     token_file=Path("/t"),
                     users={"alice": RemoteAccount("geo-alice", Path("/t-alice"))})


@pytest.mark.parametrize("cluster, owner, why", [
    (REST, ALICE, ""),
    (REST, BOB, "no account for bob on rented ([clusters.rented.users] maps none)"),
    (ClusterConfig("onprem", "home", "cli", slurm_conf=Path("/c")), BOB, ""),
    (REST, None, "the job's owner is unknown (registered before slurm-geo recorded owners)"),
])
def test_where_an_owner_can_run(cluster, owner, why):
    assert owner_refusal(cluster, owner) == why


# --- the daemon -----------------------------------------------------------------------------

@pytest.fixture
def site(tmp_path: Path) -> Site:
    return Site(tmp_path)


def test_the_owner_and_environment_come_from_slurms_record_at_registration(site):
    site.home_job_training()
    job = site.job()
    assert job.owner == ALICE
    assert job.owner_env == owner_environment(ALICE_ENV)
    assert "AWS_SECRET_ACCESS_KEY" not in job.owner_env and "EDITOR" not in job.owner_env
    assert job.directives == directives()  # PrologSlurmctld's record
    assert any("of alice" in k for k in site.kinds() if k.startswith("register"))


def test_a_job_slurm_cancelled_is_restarted_as_its_owner(site):
    job_id = site.home_job_training()
    site.onprem.cancel(job_id)  # an admin's scancel: the job ends holding its lease
    site.clock.advance(TTL + 1)
    site.tick(rounds=2)
    job = site.job()
    assert (job.generation, job.cluster) == (1, "onprem")
    (_, restarted), = [s for s in site.onprem.submitted if s[0] == job.job_id]
    assert restarted.owner == ALICE
    assert restarted.environment["PATH"] == ALICE_ENV["PATH"]
    assert restarted.environment["HOME"] == "/home/alice"


def test_a_home_jobs_lease_waits_until_slurmdbd_has_recorded_its_environment(
        site, monkeypatch):
    """slurmdbd records a job seconds after submission: a job that asks for its lease
    sooner is asked to ask again (503, the trainer retries each second), so it registers
    with the environment its later incarnations need."""
    from slurm_geo.slurm import SlurmError
    recorded = site.onprem.batch_environment

    def not_yet(job_id):
        raise SlurmError("slurmdbd keeps no environment for this job yet")
    monkeypatch.setattr(site.onprem, "batch_environment", not_yet)
    job_id = site.submit_home()
    site.start_home(job_id)
    with pytest.raises(NotRegistered, match="slurmdbd has not recorded it yet"):
        site.lease_reply("onprem", job_id)
    assert site.state.jobs() == []
    monkeypatch.setattr(site.onprem, "batch_environment", recorded)
    assert site.lease("onprem", job_id)["verdict"] == "grant"
    assert site.job().owner_env == owner_environment(ALICE_ENV)


def test_a_run_another_user_registered_is_refused_at_once_not_asked_to_wait(site,
                                                                          monkeypatch):
    from slurm_geo.slurm import SlurmError

    bobs = site.onprem.submit(JobSpec(script=script(), owner=BOB))
    site.submitted_directives[bobs] = directives()
    site.start_home(bobs)
    assert site.lease("onprem", bobs, as_user="bob")["verdict"] == "grant"

    def not_yet(job_id):
        raise SlurmError("slurmdbd keeps no environment for this job yet")
    monkeypatch.setattr(site.onprem, "batch_environment", not_yet)
    job_id = site.submit_home()
    site.start_home(job_id)
    reply = site.lease_reply("onprem", job_id)  # bob's run: 403 now, never a 503 first
    assert reply.status == 403
    assert reply.body["reason"] == f"run {RUN} belongs to logical job onprem-{bobs}"


def test_an_environment_slurmdbd_records_after_registration_is_learned_for_restarts(
        site, monkeypatch):
    """A job slurmdbd had not recorded after PENDING_TRIES requests is registered without
    its environment, which the daemon reads again later, so its restart still finds
    `python` on the owner's PATH."""
    from slurm_geo.federation.act import registration
    from slurm_geo.slurm import SlurmError
    recorded = site.onprem.batch_environment

    def not_yet(job_id):
        raise SlurmError("slurmdbd keeps no environment for this job yet")
    monkeypatch.setattr(registration, "PENDING_TRIES", 1)
    monkeypatch.setattr(site.onprem, "batch_environment", not_yet)
    job_id = site.home_job_training()
    assert site.job().owner_env == {}
    monkeypatch.setattr(site.onprem, "batch_environment", recorded)
    site.tick()
    assert site.job().owner_env == owner_environment(ALICE_ENV)
    site.onprem.cancel(job_id)
    site.clock.advance(TTL + 1)
    site.tick(rounds=2)
    (_, restarted), = [s for s in site.onprem.submitted if s[0] == site.job().job_id]
    assert restarted.environment["PATH"] == ALICE_ENV["PATH"]


def test_a_move_during_an_outage_reads_the_environment_slurmdbd_kept(site, monkeypatch):
    """Registered before slurmdbd had its environment, lost seconds later: the move asks
    slurmdbd (which may outlive the controller) once more, so the moved job finds
    `python` on its owner's PATH."""
    from slurm_geo.federation.act import registration
    from slurm_geo.slurm import SlurmError

    def not_yet(job_id):
        raise SlurmError("slurmdbd keeps no environment for this job yet")
    monkeypatch.setattr(registration, "PENDING_TRIES", 1)
    monkeypatch.setattr(site.onprem, "batch_environment", not_yet)
    job_id = site.home_job_training()
    site.checkpoint("away", 40)
    (_, submitted), = [s for s in site.onprem.submitted if s[0] == job_id]
    lose_home(site)
    assert site.job().owner_env == {}
    monkeypatch.setattr(site.onprem, "batch_environment",
                        lambda _job_id: dict(submitted.environment))
    site.tick()
    (_, moved), = site.rented.submitted
    assert moved.environment["PATH"] == ALICE_ENV["PATH"]
    assert not any("default environment" in k for k in site.kinds())


def test_a_moved_job_runs_as_its_owner_without_the_daemons_environment(site, monkeypatch):
    monkeypatch.setenv(MARKER, "daemon-secret")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "daemon-secret")  # file stores: none given
    site.home_job_training()
    site.checkpoint("away", 40)
    lose_home(site)
    site.tick()
    (_, moved), = site.rented.submitted
    assert moved.owner == ALICE
    env = moved.environment
    assert MARKER in os.environ and MARKER not in env
    assert "daemon-secret" not in env.values()
    # Alice's allow-listed variables and what the daemon tells the job, nothing else.
    alices = owner_environment(ALICE_ENV)
    assert {k: v for k, v in env.items() if not k.startswith("SLURM_GEO_")} == alices
    assert env["SLURM_GEO_FAILOVER"] == "auto"  # validated, not alice's own "never"


def test_an_indented_failover_line_sbatch_ignored_has_no_effect(site):
    indented = script().replace("#SBATCH --geo-failover=auto", "  #SBATCH --geo-failover=auto")
    job_id = site.submit_home(indented, failover=None)  # SPANK never saw the line
    site.start_home(job_id)
    site.tick()
    assert site.lease("onprem", job_id)["verdict"] == "grant"
    assert "geo-failover" not in site.job().directives
    site.checkpoint("away", 40)
    lose_home(site)
    site.tick(rounds=2)
    job = site.job()
    assert (job.generation, job.awaiting_approval) == (0, "rented")  # asks, never auto
    assert site.rented.submitted == []


def test_a_pending_job_whose_only_failover_line_is_indented_is_not_registered(site):
    indented = script().replace("#SBATCH --geo-failover=auto", "\t#SBATCH --geo-failover=auto")
    site.submit_home(indented, failover=None)
    site.onprem.set_expected_start(7200.0)
    site.tick(rounds=3)
    assert site.state.jobs() == []


def test_a_job_with_no_directives_recorded_is_no_geo_job_said_once(site, caplog):
    caplog.set_level(logging.WARNING, "slurm_geo.federation")
    plain_env = {k: v for k, v in ALICE_ENV.items() if not k.startswith("SLURM_GEO_")}
    job_id = site.onprem.submit(JobSpec(script=script(), owner=ALICE, environment=plain_env))
    site.onprem.start(job_id)  # no PrologSlurmctld record, no SPANK hand-over
    for _ in range(2):  # the HTTP service answers 503 with the reason
        with pytest.raises(NotRegistered, match="not a geo job for the daemon"):
            site.lease_reply("onprem", job_id)
    assert sum("event=not_registered" in m for m in caplog.messages) == 1
    assert site.state.jobs() == []


def test_the_registry_record_is_enough_without_a_stored_environment(site):
    job_id = site.onprem.submit(JobSpec(script=script(), owner=BOB))  # no job_env flag
    site.submitted_directives[job_id] = directives()
    site.start_home(job_id)
    assert site.lease("onprem", job_id, as_user="bob")["verdict"] == "grant"
    job = site.job()
    assert (job.owner, job.owner_env, job.directives) == (BOB, {}, directives())


def test_a_job_without_a_recorded_owner_is_never_submitted(site):
    now = site.clock()
    site.state.add_job(LogicalJob(logical_job="onprem-77", run="run-a", home="onprem",
                                  script=script(), spec={}, directives=directives(), generation=0,
                                  cluster="onprem", job_id=None, resume_step=None,
                                  status=JobStatus.RUNNING, created_at=now, updated_at=now))
    site.state.begin_generation("onprem-77", 0, "onprem", None, now)  # a move half done
    site.tick(rounds=2)
    assert site.onprem.submitted == [] and site.rented.submitted == []
    assert sum("owner is unknown" in k for k in site.kinds()) == 1


def test_a_rest_cluster_without_an_account_for_the_owner_is_ineligible_and_says_why(
        tmp_path):
    site = rest_site(tmp_path, {"bob": {"account": "geo-bob", "token_file": "/t"}})
    site.home_job_training()
    site.checkpoint("away", 40)
    lose_home(site)
    chosen = site.federation.plan_for(site.job())
    rented = chosen.candidate("rented")
    assert not rented.eligible
    assert rented.why_not == "no account for alice on rented ([clusters.rented.users] maps none)"
    assert chosen.choice == "onprem" and "no account for alice" in chosen.reason
    site.tick(rounds=2)
    assert site.rented.submitted == []


def test_a_rest_cluster_that_maps_the_owner_takes_the_job(tmp_path):
    site = rest_site(tmp_path, {"alice": {"account": "geo-alice", "token_file": "/t"}})
    site.home_job_training()
    site.checkpoint("away", 40)
    lose_home(site)
    assert site.federation.plan_for(site.job()).candidate("rented").eligible
    site.tick()
    (_, moved), = site.rented.submitted
    assert moved.owner == ALICE
    assert "HOME" not in moved.environment and "USER" not in moved.environment
    assert moved.environment["VIRTUAL_ENV"] == "/home/alice/venv"


def test_a_rejected_token_is_a_token_problem_said_once_never_an_outage(site, monkeypatch):
    """slurmrestd refusing the daemon's JWT (expired, revoked) means the cluster answered:
    declaring it out would move every job away from a healthy cluster."""
    from slurm_geo.federation.model import ClusterStatus
    from slurm_geo.slurm import TokenRejected

    def refused():
        raise TokenRejected("rented", "ping", "geo", Path("/etc/slurm-geo/rented.jwt"),
                            "the token has expired")
    monkeypatch.setattr(site.rented, "ping", refused)
    site.tick(rounds=5)
    assert site.state.health()["rented"].status is ClusterStatus.UP
    said = [k for k in site.kinds() if "refused the daemon's token" in k]
    assert said == ["decision: cluster rented refused the daemon's token"]
    assert not any(k.startswith("outage") for k in site.kinds())


def test_an_untrusted_certificate_is_said_once_never_an_outage(site, monkeypatch):
    """A slurmrestd certificate the daemon does not trust (no ca_file for a site CA, a
    wrong rest_url) is a configuration to mend, like a refused token: moving every job
    away from the cluster would not mend it."""
    from slurm_geo.federation.model import ClusterStatus
    from slurm_geo.slurm import CertificateRejected

    def untrusted():
        raise CertificateRejected("rented", "https://10.77.2.2:6820",
                                  "certificate verify failed: self-signed certificate",
                                  "set ca_file")
    monkeypatch.setattr(site.rented, "ping", untrusted)
    site.tick(rounds=5)
    assert site.state.health()["rented"].status is ClusterStatus.UP
    said = [k for k in site.kinds() if "slurmrestd certificate" in k]
    assert said == ["decision: the daemon does not trust cluster rented's slurmrestd "
                    "certificate"]
    assert not any(k.startswith("outage") for k in site.kinds())
