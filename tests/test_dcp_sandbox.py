"""A sharded job on the real sandbox: 2 nodes x 2 tasks launched by srun (gloo on CPU)
train an FSDP2 model and checkpoint it through DCP into alice's store
(python -m slurm_geo.examples.sharded_train); a job of 1 node x 2 tasks resumes it,
resharded, from exactly the weights saved."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from helpers import eventually, sbatch_as

from slurm_geo.ckpt.format.keys import create_master_key_file
from slurm_geo.sandbox import Sandbox
from slurm_geo.sandbox.users import ALICE, job_environment, run_as
from slurm_geo.slurm import CliSlurmClient
from slurm_geo.slurm.models import JobState
from tests.kit.sandbox import user_dir

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

RUN = "sharded"


@pytest.fixture
def job_dir(sandbox: Sandbox, request) -> Path:
    path = user_dir(sandbox, ALICE, f"dcp-{request.node.name}")
    key = path / "alice.key"
    create_master_key_file(key)
    os.chown(key, ALICE.uid, ALICE.uid)
    (path / "store").mkdir()
    os.chown(path / "store", ALICE.uid, ALICE.uid)
    return path


def sharded_script(job_dir: Path, out: Path, nodes: int, steps: int) -> str:
    return "\n".join([
        "#!/bin/bash",
        f"#SBATCH --nodes={nodes} --ntasks-per-node=2 --output={out}",
        "srun --label bash -c 'echo task $SLURM_PROCID node $SLURMD_NODENAME uid $(id -u)'",
        f"srun python -m slurm_geo.examples.sharded_train --run {RUN} "
        f"--store file://{job_dir / 'store'} --key-file {job_dir / 'alice.key'} "
        f"--steps {steps} --ckpt-every 5",
    ]) + "\n"


def run_to_completion(sandbox: Sandbox, script: str) -> None:
    submitted = sbatch_as(sandbox, ALICE, script)
    assert submitted.returncode == 0, submitted.stderr
    client = CliSlurmClient("onprem", sandbox.layout.onprem.slurm_conf, timeout_s=10)
    job = eventually(lambda: client.job(int(submitted.stdout.strip())),
                     lambda job: job.state.is_terminal(), 240, 1)
    assert job.state is JobState.COMPLETED, job


def tasks(out: Path) -> set[tuple[int, str, int]]:
    return {(int(m[1]), m[2], int(m[3]))
            for m in re.finditer(r"task (\d+) node (\S+) uid (\d+)", out.read_text())}


def hashes(out: Path, kind: str) -> dict[int, str]:
    return {int(m[1]): m[2] for m in re.finditer(rf"{kind} step (\d+)\D.*?weights (\w+)",
                                                 out.read_text())}


def test_four_ranks_on_two_nodes_save_and_two_ranks_on_one_node_resume_resharded(
        sandbox, job_dir):
    first, second = job_dir / "first.out", job_dir / "second.out"
    run_to_completion(sandbox, sharded_script(job_dir, first, nodes=2, steps=10))
    assert {(node, uid) for _task, node, uid in tasks(first)} == {
        ("onprem-n1", ALICE.uid), ("onprem-n2", ALICE.uid)}
    assert {task for task, _node, _uid in tasks(first)} == {0, 1, 2, 3}
    saved = hashes(first, "saved")
    assert sorted(saved) == [5, 10]

    run_to_completion(sandbox, sharded_script(job_dir, second, nodes=1, steps=15))
    assert {task for task, _node, _uid in tasks(second)} == {0, 1}
    assert hashes(second, "resumed") == {10: saved[10]}  # exactly the weights saved
    assert "resumed step 10 on 2 ranks" in second.read_text()
    assert sorted(hashes(second, "saved")) == [15]
    assert "final step 15" in second.read_text()


def test_sigusr1_to_an_srun_job_stops_every_rank_at_one_step_and_requeues_it(
        sandbox, job_dir):
    """scancel --signal=USR1 reaches every task of the job's step: all four ranks save the
    same final step, rank 0 asks Slurm to requeue the job, and the requeued incarnation
    resumes from it."""
    out = job_dir / "requeued.out"
    script = sharded_script(job_dir, out, nodes=2, steps=10**6).replace(
        "--ckpt-every 5", "--ckpt-every 1000 --step-delay 0.05").replace(
        f"--output={out}", f"--output={out} --open-mode=append --requeue")
    submitted = sbatch_as(sandbox, ALICE, script)
    assert submitted.returncode == 0, submitted.stderr
    job_id = int(submitted.stdout.strip())
    client = CliSlurmClient("onprem", sandbox.layout.onprem.slurm_conf, timeout_s=10)
    try:
        eventually(lambda: out.read_text() if out.exists() else "",
                   lambda text: "started at step 0" in text, 120, 1)
        signalled = run_as(ALICE, ["scancel", "--signal=USR1", str(job_id)],
                           env={**job_environment(sandbox.layout, ALICE),
                                "SLURM_CONF": str(sandbox.layout.onprem.slurm_conf)},
                           capture_output=True, text=True, timeout=30, check=False)
        assert signalled.returncode == 0, signalled.stderr
        text = eventually(lambda: out.read_text(),
                          lambda text: "resumed step" in text, 180, 1)
        stopped = re.search(r"stopped at step (\d+): checkpoint saved", text)
        assert stopped, text
        assert f"resumed step {stopped[1]} on 4 ranks" in text
        assert hashes(out, "resumed")[int(stopped[1])] == hashes(out, "saved")[int(stopped[1])]
        assert client.job(job_id).restart_count >= 1
    finally:
        client.cancel(job_id)
