"""Same-cluster semantics of geo jobs on the real sandbox, with a real PyTorch trainer
(python -m slurm_geo.examples.train, CPU):

- on its time limit, a job with --geo-ckpt-dir gets SIGUSR1 (its default --signal),
  checkpoints, is requeued and continues from the step it reached;
- when its node dies (slurmd, slurmstepd and the trainer killed), it is requeued on the
  other node and resumes from its newest checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import psutil
import pytest
from helpers import eventually, sbatch_as

from slurm_geo.ckpt import LocalDirStore
from slurm_geo.ckpt.format.keys import create_master_key_file
from slurm_geo.hooks.node import newest_steps
from slurm_geo.sandbox import Sandbox
from slurm_geo.sandbox.processes import has_marker
from slurm_geo.sandbox.users import ALICE, job_environment, run_as
from slurm_geo.slurm import CliSlurmClient
from slurm_geo.slurm.models import JobState
from tests.kit.sandbox import user_dir

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

RUN = "trainer"
CKPT_EVERY = 1000


@pytest.fixture
def job_dir(sandbox: Sandbox, request) -> Path:
    """A fresh directory of alice's, whose jobs these are, with a key of her own: the
    site's master key is the daemons' alone."""
    path = user_dir(sandbox, ALICE, f"geo-{request.node.name}")
    key = path / "alice.key"
    create_master_key_file(key)
    os.chown(key, ALICE.uid, ALICE.uid)
    return path


def trainer_script(sandbox: Sandbox, ckpt: Path, out: Path, steps: int,
                   extra: list[str]) -> str:
    return "\n".join([
        "#!/bin/bash",
        f'#SBATCH --geo-ckpt-dir="{ckpt}"',
        "#SBATCH --geo-cost-center=ml-research",
        # Under alice's own key, which checkpoint-sync does not hold: her runs stay home.
        "#SBATCH --geo-residency=home",
        f"#SBATCH --output={out}",
        "#SBATCH --open-mode=append",
        *[f"#SBATCH {arg}" for arg in extra],
        'echo "incarnation ${SLURM_RESTART_COUNT:-0} on $SLURMD_NODENAME pid $$ uid $(id -u)"',
        f'echo $$ > "{ckpt.parent}/trainer.pid"',
        # exec: --signal=B:USR1 reaches only the batch shell, which becomes the trainer
        f'exec python -m slurm_geo.examples.train --run {RUN} '
        f'--store "$SLURM_GEO_CKPT_DIR" --key-file {ckpt.parent / "alice.key"} '
        f'--steps {steps} --ckpt-every {CKPT_EVERY}',
    ]) + "\n"


def submit(sandbox: Sandbox, script: str) -> int:
    result = sbatch_as(sandbox, ALICE, script)
    assert result.returncode == 0, result.stderr
    return int(result.stdout.strip())


def onprem(sandbox: Sandbox) -> CliSlurmClient:
    return CliSlurmClient("onprem", sandbox.layout.onprem.slurm_conf, timeout_s=10)


def incarnations(out: Path) -> list[dict]:
    """Per incarnation, from the job's output: node, the step it started at, where it stopped."""
    found: list[dict] = []
    text = out.read_text() if out.exists() else ""
    for line in text.splitlines():
        if m := re.match(r"incarnation (\d+) on (\S+) pid \d+ uid (\d+)", line):
            found.append({"restart": int(m[1]), "node": m[2], "uid": int(m[3])})
        elif (m := re.match(r"started at step (\d+)", line)) and found:
            found[-1]["started"] = int(m[1])
        elif (m := re.match(r"stopped at step (\d+)", line)) and found:
            found[-1]["stopped"] = int(m[1])
        elif (m := re.match(r"final step (\d+)", line)) and found:
            found[-1]["final"] = int(m[1])
    return found


def steps_saved(ckpt: Path) -> list[int]:
    return newest_steps(LocalDirStore(ckpt)).get(RUN, []) if ckpt.is_dir() else []


