"""SIGUSR1 -> final checkpoint -> requeue request -> exit 75, in-process and end to end."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from slurm_geo.ckpt import LocalDirStore, Repository, create_master_key_file
from slurm_geo.torch.signals import EXIT_REQUEUE, RequeueOnSignal, request_requeue

REPO_ROOT = Path(__file__).resolve().parent.parent
RUN = "sig-run"


def test_the_handler_only_records_the_signal_and_uninstalls_cleanly() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    with RequeueOnSignal() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0)  # let the interpreter run the Python-level handler
        assert stop.requested and stop.received == signal.SIGUSR1
    assert signal.getsignal(signal.SIGUSR1) == before


def test_requeue_and_exit_asks_for_the_requeue_then_exits_75() -> None:
    calls: list[str] = []

    def requeue() -> bool:
        calls.append("requeue")
        return True

    stop = RequeueOnSignal(requeue=requeue)
    with pytest.raises(SystemExit) as raised:
        stop.requeue_and_exit()
    assert (raised.value.code, calls) == (EXIT_REQUEUE, ["requeue"])


class FakeRun:
    def __init__(self, returncode: int = 0, error: Exception | None = None,
                 comment: str = "(null)"):
        self.calls: list[list[str]] = []
        self.returncode, self.error, self.comment = returncode, error, comment

    def __call__(self, command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        self.calls.append(command)
        if self.error:
            raise self.error
        out = f"{self.comment}\n" if command[0] == "squeue" else ""
        return subprocess.CompletedProcess(command, self.returncode, out, "denied")


def test_request_requeue_runs_scontrol_only_inside_a_job() -> None:
    run = FakeRun()
    assert request_requeue({}, run) is False and run.calls == []
    assert request_requeue({"SLURM_JOB_ID": "4711"}, run) is True
    assert run.calls[-1] == ["scontrol", "requeue", "4711"]
    assert request_requeue({"SLURM_JOB_ID": "1"}, FakeRun(returncode=1)) is False
    assert request_requeue({"SLURM_JOB_ID": "1"}, FakeRun(error=FileNotFoundError())) is False


@pytest.mark.parametrize(("env", "comment", "marked"), [
    ({"SLURM_JOB_ID": "7"}, "(null)", "geo:planned-requeue=0"),
    ({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "3"}, "sweep 2",
     "geo:planned-requeue=3 sweep 2"),
    ({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "4"}, "geo:planned-requeue=3 sweep 2",
     "geo:planned-requeue=4 sweep 2"),
])
def test_a_requeue_the_job_asks_for_is_marked_planned_first(env, comment, marked) -> None:
    """The mark comes before the requeue, keeps the user's comment and names this
    incarnation (slurm_geo.policy.restarts)."""
    run = FakeRun(comment=comment)
    assert request_requeue(env, run) is True
    assert run.calls == [["squeue", "--noheader", "--jobs=7", "--format=%k"],
                         ["scontrol", "update", "JobId=7", f"Comment={marked}"],
                         ["scontrol", "requeue", "7"]]


def start_trainer(store: Path, key: Path, run: str, *args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}  # no scontrol
    command = [sys.executable, "-m", "slurm_geo.examples.train", "--run", run,
               "--store", str(store), "--key-file", str(key), *args]
    return subprocess.Popen(command, cwd=REPO_ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(process: subprocess.Popen[str]) -> tuple[int, str]:
    try:
        out, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode in (0, EXIT_REQUEUE), err
    return process.returncode, out


def final_hash(out: str) -> str:
    match = re.search(r"final step \d+ weights ([0-9a-f]{64})", out)
    assert match, out
    return match.group(1)


@pytest.mark.slow
def test_sigusr1_to_a_trainer_saves_where_it_stopped_exits_75_and_resumes_identically(
    tmp_path: Path,
) -> None:
    key_file, store = tmp_path / "master.key", tmp_path / "store"
    store.mkdir()
    repo = Repository(LocalDirStore(store), create_master_key_file(key_file))
    process = start_trainer(store, key_file, RUN, "--steps", "100000000", "--ckpt-every", "20")
    try:
        deadline = time.monotonic() + 60
        while not repo.steps(RUN):  # training is under way once a checkpoint exists
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(process.pid, signal.SIGUSR1)
    finally:
        returncode, out = finish(process)
    assert returncode == EXIT_REQUEUE
    stopped = int(re.search(r"stopped at step (\d+)", out).group(1))  # type: ignore[union-attr]
    assert stopped >= 20 and repo.latest(RUN) == stopped
    assert repo.verify(RUN, stopped) == []

    end = str(stopped + 5)
    second_half = start_trainer(store, key_file, RUN, "--steps", end, "--ckpt-every", "20")
    straight = start_trainer(store, key_file, "straight", "--steps", end, "--ckpt-every", "20")
    (resumed_rc, resumed_out), (straight_rc, straight_out) = finish(second_half), finish(straight)
    assert (resumed_rc, straight_rc) == (0, 0)
    assert f"started at step {stopped}" in resumed_out
    assert final_hash(resumed_out) == final_hash(straight_out)
