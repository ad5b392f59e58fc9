"""`sync retry --wait`: following requeued replicas through checkpoint-sync's state until
each is settled, with the bytes its transfers put meanwhile."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from slurm_geo.sync.follow import follow, settled, succeeded
from slurm_geo.sync.state import StateDB, Status


@pytest.mark.parametrize("statuses, done", [
    ([Status.VERIFIED], True),
    ([Status.VERIFIED, Status.FAILED], True),
    ([Status.CORRUPTED, Status.SKIPPED], True),
    ([Status.VERIFIED, Status.PENDING], False),
    ([Status.UPLOADING], False),
    ([Status.REPLICATED], False),   # copied, not yet verified
    ([], True),
])
def test_settled_only_when_the_daemon_moves_none_further(statuses, done):
    assert settled(statuses) is done


@pytest.mark.parametrize("status, ok", [
    (Status.VERIFIED, True), (Status.SKIPPED, True),
    (Status.FAILED, False), (Status.CORRUPTED, False),
])
def test_only_verified_or_no_longer_wanted_is_success(status, ok):
    assert succeeded(status) is ok


def failed_replica(state: StateDB, step: int, now: float) -> int:
    [replica_id] = state.add([{"root": "pfs", "run": "r", "step": step,
                               "destination": "offsite", "sequence": step,
                               "status": "pending", "created_at": now}], now)
    state.move(replica_id, Status.PENDING, Status.UPLOADING, now)
    state.record_transfer(state.replica(replica_id), put("packs/aa/old", 999, now))
    state.move(replica_id, Status.UPLOADING, Status.FAILED, now, last_error="AccessDenied")
    return replica_id


def put(name: str, size: int, now: float) -> dict:
    return {"object": name, "kind": name.split("/")[0], "bytes": size, "source": "pfs",
            "destination": "offsite", "source_region": "home",
            "destination_region": "away", "started_at": now, "finished_at": now}


def daemon_step(state: StateDB, replica_id: int, now: float) -> None:
    """What checkpoint-sync does to a requeued replica, one poll at a time."""
    replica = state.replica(replica_id)
    if replica.status is Status.PENDING:
        state.move(replica_id, Status.PENDING, Status.UPLOADING, now)
        state.record_transfer(replica, put("packs/bb/new", 1000, now))
    elif replica.status is Status.UPLOADING:
        state.record_transfer(replica, put("packs/cc/new", 500, now))
        state.record_transfer(replica, {**put("manifests/r/2", 4000, now), "kind": "verify"})
        state.move(replica_id, Status.UPLOADING, Status.REPLICATED, now)
    elif replica.status is Status.REPLICATED:
        state.move(replica_id, Status.REPLICATED, Status.VERIFIED, now)


def test_follow_counts_the_bytes_put_since_the_requeue_until_settled(tmp_path):
    state = StateDB(tmp_path / "state.db")
    now = time.time()
    replica_id = failed_replica(state, 2, now)
    state.requeue("r", None, now)
    seen: list[int] = []
    followed = follow(state, [replica_id], seen.append,
                      sleep=lambda _s: daemon_step(state, replica_id, now))
    state.close()
    # Neither the failed attempt's 999 bytes nor the verification read count.
    assert seen == [0, 1000, 1500, 1500] and followed.bytes == 1500
    assert followed.statuses == {replica_id: Status.VERIFIED} and followed.ok


def test_retry_json_says_what_it_requeued_with_bytes_and_seconds(tmp_path):
    path = tmp_path / "state.db"
    state = StateDB(path)
    failed_replica(state, 2, time.time())
    state.close()
    result = subprocess.run([sys.executable, "-m", "slurm_geo", "sync", "retry", "r",
                             "--state", str(path), "--json"], capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0 and result.stderr == ""
    summary = json.loads(result.stdout)
    assert summary["requeued"] == [{"step": 2, "destination": "offsite", "was": "failed",
                                    "now": "pending"}]
    assert (summary["waited"], summary["bytes"]) == (False, 0)
    assert isinstance(summary["seconds"], float)


def test_retry_wait_follows_the_daemon_and_exits_1_when_a_replica_fails_again(tmp_path):
    path = tmp_path / "state.db"
    state = StateDB(path)
    now = time.time()
    replica_id = failed_replica(state, 2, now)
    waiting = subprocess.Popen([sys.executable, "-m", "slurm_geo", "sync", "retry", "r",
                                "--state", str(path), "--wait", "--json"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 30
    while state.replica(replica_id).status is not Status.PENDING and time.time() < deadline:
        time.sleep(0.05)
    state.move(replica_id, Status.PENDING, Status.UPLOADING, now)
    state.record_transfer(state.replica(replica_id), put("packs/bb/new", 1000, now))
    state.move(replica_id, Status.UPLOADING, Status.FAILED, now, last_error="AccessDenied")
    state.close()
    out, err = waiting.communicate(timeout=60)
    assert waiting.returncode == 1, err
    summary = json.loads(out)
    assert summary["requeued"][0]["now"] == "failed" and not summary["ok"]
    assert summary["bytes"] == 1000 and summary["waited"]
