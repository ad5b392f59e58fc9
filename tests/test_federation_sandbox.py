"""The federation daemon against real Slurm, as replicas at home and control on the sites'
etcd (`sandbox up --replicated`): losing the home site, a partition of home that heals,
failback and a hopeless queue. They kill, freeze or cut off home, so they run on a
throw-away sandbox of their own (/var/tmp/sg-fedtest, port base 24800), never the suite's
shared one. Its rented is the provider's machine (stock Slurm 26.05 on a root of its own,
its own accounts: a moved incarnation runs as geo-alice and writes in her home there), and
the checks read every incarnation's outputs and trace where it wrote them.

- the drill, `--lose site`: home cut off and every process there SIGKILLed (onprem, the
  job, checkpoint-sync, the home replica, home's etcd member) after two checkpoints are
  off-site; control's replica leads, moves the job to rented, which resumes from the
  newest checkpoint verified off-site, loses at most one checkpoint interval, ends
  bit-identical to an uninterrupted run; when home is back the stale incarnation is
  cancelled; the audit chain (both replicas' entries) verifies; nothing verified off-site
  is lost; no key is on the rented provider's disks; billing reads it all from etcd;
- a freeze (the chaos bench's freeze-home): every onprem process SIGSTOPped until the
  daemon has moved the job and the new incarnation trains, then SIGCONTed; the thawed
  trainer is fenced (409, exit 33) and its Slurm job cancelled, the resume was from a
  verified checkpoint, and no two incarnations trained at once (bench/federation_chaos.py's
  trial and checks).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest

from slurm_geo.billing.ingest import federation_transfers
from slurm_geo.drills import drill, losses, sharded
from slurm_geo.sandbox import Sandbox, remote_site
from slurm_geo.sandbox.seaweed import S3Credentials
from slurm_geo.sandbox.users import ALICE, BOB
from tests.helpers import incarnation_environment
from tests.kit.sandbox import user_dir

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

ROOT = Path("/var/tmp/sg-fedtest")
PORT_BASE = 24800
REPO = Path(__file__).resolve().parent.parent
SETTINGS = drill.DrillSettings(steps=240, ckpt_every=40, step_delay_s=0.05, timeout_s=180)


@pytest.fixture(scope="session")
def fed_sandbox():
    if os.geteuid() != 0:
        pytest.fail("sandbox tests need root (they start munge, MariaDB and Slurm)")
    up = subprocess.run([sys.executable, "-m", "slurm_geo", "sandbox", "up", "--dir",
                         str(ROOT), "--port-base", str(PORT_BASE), "--replicated"],
                        capture_output=True, text=True, timeout=300, check=False)
    assert up.returncode == 0, up.stderr
    box = Sandbox(ROOT)
    # rented is the provider's machine (Slurm 26.05, its own disks and accounts): the
    # tests read each incarnation's outputs where it wrote them (drill.Training.dirs)
    assert remote_site.is_provider(box.layout), box.layout.remote_slurm
    yield box
    box.down(purge=True)


def chaos_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("federation_chaos",
                                                  REPO / "bench" / "federation_chaos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def drill_report(fed_sandbox: Sandbox):
    return drill.run_drill(fed_sandbox, replace(SETTINGS, lose="site"), ROOT / "drills",
                           progress=lambda _m: None)


def test_drill_meets_its_targets(drill_report):
    report = drill_report

    # The RTO and "at most one interval" targets are wall-clock figures: measured by the drill
    # and bench/federation_chaos.py (docs/benchmarks.md), not asserted on a loaded CI machine.
    assert report.killed_at < report.detected_at <= report.moved_at \
        <= report.running_elsewhere_at <= report.completed_at, report
    # Nothing verified off-site at the kill is lost, and the resume is from a checkpoint
    # home wrote.
    assert report.resume_step is not None and report.steps_lost is not None
    assert report.offsite_step_at_kill <= report.resume_step <= report.last_step_home, report
    assert report.bit_identical, (report.final_weights, report.reference_weights)
    assert "cancelled: fenced" in report.stale_incarnation or \
        report.stale_incarnation.endswith(" ended"), report.stale_incarnation
    assert report.audit_ok
    # Home's replica led and died with the site; control's took over and made the move.
    assert (report.leader_before, report.leader_after, report.moved_by) == (
        "home", "control", "control"), report.decisions
    assert report.failover_s is not None and report.failover_at < report.moved_at
    assert {d["replica"] for d in report.decisions if d["kind"] == "outage"} == {"control"}
    assert report.offsite_kept
    assert report.provider_secrets == []


def test_the_drill_is_billed_in_full_under_its_logical_job(fed_sandbox: Sandbox, drill_report,
                                                          tmp_path):
    """Both legs under the logical job, the killed home leg to its cluster's last answer
    (flagged estimated), and the run's checkpoint egress charged to its cost center."""
    from slurm_geo.billing import service
    from slurm_geo.billing.config import billing_config
    from slurm_geo.billing.db import BillingDB
    from slurm_geo.config.model import load_config
    from slurm_geo.slurm import connect

    report = drill_report
    site = load_config(fed_sandbox.layout.site_config)
    clients = [connect(c) for c in site.clusters.values()]
    (home_leg, moved_leg) = [(leg["cluster"], leg["job_id"]) for leg in report.legs]
    with BillingDB(tmp_path / "billing.db") as db:
        def ingested():
            result = service.run_ingest(db, billing_config(site), clients, int(time.time()),
                                        since=int(report.killed_at) - 3600)
            assert not result.failures, result.failures
            return {(r["cluster"], r["job_id"]): dict(r) for r in db.conn.execute(
                "SELECT * FROM jobs WHERE logical_id = ?", [report.logical_job])}
        legs = drill.wait_for(lambda: (found := ingested()) and home_leg in found
                              and moved_leg in found and found, time.time() + 60,
                              "both legs in billing")
        home = legs[home_leg]
        assert "estimated" in home["flags"], home
        ran = report.killed_at - home["start_ts"]
        window = site.federation.detection_window_s
        assert ran - window - 2 <= home["elapsed_s"] <= ran + 1, (home, ran)
        assert legs[moved_leg]["cost_center"] == "ml-research"
        egress = db.conn.execute("SELECT DISTINCT logical_id, cost_center FROM egress WHERE "
                                 "run = ?", [report.run]).fetchall()
        assert [tuple(row) for row in egress] == [(report.logical_job, "ml-research")]


