"""A promotion marker follows its checkpoint's replica only once it opens under the
promotion key and names that checkpoint (docs/format.md §8.1): one a job forged under its
run key is not carried, and the attempt says why."""

from __future__ import annotations

import json

import pytest

from slurm_geo.ckpt.format.seal import Kind, seal
from slurm_geo.ckpt.repo.runkey import unwrap_run_key
from slurm_geo.sync.worker import Outcome
from tests.kit.fence import KEY, legacy_seal, repo, save
from tests.kit.sync import attempt_on

MARKER = "promoted/run/00000000000000000010"


def test_a_promoted_checkpoints_marker_is_carried_to_its_replica(tmp_path):
    home_store, home = repo(tmp_path, "home")
    away_store, away = repo(tmp_path, "away")
    save(home, "run", 10, "onprem")
    home.promote("run", 10)
    attempt, replica = attempt_on(tmp_path, home_store, away_store)
    assert attempt.run(replica).outcome is Outcome.VERIFIED
    assert away.is_promoted("run", 10)


@pytest.mark.parametrize("version", [1, 2])
def test_a_marker_a_job_forged_is_not_carried(tmp_path, version):
    home_store, home = repo(tmp_path, "home")
    away_store, _ = repo(tmp_path, "away")
    save(home, "run", 10, "onprem")
    data_key = unwrap_run_key(home_store, KEY, "run")
    body = json.dumps({"run": "run", "step": 10, "promoted_at": "x"}).encode()
    forged = (legacy_seal(data_key, Kind.PROMOTED, body, MARKER) if version == 1
              else seal(data_key, Kind.PROMOTED, bytes(16), body, MARKER))
    home_store.put(MARKER, forged)
    attempt, replica = attempt_on(tmp_path, home_store, away_store)
    result = attempt.run(replica)
    assert result.outcome is Outcome.RETRY
    assert MARKER in result.detail
    assert not away_store.exists(MARKER)