def test_time_limit_checkpoints_requeues_and_continues(sandbox, job_dir):
    """--time=1 and no --signal or --requeue of its own: the site's defaults apply."""
    ckpt, out = job_dir / "ckpt", job_dir / "train.out"
    submitted = time.monotonic()
    job_id = submit(sandbox, trainer_script(sandbox, ckpt, out, 10**7, ["--time=1"]))
    client = onprem(sandbox)
    try:
        def resumed_and_progressing() -> list[dict]:
            seen = incarnations(out)
            if len(seen) >= 2 and "started" in seen[1]:
                saved = steps_saved(ckpt)
                seen[1]["saved_since"] = [s for s in saved if s > seen[1]["started"]]
            return seen

        seen = eventually(resumed_and_progressing,
                          lambda s: len(s) >= 2 and bool(s[1].get("saved_since")), 150, 1)
        first, second = seen[0], seen[1]
        assert first["started"] == 0
        assert first["uid"] == second["uid"] == ALICE.uid
        assert first["stopped"] == first["final"] > 0       # final checkpoint at the signal
        assert second["restart"] == 1
        assert second["started"] == first["stopped"]         # nothing trained twice
        assert client.job(job_id).restart_count >= 1
        marker = json.loads((ckpt / ".slurm-geo" / f"prolog-onprem-{job_id}-1.json")
                            .read_text())
        # The node holds no key: the newest step by name; alice's resume verifies it.
        assert marker["newest"] == [{"run": RUN, "step": first["stopped"]}]
        record = json.loads((ckpt / ".slurm-geo" / f"job-onprem-{job_id}.json").read_text())
        assert record["incarnations"][0]["reason"] == "requeued"
        assert record["incarnations"][0]["final_checkpoint"] == {"run": RUN,
                                                                 "step": first["stopped"]}
        print(f"stopped at step {first['stopped']}, resumed at {second['started']}; "
              f"submit to resumed progress: {time.monotonic() - submitted:.0f} s")
    finally:
        client.cancel(job_id)


def kill_node_under_job(sandbox: Sandbox, node: str, trainer_pid: int, job_id: int) -> None:
    """What a node's death does to a job: its slurmd, slurmstepd and the trainer gone at
    once. Only processes this sandbox started are touched, each by its pid."""
    slurmd = sandbox.processes.running_pid(node)
    assert slurmd is not None, f"{node}'s slurmd is not running"
    trainer = psutil.Process(trainer_pid)
    assert f"SLURM_JOB_ID={job_id}".encode() in \
        Path(f"/proc/{trainer_pid}/environ").read_bytes().split(b"\0")
    stepd = trainer.parent()
    assert stepd is not None and stepd.cmdline()[0].startswith("slurmstepd")
    assert has_marker(stepd.pid, sandbox.layout.root)
    for pid in (slurmd, stepd.pid, trainer_pid):
        os.kill(pid, signal.SIGKILL)


def test_node_death_requeues_on_the_other_node_from_the_newest_checkpoint(sandbox,
                                                                          job_dir):
    ckpt, out = job_dir / "ckpt", job_dir / "train.out"
    job_id = submit(sandbox, trainer_script(sandbox, ckpt, out, 14000, []))
    client = onprem(sandbox)
    killed_node = None
    try:
        eventually(lambda: steps_saved(ckpt), lambda s: len(s) >= 2, 90, 0.2)
        killed_node = incarnations(out)[0]["node"]
        kill_node_under_job(sandbox, killed_node, int((job_dir / "trainer.pid").read_text()),
                            job_id)
        newest_at_death = steps_saved(ckpt)[-1]
        killed_at = time.monotonic()
        done = eventually(lambda: client.job(job_id), lambda j: j.state.is_terminal(), 180, 1)
        assert done.state is JobState.COMPLETED
        assert done.restart_count >= 1
        seen = incarnations(out)
        assert seen[-1]["node"] != killed_node
        assert seen[-1]["started"] == newest_at_death       # at most one interval again
        assert seen[-1]["final"] == 14000
        print(f"node death to completion: {time.monotonic() - killed_at:.0f} s")
    finally:
        client.cancel(job_id)
        if killed_node is not None:
            sandbox.up(progress=lambda _msg: None)  # restarts the killed slurmd
            eventually(lambda: {n.name: n for n in client.nodes()}[killed_node],
                       lambda n: n.available, 90, 1)


