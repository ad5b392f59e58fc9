"""A moved job's world on every node of its allocation, on the sandbox's Slurm (issue 31
item 3; stage.steps): a job of alice's on two nodes of onprem runs the preamble
(stage.preamble.enter_world, the store and key reply given as the daemon's would be) with
a script whose `srun` step starts one task on each node. The world step presents the
world on both (onprem-n2's fetched from the store there, onprem-n1's the batch step's);
each task hashes the input at its home path: both match the data staged; bob cannot read
the trees materialised for the tasks; nothing of the job's world is left on either node
when it ends. Runs on the sandbox SLURM_GEO_SANDBOX_DIR names.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_geo.sandbox import Sandbox
from slurm_geo.sandbox.users import ALICE, BOB
from slurm_geo.slurm import CliSlurmClient
from slurm_geo.slurm.models import JobState
from tests.helpers import as_uid, eventually, reachable_dir, sbatch_as
from tests.kit.sandbox import user_dir
from tests.kit.stage import stage_world

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

DRIVER = """
import json, os, sys
from pathlib import Path
from slurm_geo.ckpt.stores.store import LocalDirStore
from slurm_geo.lease.protocol import KeyReply
from slurm_geo.policy.world import Input, World
from slurm_geo.stage.preamble import enter_world
from slurm_geo.stage.steps import seal_node_keys

here = Path(sys.argv[1])
reply = KeyReply.from_json(json.loads((here / "reply.json").read_text()))
store = LocalDirStore(Path(os.environ["SLURM_GEO_STORE"].removeprefix("file://")))
world = World((Input(os.environ["SLURM_GEO_INPUTS"]),))
sys.exit(enter_world(reply, store, (here / "script.sh").read_bytes(), world,
                     os.environ["SLURM_JOB_ID"], node_keys=seal_node_keys(reply, os.environ)))
"""

# The job's own script, run in its world on the batch node: one task on each node.
SCRIPT = """#!/bin/bash
srun --ntasks=2 --ntasks-per-node=1 bash -c '
  sum=$(sha256sum < "$SLURM_GEO_WORLD_ROOT$DATA_HOME/tokens.bin")
  echo "task $SLURM_PROCID node $SLURMD_NODENAME mode $SLURM_GEO_WORLD_MODE" \\
    "sha ${sum%% *} input $SLURM_GEO_INPUT_0 pwd $(pwd)"
  touch "$FLAGS/ready-$SLURM_PROCID"
  for i in $(seq 600); do [ -e "$FLAGS/go" ] && break; sleep 0.2; done'
echo "script done $?"
"""


@pytest.fixture
def base() -> Iterator[Path]:
    """Node-local scratch for both "nodes" (one machine), as /scratch would be."""
    with reachable_dir("steps", 0o1777, "/var/tmp") as path:
        yield path


def test_every_task_of_an_srun_step_on_two_nodes_reads_the_world_at_its_home_path(
        sandbox: Sandbox, base: Path) -> None:
    staged = stage_world(base, "steps")
    scratch = base / "scratch"
    scratch.mkdir(mode=0o1777)
    scratch.chmod(0o1777)
    job_dir = user_dir(sandbox, ALICE, "stage-steps")
    flags = job_dir / "flags"
    flags.mkdir()
    (job_dir / "reply.json").write_text(json.dumps(staged.reply.to_json()))
    (job_dir / "driver.py").write_text(DRIVER)
    (job_dir / "script.sh").write_text(SCRIPT)
    for path in (flags, *job_dir.iterdir()):
        os.chown(path, ALICE.uid, ALICE.uid)
    (job_dir / "reply.json").chmod(0o600)
    out = job_dir / "job.out"
    job_script = "\n".join([
        "#!/bin/bash",
        f"#SBATCH --nodes=2 --ntasks-per-node=1 --output={out}",
        f"export SLURM_GEO_STORE=file://{base / 'store'} SLURM_GEO_SCRATCH={scratch}",
        f"export SLURM_GEO_INPUTS={staged.data_home} DATA_HOME={staged.data_home}",
        f"export FLAGS={flags} SLURM_GEO_LEASE_SECRET={os.urandom(32).hex()}",
        f"cd {job_dir}",
        f"exec python {job_dir / 'driver.py'} {job_dir}", ""])
    submitted = sbatch_as(sandbox, ALICE, job_script)
    assert submitted.returncode == 0, submitted.stderr
    job_id = int(submitted.stdout.strip())
    client = CliSlurmClient("onprem", sandbox.layout.onprem.slurm_conf, timeout_s=10)
    mine = scratch / f"slurm-geo-{ALICE.uid}"
    try:
        eventually(lambda: sorted(flags.glob("ready-*")), lambda found: len(found) == 2
                   or client.job(job_id).state.is_terminal(), 240, 0.5)
        node_worlds = sorted(mine.glob(f"job-{job_id}.*"))
        assert [p.name for p in node_worlds] == [f"job-{job_id}.onprem-n1",
                                                 f"job-{job_id}.onprem-n2"], (
            node_worlds, out.read_text() if out.exists() else "")
        fetched = mine / f"job-{job_id}.onprem-n2" / "world" / \
            staged.data_home.lstrip("/") / "tokens.bin"
        assert fetched.read_bytes() == staged.files["tokens.bin"]  # fetched on n2
        bob = as_uid(BOB.uid, fetched.read_bytes)
        assert bob.startswith("PermissionError"), bob
        bob = as_uid(BOB.uid, lambda: os.listdir(mine / f"job-{job_id}" / "world"))
        assert bob.startswith("PermissionError"), bob
    finally:
        (flags / "go").touch()
    job = eventually(lambda: client.job(job_id), lambda job: job.state.is_terminal(), 120, 1)
    said = out.read_text()
    assert job.state is JobState.COMPLETED, said
    digest = hashlib.sha256(staged.files["tokens.bin"]).hexdigest()
    tasks = {int(m[1]): m.groups()[1:] for m in re.finditer(
        r"task (\d+) node (\S+) mode (\S+) sha (\w+) input (\S+) pwd (\S+)", said)}
    assert sorted(tasks) == [0, 1], said
    assert {t[0] for t in tasks.values()} == {"onprem-n1", "onprem-n2"}, said
    for _node, mode, sha, input_0, pwd in tasks.values():
        assert sha == digest, said
        assert mode in ("namespace", "mapped"), said
        if mode == "namespace":
            assert input_0 == staged.data_home and pwd == staged.work_home, said
    assert "slurm-geo: world: on every node of the allocation" in said, said
    assert "script done 0" in said, said
    deadline = time.time() + 30
    while any(mine.glob(f"job-{job_id}*")) and time.time() < deadline:
        time.sleep(0.5)
    assert not list(mine.glob(f"job-{job_id}*")), "the job's world outlived it"