@pytest.fixture(scope="module")
def partition_trial(fed_sandbox: Sandbox):
    chaos = chaos_module()
    runner = chaos.Chaos(fed_sandbox, SETTINGS, ROOT / "chaos",
                         drill.reference_weights(SETTINGS), say=lambda _m: None)
    trial = runner.run(1, chaos.Fault("freeze-home", 60))
    return chaos, runner, trial


def test_partition_thawed_trainer_is_fenced_and_cancelled(partition_trial):
    _chaos, runner, trial = partition_trial
    assert trial.error is None, trial.error
    assert trial.healed_at is not None and trial.moves[0]["cluster"] == "rented"
    # The incarnation the freeze hit: "generation G on onprem:J" (the daemon may have moved
    # the job for its queue and back before, so G is not always 0).
    generation, home_job = int(trial.hit.split()[1]), int(trial.hit.rsplit(":", 1)[1])
    stale_output = drill.job_output(runner.jobs[trial.index].dirs, home_job, "onprem")
    # Printed only by slurm_geo.examples.train's `except SlurmGeoError` on Fenced, which returns 33.
    assert "error: this incarnation is fenced" in stale_output, stale_output
    assert "final step" not in stale_output
    audit = runner.view
    refused = [e for e in audit.entries(logical_job=trial.logical_job) if e.kind == "fence"
               and e.what == f"refused a lease to onprem:{home_job} generation {generation}"]
    assert refused, "the daemon never answered the thawed trainer 409"
    assert trial.stale["fence"] is not None, trial.stale  # the daemon cancelled its job
    sacct = trial.stale["sacct"]
    # How Slurm records the end depends on which lands first: the daemon's cancel
    # (CANCELLED) or the fenced trainer's own exit 33 (FAILED; on a node thawed from
    # SIGSTOP the allocation's exit code is not always the batch step's 33, seen once).
    assert sacct and (sacct[0]["exit_code"] == 33
                      or sacct[0]["state"] in ("CANCELLED", "FAILED")), sacct
    assert trial.unverified == []  # resumed from the checkpoint the daemon verified
    assert trial.not_started == []
    assert trial.rto_s is not None and trial.rto_s > 0, trial  # its bound: a benchmark figure
    # Nothing verified off-site when the partition hit is lost. Not "at most one interval":
    # replication is asynchronous (checkpoint-sync polls every 2 s here, at batch priority),
    # so under load the newest checkpoint at home may not have left it yet.
    assert trial.steps_lost is not None and trial.last_step_home is not None
    assert trial.steps_lost <= trial.last_step_home - (trial.offsite_at_fault or 0), trial
    assert trial.bit_identical
    assert audit.verify_audit()


