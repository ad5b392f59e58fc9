"""Checkpoint places agree (issue 29, item 5): a FederatedRun saves to its cluster's store
and says so at start (warning when checkpoint-sync does not replicate it); a job's
--geo-ckpt-dir holds its records, among them the run's, from which the node epilog
records the final checkpoint in that store and judges its replication by that store."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from slurm_geo.ckpt import LocalDirStore, Repository
from slurm_geo.hooks import node
from slurm_geo.hooks.context import job_context
from slurm_geo.lease import places
from slurm_geo.lease.places import Final, RunRecord, SyncFacts, Where
from slurm_geo.sync.jobdirs import Protection
from tests.kit.hooks import RUN, env_for, save

SYNC = SyncFacts(roots=("pfs",), destination="offsite", home_cluster="onprem")
PFS = "file:///pfs"


# --- where the checkpoints go: pure --------------------------------------------------------

@pytest.mark.parametrize("cluster, store, url, sync, replicated, why", [
    ("onprem", "pfs", PFS, SYNC, True, "root"),
    ("onprem", "scratch", "file:///scratch", SYNC, False,
     "store 'scratch' of cluster 'onprem' is not one of checkpoint-sync's roots "
     "([sync] roots)"),
    ("onprem", "pfs", PFS, None, False, "this site runs no checkpoint-sync ([sync] table)"),
    ("onprem", "offsite", "s3://b/p", SYNC, False,
     "store 'offsite' is checkpoint-sync's destination, the off-site copy itself"),
    ("rented", "pfs", PFS, SYNC, False,
     "checkpoint-sync replicates the home cluster 'onprem''s stores only"),
    ("onprem", "x", PFS, SyncFacts((PFS,), "offsite", ""), True, "root"),  # a root by URL
])
def test_where_a_clusters_store_is_replicated(cluster, store, url, sync, replicated, why):
    assert places.where(cluster, store, url, sync) == Where(store, url, cluster,
                                                             replicated, why)


@pytest.mark.parametrize("place, ckpt_dir, lines", [
    (Where("pfs", PFS, "onprem", True, "root"), "/pfs/me/a",
     ["slurm-geo: run r1 saves its checkpoints to store 'pfs' (file:///pfs) of cluster "
      "'onprem', where the federation daemon can move it; checkpoint-sync replicates them "
      "off-site; --geo-ckpt-dir /pfs/me/a keeps this job's records, not its checkpoints"]),
    (Where("scratch", "file:///s", "onprem", False, "not a root"), None,
     ["slurm-geo: run r1 saves its checkpoints to store 'scratch' (file:///s) of cluster "
      "'onprem', where the federation daemon can move it",
      "slurm-geo: warning: run r1's checkpoints are not replicated off-site (not a root): "
      "if cluster 'onprem' is lost, so are they"]),
    (places.unknown("rented", "s3://b/p"), None,
     ["slurm-geo: run r1 saves its checkpoints to store s3://b/p of cluster 'rented', "
      "where the federation daemon can move it"]),
])
def test_what_the_job_says_at_start(place, ckpt_dir, lines):
    assert places.start_lines("r1", place, ckpt_dir) == lines


GOOD = {"run": "r1", "cluster": "onprem", "job_id": 42, "restart": 0, "store": "pfs",
        "store_url": PFS, "step": 30, "replicated": True, "why": "root"}


@pytest.mark.parametrize("change, valid", [
    ({}, True),
    ({"step": None}, True),
    ({"run": "../other"}, False),
    ({"run": ""}, False),
    ({"job_id": "42"}, False),
    ({"step": -1}, False),
    ({"step": True}, False),
    ({"store_url": None}, False),
    ({"why": 3}, False),
])
def test_a_run_record_is_read_only_when_it_is_one(change, valid):
    record = RunRecord.from_json({**GOOD, **change})
    assert (record is not None) is valid
    assert RunRecord.from_json([]) is None
    assert RunRecord.from_json({k: v for k, v in GOOD.items() if k != "run"}) is None


RECORD = RunRecord.from_json(GOOD)
assert RECORD is not None


@pytest.mark.parametrize("store, url, steps, final", [
    ("pfs", PFS, [10, 20, 40], Final("r1", 40, "pfs", "store")),   # the store, not the report
    ("pfs", PFS, [], Final("r1", None, "pfs", "store")),
    ("pfs", PFS, None, Final("r1", 30, "pfs", "trainer",
                             "the store cannot be listed here: as the trainer reported it")),
    ("other", "file:///o", [50], Final(
        "r1", 30, "pfs", "trainer",
        "the run saves to file:///pfs, not this cluster's store file:///o: as the trainer "
        "reported it")),
    ("", "", None, Final("r1", 30, "pfs", "trainer", "no store is configured for this "
                         "cluster here: as the trainer reported it")),
])
def test_the_final_checkpoint_of_a_recorded_run(store, url, steps, final):
    assert places.final_from_record(RECORD, store, url, steps) == final


def test_final_as_json():
    assert Final("r1", None, "pfs", "store").as_json() is None
    assert Final("r1", 4, "pfs", "store").as_json() == {"run": "r1", "step": 4,
                                                         "store": "pfs"}
    assert Final("r1", 4, "pfs", "trainer", "why").as_json() == {
        "run": "r1", "step": 4, "store": "pfs", "note": "why"}


def test_listed_steps_reads_manifest_names_only(tmp_path):
    (tmp_path / "manifests" / "r1").mkdir(parents=True)
    for name in (f"{7:020d}", f"{12:020d}", ".tmp", "12"):
        (tmp_path / "manifests" / "r1" / name).write_text("")
    assert places.listed_steps(f"file://{tmp_path}", "r1") == [7, 12]
    assert places.listed_steps(f"file://{tmp_path}", "r2") == []
    assert places.listed_steps(f"file://{tmp_path / 'gone'}", "r1") is None
    assert places.listed_steps("s3://b/p", "r1") is None


# --- the job's side -----------------------------------------------------------------------

def test_a_federated_run_says_where_and_records_its_run(tmp_path, capsys):
    from slurm_geo.lease.client import FederatedRun, Placement

    (tmp_path / ".slurm-geo").mkdir()
    place = Where("scratch", "file:///s", "onprem", False, "not a root")
    run = FederatedRun(Placement("asked", "onprem", 42, 1, 0, None, "https://d", "file:///s",
                                 ""), signer=object(), where=place,  # type: ignore[arg-type]
                       env={"SLURM_GEO_CKPT_DIR": str(tmp_path)})
    run._announce("r1")
    run._announce("r1")  # once per incarnation
    assert capsys.readouterr().err.splitlines() == places.start_lines("r1", place,
                                                                      str(tmp_path))
    assert places.read_record(tmp_path, "onprem", 42) == RunRecord(
        "r1", "onprem", 42, 1, "scratch", "file:///s", None, False, "not a root")
    run._note_step(20)
    assert places.read_record(tmp_path, "onprem", 42).step == 20  # type: ignore[union-attr]


def test_a_federated_run_without_a_prepared_directory_records_nothing(tmp_path, capsys):
    from slurm_geo.lease.client import FederatedRun, Placement

    run = FederatedRun(Placement("r1", "onprem", 42, 0, 0, None, "https://d", PFS, ""),
                       signer=object(), env={"SLURM_GEO_CKPT_DIR": str(tmp_path / "no")},
                       )  # type: ignore[arg-type]
    run._announce("r1")
    assert "store file:///pfs" in capsys.readouterr().err
    assert not (tmp_path / "no").exists()


# --- the epilog's side --------------------------------------------------------------------

def federated_job(tmp_path: Path, key: bytes, steps: tuple[int, ...], reported: int
                  ) -> tuple[Path, Path]:
    """A job directory with the run's record, and the cluster's store with its steps."""
    ckpt, store = tmp_path / "job", tmp_path / "pfs"
    store.mkdir()
    node.prolog(job_context(env_for(ckpt)), now=1.0)
    repo = Repository(LocalDirStore(store), key)
    for step in steps:
        save(repo, step)
    places.write_record(ckpt, RunRecord(RUN, "onprem", 42, 0, "pfs", f"file://{store}",
                                        reported, True, "root"))
    return ckpt, store


@pytest.fixture
def key() -> bytes:
    return os.urandom(32)


def entry_of(record: dict) -> dict:
    (entry,) = record["incarnations"]
    return entry


def test_the_epilog_takes_a_federated_runs_final_checkpoint_from_its_store(tmp_path, key):
    ckpt, store = federated_job(tmp_path, key, (10, 20), reported=20)
    judged = []

    def judge(meant, run):
        judged.append(run)
        return meant

    cluster = node.ClusterStore("pfs", f"file://{store}", Protection("pfs", True, "root"),
                                judge)
    record = node.epilog(job_context(env_for(ckpt)), Protection(None, False, "kept home"),
                         2.0, None, cluster)
    assert entry_of(record)["final_checkpoint"] == {"run": RUN, "step": 20, "store": "pfs"}
    assert entry_of(record)["sync"] == {"root": "pfs", "replicated": True, "as": "root"}
    assert judged == [RUN]


@pytest.mark.parametrize("cluster, why", [
    (lambda store: node.ClusterStore("pfs", f"file://{store}",
                                     Protection(None, False, "not a root")), "not a root"),
    (lambda store: node.ClusterStore("o", "file:///elsewhere",
                                     Protection("o", True, "root")),
     "the run saves to file://{store}, not this cluster's store file:///elsewhere: as the "
     "trainer reported it"),
    (lambda store: None, "no slurm-geo config on this node names the run's store"),
])
def test_the_epilog_of_a_federated_run_says_why_it_is_not_replicated(tmp_path, key,
                                                                    cluster, why):
    ckpt, store = federated_job(tmp_path, key, (10,), reported=10)
    record = node.epilog(job_context(env_for(ckpt)), Protection("x", True, "root"), 2.0,
                         lambda meant, run: meant, cluster(store))
    entry = entry_of(record)
    assert entry["sync"] == {"root": None, "replicated": False,
                             "why": why.format(store=store)}
    assert entry["final_checkpoint"]["step"] == 10


def test_without_a_run_record_the_epilog_reads_the_directory_as_before(tmp_path, key):
    ckpt = tmp_path / "job"
    node.prolog(job_context(env_for(ckpt)), now=1.0)
    save(Repository(LocalDirStore(ckpt), key), 5)
    cluster = node.ClusterStore("pfs", "file:///pfs", Protection("pfs", True, "root"))
    record = node.epilog(job_context(env_for(ckpt)), Protection(str(ckpt), True, "root"),
                         2.0, None, cluster)
    assert entry_of(record)["final_checkpoint"] == {"run": RUN, "step": 5}


def test_the_epilog_judges_a_federated_run_by_its_stores_replicas(tmp_path, key,
                                                                  monkeypatch):
    """The run's store is checkpoint-sync's root 'pfs', whose replicas of the run keep
    failing: the record says replicated: false and why (through run_hook, the config and
    checkpoint-sync's state)."""
    from slurm_geo.hooks.entry import run_hook
    from slurm_geo.sync.state import StateDB, Status

    ckpt, store = federated_job(tmp_path, key, (10, 20), reported=20)
    (tmp_path / "offsite").mkdir()
    state = StateDB(tmp_path / "sync.db")
    (replica_id,) = state.add([{"root": "pfs", "run": RUN, "step": 20,
                                "destination": "offsite", "sequence": 0,
                                "status": "pending"}], now=1.0)
    state.update(replica_id, Status.PENDING, 2.0, status=Status.FAILED.value, failures=5,
                 last_error="refused")
    state.close()
    config = tmp_path / "site.toml"
    config.write_text(f'''
[site]
home_cluster = "onprem"
[clusters.onprem]
region = "home"
provider = "onprem"
access = "cli"
slurm_conf = "/etc/slurm/slurm.conf"
store = "pfs"
[stores.pfs]
url = "file://{store}"
region = "home"
[stores.offsite]
url = "file://{tmp_path / 'offsite'}"
region = "remote"
[sync]
roots = ["pfs"]
destination = "offsite"
state = "{tmp_path / 'sync.db'}"
key_file = "{tmp_path / 'no.key'}"
''')
    monkeypatch.setenv("SLURM_GEO_CONFIG", str(config))
    env = {**env_for(ckpt), "SLURM_GEO_HOOK_LOG": str(tmp_path / "h.log")}
    assert run_hook("epilog", env) == 0, (tmp_path / "h.log").read_text()
    entry = entry_of(json.loads((ckpt / ".slurm-geo" / "job-onprem-42.json").read_text()))
    assert entry["final_checkpoint"] == {"run": RUN, "step": 20, "store": "pfs"}
    assert entry["sync"] == {
        "root": None, "replicated": False,
        "why": f"run {RUN}: checkpoint-sync has not replicated step 20 to offsite (gave up "
               f"after 5 failed attempts: refused)"}


@pytest.mark.parametrize("stores, lines", [
    ({"onprem": ("pfs", PFS), "rented": ("offsite", "s3://b/p")}, []),
    ({"onprem": ("scratch", "file:///s")},
     ["cluster 'onprem': the checkpoints a FederatedRun saves there are not replicated "
      "off-site (store 'scratch' of cluster 'onprem' is not one of checkpoint-sync's roots "
      "([sync] roots))"]),
    ({"rented": ("scratch", "file:///s")}, []),  # not home: checkpoint-sync's to ignore
])
def test_sync_status_names_a_clusters_store_that_is_not_replicated(stores, lines):
    assert places.unreplicated_stores(stores, SYNC) == lines


def test_sync_status_warns_of_the_home_clusters_store_when_it_is_no_root(tmp_path):
    from click.testing import CliRunner

    from slurm_geo.cli.sync import sync
    from slurm_geo.sync.state import StateDB

    StateDB(tmp_path / "sync.db").close()
    for name in ("pfs", "scratch", "offsite"):
        (tmp_path / name).mkdir()
    config = tmp_path / "site.toml"
    config.write_text(f'''
[site]
home_cluster = "onprem"
[clusters.onprem]
region = "home"
provider = "onprem"
access = "cli"
slurm_conf = "/etc/slurm/slurm.conf"
store = "scratch"
[stores.scratch]
url = "file://{tmp_path / 'scratch'}"
region = "home"
[stores.pfs]
url = "file://{tmp_path / 'pfs'}"
region = "home"
[stores.offsite]
url = "file://{tmp_path / 'offsite'}"
region = "remote"
[sync]
roots = ["pfs"]
destination = "offsite"
state = "{tmp_path / 'sync.db'}"
key_file = "{tmp_path / 'no.key'}"
''')
    result = CliRunner().invoke(sync, ["status", "--config", str(config)])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [
        "slurm-geo: warning: cluster 'onprem': the checkpoints a FederatedRun saves there "
        "are not replicated off-site (store 'scratch' of cluster 'onprem' is not one of "
        "checkpoint-sync's roots ([sync] roots))"]


# --- on the sandbox -------------------------------------------------------------------------

@pytest.mark.slow
def test_a_federated_job_with_a_ckpt_dir_ends_with_the_truth_in_its_epilog(sandbox, request):
    """docs/training.md's first geo job, with --geo-ckpt-dir, as alice from her login
    shell: its output says where its checkpoints go; the epilog's record names the last
    step in the cluster's store, and its replicated flag is checkpoint-sync's state's."""
    from slurm_geo.sandbox import login
    from slurm_geo.sandbox.users import ALICE
    from slurm_geo.sync.state import StateDB
    from slurm_geo.sync.truth import failing_runs
    from tests.helpers import eventually
    from tests.kit.docs import first_job_blocks
    from tests.kit.sandbox import user_dir

    trainer, script = first_job_blocks()
    work = user_dir(sandbox, ALICE, request.node.name)
    ckpt = work / "ckpt"
    script = script.replace("#SBATCH --requeue\n",
                            f"#SBATCH --requeue\n#SBATCH --geo-ckpt-dir={ckpt}\n")
    assert str(ckpt) in script
    for name, body in (("train.py", trainer), ("first.sh", script)):
        (work / name).write_text(body)
        (work / name).chmod(0o644)
        os.chown(work / name, ALICE.uid, ALICE.uid)
    login.ensure_profile(sandbox.layout, sandbox.env_lines(sandbox.layout.onprem.name, False))
    done = subprocess.run(["su", "-", ALICE.name, "-c", f"cd {work} && sbatch --parsable "
                           "first.sh"], capture_output=True, text=True, timeout=120,
                          check=False, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    job_id = int(done.stdout.strip().split(";")[0])
    run, cluster = f"first-{job_id}", sandbox.layout.onprem.name
    out = work / "first.out"
    seen = eventually(lambda: out.read_text() if out.exists() else "",
                      lambda t: "final step" in t or "Error" in t, timeout_s=300, interval_s=2)
    assert seen.splitlines()[-1] == "final step 40", seen
    assert (f"slurm-geo: run {run} saves its checkpoints to store 'pfs' "
            f"(file://{sandbox.layout.pfs_dir}) of cluster '{cluster}', where the federation "
            f"daemon can move it; checkpoint-sync replicates them off-site; --geo-ckpt-dir "
            f"{ckpt} keeps this job's records, not its checkpoints") in seen.splitlines()
    path = ckpt / ".slurm-geo" / f"job-{cluster}-{job_id}.json"
    record = eventually(lambda: json.loads(path.read_text()) if path.exists() else None,
                        lambda r: r is not None, timeout_s=120, interval_s=2)
    entry = record["incarnations"][-1]
    assert entry["final_checkpoint"] == {"run": run, "step": 40, "store": "pfs"}, entry
    state = StateDB(load_site(sandbox).sync.state, readonly=True)
    try:
        failing = failing_runs(state.replicas("root = ?", ["pfs"]), run)
    finally:
        state.close()
    assert entry["sync"]["replicated"] is (not failing), (entry, failing)
    assert entry["sync"] == {"root": "pfs", "replicated": True, "as": "root"}, entry


def load_site(sandbox):
    from slurm_geo.config import load_config

    return load_config(sandbox.layout.site_config)
