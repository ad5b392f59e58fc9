"""Fences: a run moved to another cluster cannot be overwritten by its stale incarnation,
neither directly nor through replication; a job holding only its run key reads and writes
that run and nothing else, and can make no fence or promotion marker a daemon accepts."""

from __future__ import annotations

import json

import pytest

from slurm_geo.ckpt import Repository
from slurm_geo.ckpt.errors import CorruptObject, ImmutableCheckpoint, LegacyObject, WrongKey
from slurm_geo.ckpt.format.keys import fence_key, fingerprint, promotion_key
from slurm_geo.ckpt.format.seal import Kind, seal
from slurm_geo.ckpt.ops.replicate import copy_checkpoint
from slurm_geo.ckpt.repo.fence import (
    FencedCheckpoint,
    FenceRegression,
    read_fence,
    unadmitted_steps,
    write_fence,
)
from slurm_geo.ckpt.repo.runkey import NoControlKey, NoRunKey, RunKeyRepository, unwrap_run_key
from tests.kit.fence import FORGED, KEY, OPTIONS, SALT, fence, legacy_seal, repo, save


@pytest.mark.parametrize("cluster, step, admitted", [
    ("rented", 30, True),    # the holder, past the resume step
    ("onprem", 20, True),    # history: up to the resume step
    ("onprem", 10, True),
    ("onprem", 30, False),   # the stale incarnation, past the resume step
])
def test_a_fence_admits_the_holder_and_history_only(tmp_path, cluster, step, admitted):
    _, repository = repo(tmp_path, "s")
    save(repository, "run", step, cluster)
    assert fence().admits(repository.manifest("run", step)) is admitted


def test_replication_refuses_a_stale_incarnations_checkpoint(tmp_path):
    home_store, home = repo(tmp_path, "home")
    away_store, away = repo(tmp_path, "away")
    save(home, "run", 20, "onprem")
    copy_checkpoint(home, home_store, away_store, "run", 20)
    write_fence(away, fence(resume=20))
    save(home, "run", 30, "onprem")  # the partitioned home job kept training
    with pytest.raises(FencedCheckpoint, match="fenced: generation 1 of the run belongs"):
        copy_checkpoint(home, home_store, away_store, "run", 30)
    assert away.steps("run") == [20]
    assert away.latest("run") == 20
    save(away, "run", 40, "rented")  # the new incarnation commits as usual
    assert away.steps("run") == [20, 40]


def test_fences_only_move_forward(tmp_path):
    _, repository = repo(tmp_path, "s")
    save(repository, "run", 10, "onprem")
    assert read_fence(repository, "run") is None
    write_fence(repository, fence(generation=2))
    write_fence(repository, fence(generation=2))  # the same one again: a repeated step
    with pytest.raises(FenceRegression):
        write_fence(repository, fence(generation=1))
    assert read_fence(repository, "run") == fence(generation=2)


def test_a_tampered_fence_does_not_open(tmp_path):
    store, repository = repo(tmp_path, "s")
    save(repository, "run", 10, "onprem")
    write_fence(repository, fence())
    path = tmp_path / "s" / "fences" / "run"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptObject):
        read_fence(Repository(store, KEY, OPTIONS), "run")


def test_the_run_key_opens_its_run_and_no_other(tmp_path):
    store, repository = repo(tmp_path, "s")
    save(repository, "run", 10, "onprem")
    save(repository, "other", 10, "onprem")
    data_key = unwrap_run_key(store, KEY, "run")
    job_side = RunKeyRepository(store, "run", data_key)
    assert job_side.read_checkpoint("run", 10).tensors == \
        repository.read_checkpoint("run", 10).tensors
    save(job_side, "run", 20, "rented")
    assert repository.steps("run") == [10, 20]
    assert repository.verify("run", 20) == []
    with pytest.raises(NoRunKey, match="holds the data key of run 'run' only"):
        job_side.steps("other") and job_side.manifest("other", 10)


def test_a_wrong_master_key_does_not_unwrap_a_run_key(tmp_path):
    store, repository = repo(tmp_path, "s")
    save(repository, "run", 10, "onprem")
    with pytest.raises(WrongKey):
        unwrap_run_key(store, bytes(32), "run")


def test_checkpoints_a_fence_does_not_admit_are_found_for_removal(tmp_path):
    _, repository = repo(tmp_path, "s")
    for step, cluster in ((10, "onprem"), (20, "onprem"), (30, "onprem"), (40, "rented")):
        save(repository, "run", step, cluster)
    assert unadmitted_steps(repository, "run") == []  # no fence: everything is admitted
    write_fence(repository, fence(resume=20))
    assert unadmitted_steps(repository, "run") == [30]
    write_fence(repository, fence(generation=2, resume=None))
    assert unadmitted_steps(repository, "run") == [10, 20, 30]


