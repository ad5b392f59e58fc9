"""`slurm-geo sync status|retry` over a state database, and the command's help."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from slurm_geo.cli.sync import run_summaries
from slurm_geo.sync.state import StateDB, Status


def slurm_geo(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slurm_geo", *args], capture_output=True,
                          text=True, timeout=60, env=env)


@pytest.fixture
def state_path(tmp_path):
    """run-a: 100 verified, 200 corrupted, 300 pending; run-b: 50 failed."""
    path = tmp_path / "state.db"
    state = StateDB(path)
    now = time.time()
    rows = [{"root": "pfs", "run": run, "step": step, "destination": "offsite",
             "sequence": i, "status": "pending", "created_at": now - 100}
            for i, (run, step) in enumerate([("run-a", 100), ("run-a", 200), ("run-a", 300),
                                             ("run-b", 50)])]
    ids = dict(zip([100, 200, 300, 50], state.add(rows, now), strict=True))
    for step, end in ((100, Status.VERIFIED), (200, Status.CORRUPTED)):
        state.move(ids[step], Status.PENDING, Status.UPLOADING, now)
        state.move(ids[step], Status.UPLOADING, Status.REPLICATED, now)
        state.move(ids[step], Status.REPLICATED, end, now, last_error=f"{end.value} at {step}")
    state.move(ids[50], Status.PENDING, Status.UPLOADING, now)
    state.move(ids[50], Status.UPLOADING, Status.FAILED, now, last_error="AccessDenied")
    state.close()
    return path


def test_status_json_has_one_row_per_run_with_newest_verified_and_lag(state_path):
    result = slurm_geo("sync", "status", "--json", "--state", str(state_path))
    assert result.returncode == 0, result.stderr
    by_run = {row["run"]: row for row in json.loads(result.stdout)}
    a, b = by_run["run-a"], by_run["run-b"]
    assert (a["newest"], a["verified"], a["pending"], a["corrupted"]) == (300, 100, 1, 1)
    assert 90 < a["lag_s"] < 200            # 200 and 300 have waited since their creation
    assert a["error"] == "corrupted at 200"
    assert (b["verified"], b["failed"], b["error"]) == (None, 1, "AccessDenied")


def test_status_table_and_an_empty_database(state_path, tmp_path):
    table = slurm_geo("sync", "status", "--state", str(state_path)).stdout.splitlines()
    assert table[0].split()[:4] == ["RUN", "DESTINATION", "NEWEST", "VERIFIED"]
    assert [line.split()[0] for line in table[1:]] == ["run-a", "run-b"]
    StateDB(tmp_path / "empty.db").close()
    assert slurm_geo("sync", "status", "--state", str(tmp_path / "empty.db")).stdout == (
        "no checkpoints seen yet\n")


def test_retry_requeues_failed_and_corrupted_only(state_path):
    result = slurm_geo("sync", "retry", "run-a", "--state", str(state_path))
    assert result.returncode == 0, result.stderr
    assert "requeued 1 replica(s): 200 (corrupted)" in result.stdout
    again = slurm_geo("sync", "retry", "run-a", "--state", str(state_path))
    assert "nothing failed or corrupted to requeue" in again.stdout
    state = StateDB(state_path, readonly=True)
    assert {r.step: r.status for r in state.replicas("run = ?", ["run-a"])} == {
        100: Status.VERIFIED, 200: Status.PENDING, 300: Status.PENDING}
    state.close()


def test_mistakes_are_one_line_with_an_exit_code(state_path, tmp_path):
    unknown = slurm_geo("sync", "retry", "run-z", "--state", str(state_path))
    assert unknown.returncode == 26 and "run 'run-z' has no replicas" in unknown.stderr
    missing = slurm_geo("sync", "status", "--state", str(tmp_path / "absent.db"))
    assert missing.returncode == 40 and "no sync state database" in missing.stderr
    config = tmp_path / "site.toml"
    config.write_text('[stores.pfs]\nurl = "file:///x"\nregion = "home"\n')
    no_sync = slurm_geo("sync", "status", env={"SLURM_GEO_CONFIG": str(config),
                                               "PATH": "/usr/bin:/bin"})
    assert no_sync.returncode == 3 and "has no [sync] table" in no_sync.stderr
    for result in (unknown, missing, no_sync):
        assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args", [["sync"], ["sync", "status"], ["sync", "retry"]])
def test_sync_commands_have_help(args):
    result = slurm_geo(*args, "--help")
    assert result.returncode == 0 and "Usage:" in result.stdout


def test_lag_is_zero_once_the_newest_is_verified():
    from tests.kit.sync import replica

    rows = [replica(100, Status.VERIFIED), replica(200, Status.SKIPPED)]
    [summary] = run_summaries(rows, now=1e9)
    assert summary["lag_s"] == 0.0 and summary["verified"] == 100


def test_status_rows_name_each_runs_job_and_list_directories_without_runs():
    from slurm_geo.cli.sync import status_rows
    from slurm_geo.sync.jobdirs import SourceStatus
    from slurm_geo.sync.state import Source
    from tests.kit.sync import replica

    job_root = "file:///pfs/ckpt/llm-7b"
    replicas = [replica(100, Status.VERIFIED, run="llm-7b", root=job_root),
                replica(50, Status.VERIFIED, id=2, run="other", root="pfs")]
    sources = [
        Source("pfs", "root", "file:///pfs", SourceStatus.WATCHED),
        Source(job_root, "job", "/pfs/ckpt/llm-7b", SourceStatus.WATCHED, ("onprem:31",),
               ("alice",)),
        Source("file:///gone", "job", "/gone", SourceStatus.UNREADABLE, ("onprem:32",),
               ("bob",), "/gone does not exist"),
        Source("file:///home", "job", "/home", SourceStatus.KEPT_HOME, ("onprem:33",),
               ("eve",), "job onprem:33: its --geo-residency=home excludes ..."),
        Source("file:///old", "job", "/old", SourceStatus.RELEASED, ("onprem:1",), ("x",)),
        Source("registry", "registry", "/r.db", SourceStatus.WATCHED),
    ]
    rows = status_rows(replicas, sources, now=1e9)
    assert [(r["run"], r["jobs"], r["source"]) for r in rows] == [
        ("llm-7b", ["onprem:31"], "watched"), ("other", [], "watched"),
        (None, ["onprem:32"], "unreadable"), (None, ["onprem:33"], "kept_home")]
    assert rows[2]["error"] == rows[2]["source_detail"] == "/gone does not exist"
    assert rows[0]["roots"] == [job_root] and rows[1]["roots"] == ["pfs"]


def test_status_warns_of_each_run_whose_newest_checkpoint_is_not_replicated(state_path):
    """A run whose checkpoints go nowhere is said so on stderr, not only in a column
    (issue 29): run-a's newest (300) is merely pending, run-b's failed."""
    result = slurm_geo("sync", "status", "--state", str(state_path))
    assert result.returncode == 0
    assert result.stderr.splitlines() == [
        "slurm-geo: warning: run run-b: checkpoint-sync has not replicated step 50 to "
        "offsite (gave up: AccessDenied)"]