def test_restarts_are_capped(sandbox, job_dir):
    """The sandbox allows 2 restarts: a job that keeps asking to be requeued is held when
    queued a third time, and the registry says why."""
    from slurm_geo.config import load_config
    from slurm_geo.registry import IncarnationState, Registry

    site = load_config(sandbox.layout.site_config)
    limit = site.policy.max_restarts
    out = job_dir / "loop.out"
    script = "\n".join([
        "#!/bin/bash",
        f'#SBATCH --geo-ckpt-dir="{job_dir / "ckpt"}"',
        "#SBATCH --geo-cost-center=ml-research",
        # Under alice's own key, which checkpoint-sync does not hold: her runs stay home.
        "#SBATCH --geo-residency=home",
        f"#SBATCH --output={out}",
        "#SBATCH --open-mode=append",
        'echo "incarnation ${SLURM_RESTART_COUNT:-0}"',
        'scontrol requeue "$SLURM_JOB_ID"',
        "sleep 60",
    ]) + "\n"
    job_id = submit(sandbox, script)
    client = onprem(sandbox)
    try:
        held = eventually(lambda: client.job(job_id), lambda j: j.held, 40 * (limit + 1), 1)
        assert held.restart_count == limit + 1
        assert held.reason == "JobHeldAdmin"
        with Registry(site.registry_path) as registry:
            states = [i.state for i in registry.incarnations("onprem", job_id)]
            reason = registry.job("onprem", job_id)["held_reason"]
        assert states == [IncarnationState.REQUEUED] * (limit + 1)
        assert reason == f"requeued {limit + 1} times without planning it (node failures, " \
                         f"crashes; max_restarts = {limit})"
        shown = run_as(ALICE, ["squeue", "--noheader", f"--jobs={job_id}", "--format=%r|%k"],
                       env={**job_environment(sandbox.layout, ALICE),
                            "SLURM_CONF": str(sandbox.layout.onprem.slurm_conf)},
                       capture_output=True, text=True, timeout=30, check=True)
        assert shown.stdout.strip() == f"JobHeldAdmin|geo: held: {reason}; fix the job, " \
                                       "then ask an admin to release it"
    finally:
        client.cancel(job_id)


def test_a_job_surviving_three_time_limits_is_never_held(sandbox, job_dir):
    """What a time limit does to a job, three times over with max_restarts = 2: the warning
    signal (sent here at once, as Slurm does a minute before the limit), a final checkpoint,
    a requeue the trainer marks as planned. The job is never held; the fourth incarnation
    trains on from where the third stopped."""
    from slurm_geo.config import load_config
    from slurm_geo.registry import Registry

    site = load_config(sandbox.layout.site_config)
    limit = site.policy.max_restarts
    ckpt, out = job_dir / "ckpt", job_dir / "train.out"
    job_id = submit(sandbox, trainer_script(sandbox, ckpt, out, 10**7, []))
    client = onprem(sandbox)

    def started(count: int) -> list[dict]:
        return eventually(lambda: incarnations(out),
                          lambda seen: len(seen) >= count and "started" in seen[count - 1],
                          120, 0.5)

    try:
        for restart in range(limit + 1):
            started(restart + 1)
            signalled = run_as(ALICE, ["scancel", "--batch", "--signal=USR1", str(job_id)],
                               env={**job_environment(sandbox.layout, ALICE),
                                    "SLURM_CONF": str(sandbox.layout.onprem.slurm_conf)},
                               capture_output=True, text=True, timeout=30, check=False)
            assert signalled.returncode == 0, signalled.stderr
        seen = started(limit + 2)
        job = client.job(job_id)
        assert not job.held and job.restart_count == limit + 1
        for before, after in zip(seen, seen[1:], strict=False):
            assert before["stopped"] == before["final"] == after["started"]
        with Registry(site.registry_path) as registry:
            ended = registry.incarnations("onprem", job_id)[:limit + 1]
            assert [i.planned for i in ended] == [True] * (limit + 1)
            assert registry.unplanned_requeues("onprem", job_id) == 0
            assert registry.job("onprem", job_id)["held_reason"] is None
    finally:
        client.cancel(job_id)