def test_partition_never_two_incarnations_training(partition_trial):
    # Needs slurm_geo.examples.train to check its lease again after each step's compute, before the
    # step counts (trace, checkpoint): a process frozen mid-step finishes it after the thaw.
    _chaos, _runner, trial = partition_trial
    assert trial.error is None, trial.error
    assert trial.overlap == []


def _site_and_clients(box: Sandbox):
    from slurm_geo.config.model import load_config
    from slurm_geo.slurm import connect

    site = load_config(box.layout.site_config)
    return site, {name: connect(c) for name, c in site.clusters.items()}


def _final_weights(training, job_id: int, cluster: str) -> str | None:
    return drill.final_line(drill.job_output(training.dirs, job_id, cluster))[1]


def _provider_sees_only_what_it_held(sandbox: Sandbox, site, run: str, resumed: int) -> None:
    from slurm_geo.ckpt.errors import WrongKey
    from slurm_geo.ckpt.format.keys import load_master_key
    from slurm_geo.ckpt.repo.runkey import RunKeyRepository, unwrap_run_keys
    from slurm_geo.ckpt.stores.open_store import open_store

    store = open_store(site.stores["pfs"].url)
    ring = unwrap_run_keys(store, load_master_key(sandbox.layout.master_key), run)
    assert len(ring.keys) == 2
    provider = RunKeyRepository(store, run, ring.keys[1].data_key)
    assert provider.manifest(run, resumed).step == resumed
    later = [step for step in provider.steps(run) if step > resumed]
    assert later, "generation 2 saved at home"
    for step in later:
        with pytest.raises(WrongKey):
            provider.manifest(run, step)


