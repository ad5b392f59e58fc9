"""A site of users who do not trust each other, on the real sandbox: alice trains, bob
attacks. alice types plain sbatch at her shell; bob sends what any user of the site could
send from his own login: his own MUNGE credential, forged signatures, replays of alice's
requests, and his own geo job naming her run. Each attack is refused and changes nothing;
everything the daemon submits for alice runs as alice, with her environment and none of
the daemon's; her job never reads the site's master key; a fence she forges counts for
nothing.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import eventually, incarnation_environment, process_environment, sbatch_as

from slurm_geo.ckpt import LocalDirStore, Metadata, Repository, Tensor
from slurm_geo.ckpt.format.keys import load_master_key
from slurm_geo.ckpt.repo.fence import read_fence
from slurm_geo.drills import drill
from slurm_geo.federation.state.audit import AuditLog
from slurm_geo.federation.state.sqlite import FederationState
from slurm_geo.sandbox import Sandbox
from slurm_geo.sandbox.render import federation_port, federation_url
from slurm_geo.sandbox.sites import Site
from slurm_geo.sandbox.users import ALICE, BOB, SandboxUser, job_environment, run_as
from slurm_geo.slurm import CliSlurmClient, JobState
from tests.kit.sandbox import user_dir

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

# Long enough to outlive every test of the module (0.05 s a step).
SETTINGS = drill.DrillSettings(steps=6000, ckpt_every=40, step_delay_s=0.05)

# What a user sends from their own shell, with the site Python: requests described in
# argv[1] (JSON), answered as JSON on stdout. "munge": the caller's own credential;
# "secret": a signature with a secret of the caller's choosing; "replay": the exact bytes
# and headers of an earlier answer's request.
SEND = r'''
import json, sys
from pathlib import Path
from slurm_geo.lease.client import post, tls_context
from slurm_geo.lease.munge import MungeCommands
from slurm_geo.lease.signing import MungeSigner, SecretSigner, secret_bytes

args = json.loads(sys.argv[1])
tls = tls_context(Path(args["ca"]).read_text())
answers = []
for request in args["requests"]:
    if request["signer"] == "replay":
        data, headers = request["data"].encode(), request["headers"]
    else:
        data = json.dumps(request["body"]).encode()
        signer = {"none": None,
                  "munge": lambda: MungeSigner(MungeCommands(Path(args["munge"]))),
                  "secret": lambda: SecretSigner(request["logical_job"], request["generation"],
                                                 secret_bytes(request["secret"]))}
        made = signer[request["signer"]]
        headers = {} if made is None else made().headers("POST", request["path"], data)
    answer = post(args["url"] + request["path"], data, headers, tls)
    answers.append({"name": request["name"], "status": answer.status, "body": answer.body,
                    "data": data.decode(), "headers": headers})
print(json.dumps(answers))
'''


@dataclass
class Training:
    run: str
    job_id: int
    work: Path
    trace: Path

    @property
    def logical_job(self) -> str:
        return f"onprem-{self.job_id}"


def send(sandbox: Sandbox, person: SandboxUser, requests: list[dict]) -> dict[str, dict]:
    """The requests, sent by a process of `person`'s own; their answers by name."""
    args = {"url": federation_url(sandbox.layout), "ca": str(sandbox.layout.ca_cert),
            "munge": str(sandbox.layout.munge_socket), "requests": requests}
    done = run_as(person, [str(sandbox.layout.site_python), "-c", SEND, json.dumps(args)],
                  env=job_environment(sandbox.layout, person), capture_output=True,
                  text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return {answer["name"]: answer for answer in json.loads(done.stdout)}


def lease_body(training: Training, job_id: int | None = None, restart: int = 0,
               generation: int = 0, run: str | None = None, release: bool = False) -> dict:
    return {"protocol": 2, "run": training.run if run is None else run, "cluster": "onprem",
            "job_id": training.job_id if job_id is None else job_id, "restart": restart,
            "generation": generation, "last_step": None, "release": release}


def key_body(job_id: int, generation: int = 0) -> dict:
    return {"protocol": 2, "cluster": "onprem", "job_id": job_id, "restart": 0,
            "generation": generation, "token": ""}


def steps_trained(training: Training) -> int:
    return max((line.step for line in drill.trace_lines(training.trace)), default=0)


def onprem(sandbox: Sandbox) -> CliSlurmClient:
    return CliSlurmClient("onprem", sandbox.layout.onprem.slurm_conf, timeout_s=10)


def state(site) -> FederationState:
    return FederationState(site.federation.state, readonly=True)


@pytest.fixture(scope="module")
def alice(sandbox: Sandbox, site) -> Training:
    """alice's federated training job, typed with plain sbatch at her shell and training
    at home. Its script also says whether the job could read the master key, and carries
    an indented `#SBATCH --geo-failover=never`, which sbatch ignores and so must the daemon."""
    sandbox.up(progress=lambda _msg: None)
    work = user_dir(sandbox, ALICE, "multi-tenant")
    run = f"alice-{uuid.uuid4().hex[:8]}"
    trace = work / "trace.log"
    key = sandbox.layout.master_key
    script = drill.training_script(site, run, SETTINGS, work, trace).replace(
        "exec python", f'test -r "{key}" && echo readable > "{work}/master-key" || '
                       f'echo unreadable > "{work}/master-key"\nexec python', 1).replace(
        "#SBATCH --geo-failover=auto",
        "#SBATCH --geo-failover=auto\n  #SBATCH --geo-failover=never")
    submitted = sbatch_as(sandbox, ALICE, script)
    assert submitted.returncode == 0, submitted.stderr
    training = Training(run, int(submitted.stdout.strip()), work, trace)
    eventually(lambda: steps_trained(training), lambda steps: steps >= SETTINGS.ckpt_every, 120)
    yield training
    done = operator_cancel(site, training)
    assert done.returncode == 0, done.stderr


def operator_cancel(site, training: Training) -> subprocess.CompletedProcess:
    """The operator's `slurm-geo cancel`: every incarnation, and no restart after."""
    return subprocess.run([sys.executable, "-m", "slurm_geo", "cancel", training.logical_job,
                           "--config", str(site.source)], capture_output=True, text=True,
                          timeout=120, check=False)


@pytest.fixture(scope="module")
def bobs_job(sandbox: Sandbox, site) -> int:
    """A geo job of bob's own, at home: what he may name in his requests."""
    work = user_dir(sandbox, BOB, "multi-tenant")
    pfs = site.stores["pfs"].url.removeprefix("file://")
    script = "\n".join(["#!/bin/bash", f"#SBATCH --geo-ckpt-dir={pfs}",
                        "#SBATCH --geo-cost-center=ml-research", "#SBATCH --geo-failover=manual",
                        f"#SBATCH --output={work}/%j.out", "sleep 900", ""])
    submitted = sbatch_as(sandbox, BOB, script)
    assert submitted.returncode == 0, submitted.stderr
    job_id = int(submitted.stdout.strip())
    eventually(lambda: onprem(sandbox).job(job_id), lambda j: j.state is JobState.RUNNING)
    yield job_id
    onprem(sandbox).cancel(job_id)


# --- alice at home ---------------------------------------------------------------------------

def test_alices_home_job_trains_and_checkpoints_without_read_access_to_the_master_key(
        sandbox, site, alice):
    assert (alice.work / "master-key").read_text() == "unreadable\n"
    assert os.stat(sandbox.layout.master_key).st_mode & 0o077 == 0
    eventually(lambda: drill.verified_offsite(site, alice.run), lambda steps: len(steps) >= 1,
               120)
    assert drill.incarnation_uids(alice.work) == {f"onprem:{alice.job_id}": ALICE.uid}


def test_an_indented_geo_directive_has_no_effect(site, alice):
    job = state(site).job(alice.logical_job)
    assert job.owner is not None and job.owner.user == "alice"
    assert job.directives["geo-failover"] == "auto"  # what SPANK and job_submit.lua saw


# --- bob's attacks -------------------------------------------------------------------------

def snapshot(sandbox: Sandbox, site, training: Training) -> tuple:
    job = state(site).job(training.logical_job)
    fence = (Path(site.stores["pfs"].url.removeprefix("file://")) / "fences" / training.run)
    return (job.generation, job.cluster, job.job_id, job.status, fence.exists(),
            onprem(sandbox).job(training.job_id).state)


def test_forged_unsigned_replayed_or_other_users_lease_requests_are_refused_and_change_nothing(
        sandbox, site, alice, bobs_job):
    before = snapshot(sandbox, site, alice)
    # A renewal alice's own shell sends (her job's uid, her job): granted, and recorded.
    (genuine,) = send(sandbox, ALICE, [{"name": "genuine", "path": "/v1/lease",
                                        "signer": "munge", "body": lease_body(alice)}]).values()
    assert genuine["status"] == 200 and genuine["body"]["verdict"] == "grant", genuine
    high_restart = lease_body(alice, restart=99)
    answers = send(sandbox, BOB, [
        {"name": "unsigned", "path": "/v1/lease", "signer": "none", "body": high_restart},
        {"name": "bob's credential, alice's job", "path": "/v1/lease", "signer": "munge",
         "body": high_restart},
        {"name": "released for her", "path": "/v1/lease", "signer": "munge",
         "body": lease_body(alice, release=True)},
        {"name": "a secret of bob's choosing", "path": "/v1/lease", "signer": "secret",
         "logical_job": alice.logical_job, "generation": 1, "secret": "ab" * 32,
         "body": lease_body(alice, generation=1, restart=99)},
        {"name": "replay of alice's", "path": "/v1/lease", "signer": "replay",
         "data": genuine["data"], "headers": genuine["headers"]},
        {"name": "string boolean", "path": "/v1/lease", "signer": "munge",
         "body": {**lease_body(alice, job_id=bobs_job), "release": "false"}},
    ])
    assert answers["unsigned"]["status"] == 401, answers["unsigned"]
    assert answers["bob's credential, alice's job"]["status"] == 403
    assert answers["released for her"]["status"] == 403
    assert answers["a secret of bob's choosing"]["status"] in (401, 403)
    assert answers["replay of alice's"]["status"] == 403  # authentic, but used already
    assert "replayed" in answers["replay of alice's"]["body"]["reason"]
    assert answers["string boolean"]["status"] == 400
    for answer in answers.values():
        assert answer["body"].get("reason"), answer  # a JSON reason, never a bare status
    trained = steps_trained(alice)
    eventually(lambda: steps_trained(alice), lambda steps: steps > trained + 20, 60)
    assert snapshot(sandbox, site, alice) == before
    assert (before[3].value, before[5]) == ("running", JobState.RUNNING)


def test_bob_cannot_obtain_alices_run_key_or_fence_her_job(sandbox, site, alice, bobs_job):
    before = snapshot(sandbox, site, alice)
    answers = send(sandbox, BOB, [
        {"name": "key of alice's job", "path": "/v1/key", "signer": "munge",
         "body": key_body(alice.job_id)},
        {"name": "his job claims her run", "path": "/v1/lease", "signer": "munge",
         "body": lease_body(alice, job_id=bobs_job, restart=99)},
        {"name": "key of his job", "path": "/v1/key", "signer": "munge",
         "body": key_body(bobs_job)},
        {"name": "her next generation", "path": "/v1/lease", "signer": "munge",
         "body": lease_body(alice, generation=999, restart=99)},
    ])
    assert answers["key of alice's job"]["status"] == 403, answers["key of alice's job"]
    assert "key" not in answers["key of alice's job"]["body"]
    assert answers["his job claims her run"]["status"] == 403
    assert "belongs to" in answers["his job claims her run"]["body"]["reason"]
    assert answers["key of his job"]["status"] != 200  # it registered no run: no key at all
    assert answers["her next generation"]["status"] == 403
    trained = steps_trained(alice)
    eventually(lambda: steps_trained(alice), lambda steps: steps > trained + 20, 60)
    assert snapshot(sandbox, site, alice) == before
    assert "fenced" not in drill.job_output(alice.work, alice.job_id, "onprem")
    audit = AuditLog(site.federation.audit_path, readonly=True)
    assert not [e for e in audit.entries(logical_job=alice.logical_job) if e.kind == "fence"]


def test_the_service_survives_300_stalled_connections_and_still_answers_leases(
        sandbox, site, alice):
    port, home_address = federation_port(sandbox.layout), sandbox.layout.address(Site.HOME)
    stalled = []
    try:
        for _ in range(300):
            stalled.append(socket.create_connection((home_address, port), timeout=5))
        trained = steps_trained(alice)
        # alice's trainer renews through them all and goes on training (a trainer stops
        # within 60 % of the lease TTL without a granted renewal).
        eventually(lambda: steps_trained(alice), lambda steps: steps > trained + 60, 60)
        answer = send(sandbox, BOB, [{"name": "probe", "path": "/v1/lease", "signer": "none",
                                      "body": lease_body(alice)}])["probe"]
        assert answer["status"] == 401, answer
    finally:
        for connection in stalled:
            connection.close()


# --- alice's job cancelled, restarted by the daemon ---------------------------------------

@pytest.fixture(scope="module")
def restarted(sandbox: Sandbox, site, alice) -> dict[str, str]:
    """alice tries to forge a generation-999 fence for her own run (refused: fences/ is
    the daemons' alone); then root scancels her job (a system's cancel, not hers, which
    is final since issue 29): the daemon restarts the lost job at home, as her. Returns
    the environment of the restarted trainer's process."""
    pfs = Path(site.stores["pfs"].url.removeprefix("file://"))
    forge = ("import json, os, sys\n"
             "from pathlib import Path\n"
             "from slurm_geo.ckpt import LocalDirStore, Repository\n"
             "fence = {'run': sys.argv[2], 'generation': 999, 'holder': 'alice',\n"
             "         'set_at': '2026-12-01T00:00:00+00:00', 'resume_step': None}\n"
             "Repository(LocalDirStore(Path(sys.argv[1])), os.urandom(32)).put_fence(\n"
             "    sys.argv[2], json.dumps(fence).encode())\n")
    done = run_as(ALICE, [str(sandbox.layout.site_python), "-c", forge, str(pfs), alice.run],
                  env=job_environment(sandbox.layout, ALICE), capture_output=True, text=True,
                  timeout=60, check=False)
    assert done.returncode != 0 and "Permission denied" in done.stderr, done.stderr
    assert not (pfs / "fences" / alice.run).exists()
    onprem(sandbox).cancel(alice.job_id)
    return eventually(lambda: incarnation_environment(alice.logical_job, generation=1),
                      lambda env: env is not None, 120, 1)


def test_a_cancelled_then_restarted_job_runs_as_its_owner(site, alice, restarted):
    # The trainer may start before the daemon has recorded the job id sbatch gave it.
    job = eventually(lambda: state(site).job(alice.logical_job),
                     lambda job: job.job_id is not None, 60)
    assert (job.generation, job.cluster) == (1, "onprem")
    eventually(lambda: drill.incarnation_uids(alice.work), lambda uids: len(uids) == 2, 60)
    assert drill.incarnation_uids(alice.work) == {f"onprem:{alice.job_id}": ALICE.uid,
                                                  f"onprem:{job.job_id}": ALICE.uid}


def test_no_variable_of_the_daemons_environment_appears_in_a_submitted_job(
        sandbox, restarted):
    daemon = process_environment(sandbox.processes.running_pid("federation"))
    assert daemon is not None
    submitted = {k: v for k, v in restarted.items() if not k.startswith("SLURM")}
    alices = job_environment(sandbox.layout, ALICE)
    leaked = {k for k, v in daemon.items() if submitted.get(k) == v and alices.get(k) != v}
    assert leaked == set(), leaked
    assert restarted["HOME"] == str(ALICE.home) and restarted["USER"] == "alice"
    assert restarted["PATH"] == alices["PATH"]  # `python` is hers after the restart too
    assert daemon["AWS_SECRET_ACCESS_KEY"] not in restarted.values()


def test_a_job_cannot_forge_a_fence(sandbox, site, alice, restarted):
    """The fence alice tried to forge (generation 999, sealed under a key of her choosing)
    was never written, and the store's fence is the daemon's, generation 1, in a directory
    only the daemons' account writes."""
    pfs = LocalDirStore(Path(site.stores["pfs"].url.removeprefix("file://")))
    fence = read_fence(Repository(pfs, load_master_key(sandbox.layout.master_key)), alice.run)
    assert fence is not None and fence.generation == 1
    fences = pfs.root / "fences"
    assert fences.owner() == "slurm-geo" and fences.stat().st_mode & 0o777 == 0o755
    eventually(lambda: [line for line in drill.trace_lines(alice.trace)
                        if line.generation == 1], lambda lines: len(lines) >= 10, 60)
    assert state(site).job(alice.logical_job).status.value == "running"


# --- issue 28: what the security review found ----------------------------------------------

def bobs_lease(job_id: int, run: str = "", **fields) -> dict:
    """A lease request bob's own shell sends for his job `job_id`."""
    return {"protocol": 2, "run": run, "cluster": "onprem", "job_id": job_id, "restart": 0,
            "generation": 0, "last_step": None, "release": False, **fields}


def bobs_run(site, job_id: int) -> str | None:
    """The run bob's job names in the federation (None: not registered)."""
    job = state(site).find_job("onprem", job_id)
    return None if job is None else job.run


def test_bob_cannot_claim_a_stored_run_that_no_job_names_nor_get_its_key(
        sandbox, site, bobs_job):
    """A run an operator wrote into the store (with the master key), which no job of the
    federation names: bob's own job naming it is refused, and gets no key."""
    run = f"operator-run-{uuid.uuid4().hex[:8]}"
    pfs = LocalDirStore(Path(site.stores["pfs"].url.removeprefix("file://")))
    Repository(pfs, load_master_key(sandbox.layout.master_key)).write_checkpoint(
        run, [Tensor("w", "float32", (4,), bytes(16))], b"",
        Metadata(3, 3, 0, 1.0, "2026-12-01T00:00:00Z", "onprem", "1"))
    stored = sorted(pfs.list(f"manifests/{run}/")) + sorted(pfs.list(f"keys/{run}"))
    answers = send(sandbox, BOB, [
        {"name": "claim", "path": "/v1/lease", "signer": "munge",
         "body": bobs_lease(bobs_job, run)},
        {"name": "key", "path": "/v1/key", "signer": "munge", "body": key_body(bobs_job)},
    ])
    assert answers["claim"]["status"] == 403, answers["claim"]
    assert "no recorded owner" in answers["claim"]["body"]["reason"]
    assert answers["key"]["status"] != 200 and "data_key" not in answers["key"]["body"]
    assert state(site).find_by_run(run) == []
    assert bobs_run(site, bobs_job) in (None, "")
    assert sorted(pfs.list(f"manifests/{run}/")) + sorted(pfs.list(f"keys/{run}")) == stored


def test_hostile_run_ids_and_cluster_names_are_refused_at_the_door(sandbox, site, bobs_job):
    before = {job.logical_job: job for job in state(site).jobs()}
    answers = send(sandbox, BOB, [
        {"name": "run ../../..", "path": "/v1/lease", "signer": "munge",
         "body": bobs_lease(bobs_job, "../../..")},
        {"name": "run a/b", "path": "/v1/lease", "signer": "munge",
         "body": bobs_lease(bobs_job, "a/b")},
        {"name": "cluster ../x", "path": "/v1/lease", "signer": "munge",
         "body": bobs_lease(bobs_job, cluster="../x")},
        {"name": "key, cluster ../x", "path": "/v1/key", "signer": "munge",
         "body": {**key_body(bobs_job), "cluster": "../x"}},
    ])
    for name, answer in answers.items():
        assert answer["status"] == 400, (name, answer)
        assert answer["body"]["reason"].startswith("malformed request:"), answer
    assert state(site).find_by_run("../../..") == [] and state(site).find_by_run("a/b") == []
    assert bobs_run(site, bobs_job) in (None, "")
    after = {job.logical_job: job for job in state(site).jobs()}
    assert {name: after[name] for name in before} == before  # nothing of theirs changed


def test_bobs_flood_of_unknown_job_ids_is_answered_from_a_bounded_budget(sandbox, site):
    """555 requests in 10 s once made the root daemon run squeue and sacct for each: now
    a job id Slurm did not know is answered 404 from memory, and past his budget of
    lookups 429, each with a JSON reason, audited as refusals at most once a second."""
    audit = AuditLog(site.federation.audit_path, readonly=True)
    seen = len(audit.entries())
    requests = [{"name": f"guess {n}", "path": "/v1/lease", "signer": "munge",
                 "body": bobs_lease(900_000 + n % 100)} for n in range(200)]
    started = time.monotonic()
    answers = send(sandbox, BOB, requests)
    elapsed = time.monotonic() - started
    statuses = [answer["status"] for answer in answers.values()]
    assert set(statuses) <= {404, 429} and 429 in statuses and 404 in statuses, statuses
    asked = [a for a in answers.values()  # a 404 from memory says when Slurm said so
             if a["status"] == 404 and "less than" not in a["body"]["reason"]]
    assert len(asked) <= 60 + elapsed + 1  # his burst of lookups, and its refill
    assert all(answer["body"].get("reason") for answer in answers.values())
    refusals = [e for e in AuditLog(site.federation.audit_path, readonly=True).entries()[seen:]
                if e.kind == "refused" and "a lease to onprem:9" in e.what]
    assert refusals and {e.detail["status"] for e in refusals} <= {404, 429}
    # At most one entry a second from his address (the sandbox's interval), the rest counted.
    assert len(refusals) <= (elapsed + 2) / site.federation.refusal_audit_interval_s + 1
    assert sum(e.detail["left_out"] for e in refusals) > 0
    assert not [job for job in state(site).jobs() if (job.job_id or 0) >= 900_000]


def test_spank_variables_bob_exports_himself_are_rejected_by_the_controller(sandbox, site):
    """The daemon reads a pending job's directives from SLURM_SPANK_GEO_*: job_submit.lua
    rejects a job whose environment carries one the SPANK plugin did not set."""
    def bobs() -> set[str]:
        return {job.logical_job for job in state(site).jobs()
                if job.owner is not None and job.owner.user == "bob"}
    before = bobs()
    pfs = site.stores["pfs"].url.removeprefix("file://")
    env = {**job_environment(sandbox.layout, BOB),
           "SLURM_CONF": str(sandbox.layout.onprem.slurm_conf)}
    plain = "#!/bin/bash\nsleep 60\n"
    geo = (f"#!/bin/bash\n#SBATCH --geo-ckpt-dir={pfs}\n#SBATCH --geo-cost-center=ml-research\n"
           "#SBATCH --geo-failover=manual\nsleep 60\n")
    forged = {"SLURM_SPANK_GEO_FAILOVER": "auto", "SLURM_SPANK_GEO_CKPT_DIR": pfs,
              "SLURM_SPANK_GEO_CLUSTERS": "onprem,rented"}
    for script, extra, named in [(plain, forged, "SLURM_SPANK_GEO_"),
                                 (geo, {"SLURM_SPANK_GEO_CLUSTERS": "onprem,rented"},
                                  "SLURM_SPANK_GEO_CLUSTERS")]:
        done = run_as(BOB, ["sbatch", "--parsable"], input=script, text=True,
                      capture_output=True, timeout=60, check=False, env={**env, **extra})
        assert done.returncode != 0, done.stdout
        assert named in done.stderr and "the SPANK plugin did not set it" in done.stderr
    assert bobs() == before


def test_the_bootstrap_secret_slurmdbd_keeps_is_worthless_once_the_job_started(
        sandbox, site, alice, restarted):
    """The restarted incarnation's lease secret, as its environment (slurmdbd's record,
    /proc/PID/environ) keeps it, signs nothing once the trainer took its session secret."""
    eventually(lambda: [line for line in drill.trace_lines(alice.trace)
                        if line.generation == 1], lambda lines: len(lines) >= 10, 60)
    job = state(site).job(alice.logical_job)
    before = snapshot(sandbox, site, alice)
    bootstrap = restarted["SLURM_GEO_LEASE_SECRET"]
    answers = send(sandbox, BOB, [
        {"name": f"restart {restart}", "path": "/v1/lease", "signer": "secret",
         "logical_job": alice.logical_job, "generation": 1, "secret": bootstrap,
         "body": lease_body(alice, job_id=job.job_id, generation=1, restart=restart)}
        for restart in (0, 1)])
    for answer in answers.values():
        assert answer["status"] == 401, answer
        assert "session secret" in answer["body"]["reason"] or "restart" in \
            answer["body"]["reason"], answer
    trained = steps_trained(alice)
    eventually(lambda: steps_trained(alice), lambda steps: steps > trained + 20, 60)
    assert snapshot(sandbox, site, alice) == before