# --- sealed under a key no job holds (docs/format.md §4, §8.3, §8.4) -------------------


def job_side(store, run: str = "run") -> RunKeyRepository:
    return RunKeyRepository(store, run, unwrap_run_key(store, KEY, run))


def test_a_job_holding_only_its_run_key_can_neither_write_nor_open_a_fence(tmp_path):
    store, repository = repo(tmp_path, "s")
    save(repository, "run", 10, "onprem")
    job = job_side(store)
    with pytest.raises(NoControlKey, match="a job does not hold"):
        write_fence(job, fence(generation=999))
    write_fence(repository, fence())
    with pytest.raises(NoControlKey):
        read_fence(job, "run")
    assert read_fence(repository, "run") == fence()


@pytest.mark.parametrize("forge", [
    lambda data_key: seal(data_key, Kind.FENCE, SALT, FORGED, "fences/run"),  # version 2
    lambda data_key: legacy_seal(data_key, Kind.FENCE, FORGED, "fences/run"),  # version 1
], ids=["version-2-under-run-key", "version-1"])
def test_a_fence_a_job_forged_is_refused_by_replication(tmp_path, forge):
    home_store, home = repo(tmp_path, "home")
    away_store, away = repo(tmp_path, "away")
    save(home, "run", 20, "onprem")
    copy_checkpoint(home, home_store, away_store, "run", 20)
    away_store.put("fences/run", forge(unwrap_run_key(away_store, KEY, "run")))
    with pytest.raises((WrongKey, LegacyObject)):
        read_fence(away, "run")
    save(home, "run", 30, "onprem")
    with pytest.raises((WrongKey, LegacyObject)):  # checkpoint-sync: copy nothing
        copy_checkpoint(home, home_store, away_store, "run", 30)
    assert away.steps("run") == [20]


def test_a_version_1_fence_names_the_way_out(tmp_path):
    store, repository = repo(tmp_path, "s")
    save(repository, "run", 10, "onprem")
    store.put("fences/run", legacy_seal(unwrap_run_key(store, KEY, "run"), Kind.FENCE, FORGED,
                                        "fences/run"))
    with pytest.raises(LegacyObject, match="version 1 fence.*federation daemon rewrites"):
        read_fence(repository, "run")


def test_a_job_cannot_promote_and_its_forged_markers_protect_nothing(tmp_path):
    store, repository = repo(tmp_path, "s")
    save(repository, "run", 10, "onprem")
    job = job_side(store)
    with pytest.raises(NoControlKey):
        job.promote("run", 10)
    body = json.dumps({"run": "run", "step": 10, "promoted_at": "x"}).encode()
    name = "promoted/run/00000000000000000010"
    held = job._keys("run").current.data_key
    for forged, error in ((seal(held, Kind.PROMOTED, SALT, body, name), WrongKey),
                          (legacy_seal(held, Kind.PROMOTED, body, name), LegacyObject)):
        store.put(name, forged)
        with pytest.raises(error):  # neither trusted nor taken as absent
            repository.is_promoted("run", 10)
        with pytest.raises(error):
            repository.delete_checkpoint("run", 10)
    assert job.is_promoted("run", 10)  # the job cannot tell: it only refrains from writing
    with pytest.raises(ImmutableCheckpoint):
        save(job, "run", 10, "rented")


def test_a_marker_must_name_its_checkpoint(tmp_path):
    store, repository = repo(tmp_path, "s")
    save(repository, "run", 10, "onprem")
    save(repository, "run", 20, "onprem")
    repository.promote("run", 10)
    assert repository.is_promoted("run", 10) and not repository.is_promoted("run", 20)
    name = "promoted/run/00000000000000000020"
    body = json.dumps({"run": "run", "step": 10, "promoted_at": "x"}).encode()
    store.put(name, seal(promotion_key(KEY), Kind.PROMOTED, SALT, body, name))
    with pytest.raises(CorruptObject, match="names 'run'@10, not run@20"):
        repository.is_promoted("run", 20)


def test_fences_and_markers_are_sealed_under_keys_derived_from_the_master_key(tmp_path):
    store, repository = repo(tmp_path, "s")
    save(repository, "run", 10, "onprem")
    write_fence(repository, fence())
    repository.promote("run", 10)
    for name, key in (("fences/run", fence_key(KEY)),
                      ("promoted/run/00000000000000000010", promotion_key(KEY))):
        sealed = store.get(name)
        assert sealed[8] == 2  # sealed object version 2
        assert sealed[10:18] == fingerprint(key)
    assert fence_key(KEY) != promotion_key(KEY)