def test_failback_brings_the_job_home_at_its_next_checkpoint(fed_sandbox: Sandbox):
    import time

    settings = drill.DrillSettings(steps=800, ckpt_every=40, step_delay_s=0.05)
    site, clients = _site_and_clients(fed_sandbox)
    assert site.federation is not None
    audit = losses.FederationView(site)
    training = drill.submit_training(site, clients["onprem"], settings, ROOT / "failback",
                                     fed_sandbox.layout)
    logical = f"onprem-{training.job_id}"
    deadline = time.time() + 240
    drill.wait_for(lambda: len(drill.verified_offsite(site, training.run)) >= 2, deadline,
                   "two checkpoints off-site")
    killed = time.time()
    drill.kill_cluster(fed_sandbox, "onprem")
    drill.wait_for(lambda: drill.audit_entry(audit, "lease", logical, "rented", killed),
                   deadline, "training on rented")
    # The moved job reaches the offsite store with a key minted for its run alone
    # (job_keys = "per-run"), neither the daemon's own S3 key nor the bucket-wide job key,
    # and verifies the store's https against the site CA.
    moved_env = drill.wait_for(lambda: incarnation_environment(logical, generation=1), deadline,
                               "the moved job's processes")
    job_key = S3Credentials.parse(fed_sandbox.layout.offsite_job_credentials.read_text(), "job")
    assert moved_env["AWS_ACCESS_KEY_ID"] not in (
        job_key.access_key_id, fed_sandbox.s3_env()["AWS_ACCESS_KEY_ID"]), moved_env.get(
        "AWS_ACCESS_KEY_ID")
    assert moved_env["AWS_CA_BUNDLE"] == str(fed_sandbox.layout.ca_cert)
    # and the CA itself: home's path to it is not on the provider's machine
    assert moved_env["SLURM_GEO_STORE_CA"] == fed_sandbox.layout.ca_cert.read_text()
    fed_sandbox.up(progress=lambda _m: None)  # home is back
    planned = drill.wait_for(
        lambda: next((e for e in audit.entries(logical_job=logical)
                      if e.kind == "decision" and "fail back" in e.what), None),
        deadline, "a failback decision")
    home = drill.wait_for(lambda: drill.audit_entry(audit, "requeue", logical, "onprem",
                                                    planned.unix_time),
                          deadline, "generation 2 submitted at home")
    assert home.detail["generation"] == 2
    (back,) = [e for e in audit.entries(logical_job=logical) if e.kind == "transfer"]
    assert "from offsite to pfs" in back.what  # copied before generation 2 was submitted
    # Billing charges that copy as egress: the entry says what went where (docs/billing.md).
    (copy,) = federation_transfers([back], 0, 2**31)
    assert (copy["run"], copy["source"], copy["destination"], copy["bytes"]) == (
        training.run, "offsite", "pfs", back.detail["bytes"])
    assert (copy["source_region"], copy["destination_region"]) == (
        site.stores["offsite"].region, site.stores["pfs"].region)
    drill.wait_for(lambda: drill.audit_entry(audit, "finished", logical, "onprem", killed),
                   deadline, "the job to finish at home")
    home_job = int(home.detail["job_id"])
    output = drill.job_output(training.dirs, home_job, "onprem")
    assert f"started at step {home.detail['resume_step']}" in output
    assert _final_weights(training, home_job, "onprem") == drill.reference_weights(settings)
    lines = drill.trace_lines(training.traces)
    rented_steps = [line.step for line in lines if line.generation == 1]
    assert max(rented_steps) == home.detail["resume_step"]  # nothing trained twice, or lost
    # Every incarnation, the moved one and the one failed back, ran as alice: her own uid
    # at home, her account's at the provider (geo-alice, when rented is the provider's).
    ran_as = drill.incarnation_uids(training.dirs)
    assert f"onprem:{home_job}" in ran_as and any(k.startswith("rented:") for k in ran_as)
    accounts = sharded.account_uids(fed_sandbox.layout, ALICE)
    assert {k: accounts[k.partition(":")[0]] for k in ran_as} == ran_as, (ran_as, accounts)
    assert accounts["onprem"] == ALICE.uid
    # Leaving the rented cluster rotated the run's key before generation 2 got its ring: the
    # provider, holding the key its job had, opens the step it saved and nothing saved
    # at home after it (docs/format.md 4.2).
    rotated = [e for e in audit.entries(logical_job=logical) if e.kind == "key"
               and e.what.startswith(f"rotated run {training.run}'s data key in pfs")]
    assert len(rotated) == 1 and rotated[0].detail["generation"] == 2, rotated
    _provider_sees_only_what_it_held(fed_sandbox, site, training.run,
                                     home.detail["resume_step"])


