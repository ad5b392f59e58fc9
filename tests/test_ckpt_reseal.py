"""Upgrading version 1 promotion markers (docs/format.md §8.4): `slurm-geo ckpt reseal`
reads each one under the old rule once, checks it, and seals it under the promotion key;
what it cannot check is reported and left, and version 1 fences are only listed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from slurm_geo.ckpt.errors import LegacyObject
from slurm_geo.ckpt.format.keys import fence_key, fingerprint, promotion_key
from slurm_geo.ckpt.format.seal import Kind, seal
from slurm_geo.ckpt.ops.reseal import reseal
from slurm_geo.ckpt.repo.runkey import unwrap_run_key
from tests.kit.fence import FORGED, KEY, legacy_seal, repo, save

MARKER_10 = "promoted/run/00000000000000000010"
MARKER_20 = "promoted/run/00000000000000000020"


def body(run: str, step: int) -> bytes:
    return json.dumps({"run": run, "step": step,
                       "promoted_at": "2026-11-29T12:00:00+00:00"}).encode()


@pytest.fixture
def old_store(tmp_path):
    """A store as a version 1 writer left it: two markers and a fence under the run key,
    plus a marker whose payload names another step, and one of a step with no manifest."""
    store, repository = repo(tmp_path, "s")
    for step in (10, 20, 30):
        save(repository, "run", step, "onprem")
    data_key = unwrap_run_key(store, KEY, "run")
    store.put(MARKER_10, legacy_seal(data_key, Kind.PROMOTED, body("run", 10), MARKER_10))
    repository.promote("run", 20)  # already version 2
    wrong = "promoted/run/00000000000000000030"
    store.put(wrong, legacy_seal(data_key, Kind.PROMOTED, body("run", 10), wrong))
    missing = "promoted/run/00000000000000000040"
    store.put(missing, legacy_seal(data_key, Kind.PROMOTED, body("run", 40), missing))
    store.put("fences/run", legacy_seal(data_key, Kind.FENCE, FORGED, "fences/run"))
    return store, repository


def test_reseal_carries_the_markers_it_can_check_and_refuses_the_rest(old_store):
    store, repository = old_store
    with pytest.raises(LegacyObject):
        repository.is_promoted("run", 10)
    report = reseal(store, KEY)
    assert report.resealed == [MARKER_10]
    assert report.current == [MARKER_20]
    assert sorted(report.refused) == ["promoted/run/00000000000000000030",
                                      "promoted/run/00000000000000000040"]
    assert "names 'run'@10, not run@30" in report.refused["promoted/run/00000000000000000030"]
    assert report.old_fences == ["fences/run"]
    assert repository.is_promoted("run", 10) and repository.is_promoted("run", 20)
    sealed = store.get(MARKER_10)
    assert sealed[8] == 2 and sealed[10:18] == fingerprint(promotion_key(KEY))
    assert store.get("fences/run")[10:18] != fingerprint(fence_key(KEY))  # left alone
    again = reseal(store, KEY)
    assert again.resealed == [] and again.current == [MARKER_10, MARKER_20]


def test_a_dry_run_writes_nothing(old_store):
    store, repository = old_store
    before = store.get(MARKER_10)
    assert reseal(store, KEY, dry_run=True).resealed == [MARKER_10]
    assert store.get(MARKER_10) == before


def test_a_job_forged_version_2_marker_is_refused_not_resealed(tmp_path):
    store, repository = repo(tmp_path, "s")
    save(repository, "run", 10, "onprem")
    data_key = unwrap_run_key(store, KEY, "run")
    store.put(MARKER_10, seal(data_key, Kind.PROMOTED, bytes(16), body("run", 10), MARKER_10))
    report = reseal(store, KEY)
    assert report.resealed == [] and "sealed with key" in report.refused[MARKER_10]


def test_the_reseal_command_reports_each_marker_and_exits_1_on_a_refusal(old_store, tmp_path):
    store, _ = old_store
    key_file = tmp_path / "master.key"
    key_file.write_bytes(KEY)
    key_file.chmod(0o600)
    done = subprocess.run([sys.executable, "-m", "slurm_geo", "ckpt", "reseal", "--store",
                           f"file://{tmp_path / 's'}", "--key-file", str(key_file)],
                          capture_output=True, text=True, timeout=120, check=False,
                          env=dict(os.environ))
    assert done.returncode == 1, done.stderr
    assert f"re-sealed {MARKER_10}" in done.stdout
    assert "version 1 fence fences/run: the federation daemon rewrites it" in done.stdout
    assert "re-sealed 1 marker(s), 1 already current, 2 refused" in done.stdout
    assert done.stderr.count("slurm-geo: refused promoted/run/") == 2
