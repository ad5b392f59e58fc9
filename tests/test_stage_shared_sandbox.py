"""Dedup across users on a sandbox (issue 31 item 2): alice's and then bob's jobs at home
declare the same world-readable dataset; the real daemon grants each, over MUNGE, its own
tree and the dataset's shared one; alice's job stages the dataset into the shared tree,
and bob's job stores no new chunk there: both runs' world records pin the same snapshot.

Runs on the sandbox SLURM_GEO_SANDBOX_DIR names.
"""

from __future__ import annotations

import os
import shutil
import time

import pytest

from slurm_geo.ckpt import LocalDirStore
from slurm_geo.ckpt.errors import CkptError
from slurm_geo.ckpt.format.keys import LiveKeyFile
from slurm_geo.ckpt.repo.runkey import unwrap_run_keys
from slurm_geo.drills import drill
from slurm_geo.sandbox import Sandbox
from slurm_geo.sandbox.users import ALICE, BOB, SandboxUser, job_environment
from slurm_geo.slurm import JobSpec
from slurm_geo.stage.names import tree_packs_prefix
from slurm_geo.stage.record import PinnedTree, read_world_record
from tests.kit.sandbox import user_dir

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

SETTINGS = drill.DrillSettings(steps=400, ckpt_every=20, step_delay_s=0.1)


def test_a_second_users_job_on_a_world_readable_dataset_stages_no_new_chunk(
        sandbox: Sandbox) -> None:
    from slurm_geo.config.model import load_config
    from slurm_geo.config.paths import master_key_path
    from slurm_geo.federation.state.open import federation_config
    from slurm_geo.slurm import connect

    site = load_config(sandbox.layout.site_config)
    onprem = connect(site.cluster("onprem"))
    store = LocalDirStore(site.stores[site.cluster("onprem").store].url
                          .removeprefix("file://"))
    keys = LiveKeyFile(master_key_path(federation_config(site).key_file, os.environ))
    stamp = int(time.time())
    data = sandbox.layout.projects_dir / f"shared-dataset-{stamp}"  # root's, 0755: public
    data.mkdir(mode=0o755)
    data.chmod(0o755)
    for n in range(2):
        (data / f"tokens-{n}.bin").write_bytes(os.urandom(2 << 20))
        (data / f"tokens-{n}.bin").chmod(0o644)

    def submit(person: SandboxUser) -> tuple[str, int]:
        run = f"shared-{person.name}-{stamp}"
        work = user_dir(sandbox, person, "shared-world") / run
        work.mkdir(parents=True, exist_ok=True)
        os.chown(work, person.uid, person.uid)
        script = drill.training_script(site, run, SETTINGS, work, work / "trace.log")
        script = script.replace("#SBATCH --geo-failover=auto",
                                f"#SBATCH --geo-failover=auto\n#SBATCH --geo-inputs={data}")
        return run, onprem.submit(JobSpec(
            script=script, name="geo-shared", working_dir=work, owner=person.owner,
            environment={**job_environment(sandbox.layout, person),
                         "SLURM_GEO_CONFIG": str(site.source)}))

    def pin(run: str) -> PinnedTree | None:
        try:
            record = read_world_record(store, unwrap_run_keys(store, keys, run), run)
        except CkptError:  # its key or record not there yet
            return None
        return None if record is None else record.pinned(str(data))

    jobs = []
    try:
        alice_run, alice_job = submit(ALICE)
        jobs.append(alice_job)
        hers = drill.wait_for(lambda: pin(alice_run), time.time() + 300,
                              f"{alice_run}'s dataset staged and pinned")
        stored = sum(store.sizes(tree_packs_prefix(hers.domain)).values())
        assert stored > 4 << 20  # random: stored whole, once
        bob_run, bob_job = submit(BOB)
        jobs.append(bob_job)
        his = drill.wait_for(lambda: pin(bob_run), time.time() + 300,
                             f"{bob_run}'s dataset staged and pinned")
        assert (his.tree, his.domain, his.snapshot, his.manifest_sha256) == (
            hers.tree, hers.domain, hers.snapshot, hers.manifest_sha256)
        assert sum(store.sizes(tree_packs_prefix(hers.domain)).values()) == stored
    finally:
        for job_id in jobs:
            onprem.cancel(job_id)
        shutil.rmtree(data)