def test_a_hopeless_home_queue_is_left_for_rented(fed_sandbox: Sandbox):
    import time

    from slurm_geo.slurm import JobSpec, JobState

    settings = drill.DrillSettings(steps=120, ckpt_every=40, step_delay_s=0.02)
    site, clients = _site_and_clients(fed_sandbox)
    assert site.federation is not None
    onprem = clients["onprem"]
    blockers = [onprem.submit(JobSpec(script="#!/bin/bash\nsleep 900\n", name="blocker",
                                      time_limit_minutes=60, cpus_per_task=2,
                                      owner=BOB.owner, output="/dev/null",
                                      working_dir=user_dir(fed_sandbox, BOB, "blockers")))
                for _ in range(2)]
    try:
        audit = losses.FederationView(site)
        training = drill.submit_training(site, onprem, settings, ROOT / "queue",
                                         fed_sandbox.layout)
        logical = f"onprem-{training.job_id}"
        deadline = time.time() + 180
        moved = drill.wait_for(lambda: drill.audit_entry(audit, "requeue", logical, "rented",
                                                         0), deadline, "the queue move")
        decision = next(e for e in audit.entries(logical_job=logical) if e.kind == "decision")
        assert "queue wait on onprem" in decision.why
        assert onprem.job(training.job_id).state is JobState.CANCELLED
        drill.wait_for(lambda: drill.audit_entry(audit, "finished", logical, "rented", 0),
                       deadline, "the job to finish on rented")
        assert _final_weights(training, int(moved.detail["job_id"]), "rented") == \
            drill.reference_weights(settings)
    finally:
        for job_id in blockers:
            onprem.cancel(job_id)


def test_the_replicas_restarted_one_at_a_time_keep_the_job_its_lease_and_its_fences(
        fed_sandbox: Sandbox):
    """docs/install.md, "Upgrading": one replica at a time, the follower first, while a
    geo job trains at home. Each replica is stopped as systemd stops it (SIGTERM: the
    leader gives its key up) and started again by `sandbox up` with the checkout's code,
    as an upgrade installs it. The job is never moved, requeued or fenced, its lease stays
    generation 0 on its one Slurm job, nothing is trained twice, and it ends as an
    uninterrupted run does."""
    import signal

    settings = drill.DrillSettings(steps=1600, ckpt_every=40, step_delay_s=0.05)
    site, clients = _site_and_clients(fed_sandbox)
    view = losses.FederationView(site)
    started = time.time()
    deadline = started + 420
    training = drill.submit_training(site, clients["onprem"], settings, ROOT / "rolling",
                                     fed_sandbox.layout)
    logical = f"onprem-{training.job_id}"
    leased = drill.wait_for(lambda: drill.audit_entry(view, "lease", logical, "onprem",
                                                      started), deadline, "the job's lease")
    daemons = {"home": "federation", "control": "federation-control"}
    first = drill.wait_for(view.leader, deadline, "a leader")
    leaders = [first]
    for name in (next(n for n in daemons if n != first), first):  # the follower first
        pid = fed_sandbox.processes.running_pid(daemons[name])
        assert pid is not None, daemons[name]
        losses.signal_pids({pid}, signal.SIGTERM)
        drill.wait_for(lambda p=pid: not _alive(p), deadline, f"replica {name} to stop")
        fed_sandbox.up(progress=lambda _m: None)
        assert fed_sandbox.processes.running_pid(daemons[name]) not in (None, pid)
        leaders.append(drill.wait_for(view.leader, deadline, "a leader"))
    restarted = time.time()
    assert leaders[1] == first and leaders[2] != first, leaders  # the lead moved once
    finished = drill.wait_for(lambda: drill.audit_entry(view, "finished", logical, None,
                                                        started), deadline, "the job's end")
    assert finished.unix_time > restarted  # it trained through both restarts
    entries = view.entries(logical_job=logical)
    assert [e.kind for e in entries if e.kind in ("lease", "requeue", "fence", "decision",
                                                   "cancel")] == ["lease"], entries
    assert (leased.detail["generation"], leased.detail["job_id"]) == (0, training.job_id)
    assert finished.detail["cluster"] == "onprem" and "COMPLETED" in finished.what
    steps = [line.step for line in drill.trace_lines(training.traces)]
    assert steps == list(range(1, settings.steps + 1)), steps[:5]  # none twice, none lost
    assert _final_weights(training, training.job_id, "onprem") == \
        drill.reference_weights(settings)


def _alive(pid: int) -> bool:
    """Whether `pid` still runs. A daemon an earlier test's `sandbox.up()` started is this
    process's child: once it exits it stays a zombie until reaped here (os.kill(pid, 0)
    would find it forever: the CI run that timed out)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass  # not ours to reap: the CLI's `sandbox up` started it
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"
