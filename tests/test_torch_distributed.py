"""PyTorch Distributed Checkpoint into the slurm-geo store with real gloo process groups
of up to 4 ranks (tests/dcp_ranks.py's workers): resharded loads, all-or-nothing saves,
damage named, async saves, dedup across saves. Ranks run in processes of this host
(torch.multiprocessing, "here") or on the sandbox as alice's Slurm job, 2 tasks per node
launched by srun (4 ranks: both nodes). The resharded load runs both ways. The two whose
subject is what lies in the store (`HERE_ONLY`: the same bytes whoever launched the ranks)
run here; the five whose subject is what reaches every rank of a job (a killed rank, async
commits, a stop, the verified step: `SRUN_ONLY`) run under srun, where a job's ranks are.
Each pair run both ways cost the suite 15-30 s for nothing the other did not show."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from dcp_ranks import (
    RUN,
    async_save_gated,
    async_save_in_a_process,
    load_and_compare,
    ranked_steps,
    reports,
    save,
    save_then_die_mid_write,
    save_twice,
    save_with_changed_counts,
    spawn,
)

from slurm_geo.ckpt import LocalDirStore, Repository, create_master_key_file, load_master_key
from slurm_geo.ckpt.format.manifest import SHARDED_FORMAT
from slurm_geo.ckpt.format.names import manifest_name
from slurm_geo.ckpt.repo.runkey import rotate_run_keys
from tests.helpers import pack_files

pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parent


class RanksFailed(Exception):
    """A rank died or raised: the whole launch failed."""


@dataclass
class Ranks:
    """Where the ranks work (`directory`: the store, the key, their reports) and how
    they are launched: `launch(world, worker, *args)`."""

    directory: Path
    launch_with: Callable[[int, Callable, tuple], None]
    owner: int | None = None  # the uid the ranks run as, who must own what they write

    def subdirectory(self, name: str) -> Path:
        path = self.directory / name
        path.mkdir()
        if self.owner is not None:
            os.chown(path, self.owner, self.owner)
        return path

    def launch(self, world: int, worker: Callable, *args) -> None:
        self.launch_with(world, worker, args)

    def hand_over(self, path: Path) -> None:
        """What the test wrote under `path`, made the ranks' owner's."""
        if self.owner is not None:
            for item in [path, *path.rglob("*")]:
                os.chown(item, self.owner, self.owner)


def launch_here(world: int, worker: Callable, args: tuple) -> None:
    try:
        spawn(world, worker, *args)
    except Exception as exc:  # torch.multiprocessing: a rank died or raised
        raise RanksFailed(str(exc)) from exc


def srun_launcher(sandbox, directory: Path) -> Callable[[int, Callable, tuple], None]:
    from helpers import eventually, sbatch_as

    from slurm_geo.sandbox.users import ALICE
    from slurm_geo.slurm import CliSlurmClient
    from slurm_geo.slurm.models import JobState

    for name in ("dcp_ranks.py", "dcp_srun.py"):  # alice cannot read root's checkout
        shutil.copy(TESTS / name, directory / name)
    client = CliSlurmClient("onprem", sandbox.layout.onprem.slurm_conf, timeout_s=10)

    def launch(world: int, worker: Callable, args: tuple) -> None:
        out = directory / f"{worker.__name__}-{world}.out"
        script = "\n".join([
            "#!/bin/bash",
            f"#SBATCH --nodes={max(1, world // 2)} --ntasks-per-node={min(world, 2)}",
            f"#SBATCH --output={out} --open-mode=append",
            f"cd {directory}",
            f"srun python dcp_srun.py {worker.__name__} '{json.dumps(list(args))}'", ""])
        submitted = sbatch_as(sandbox, ALICE, script)
        assert submitted.returncode == 0, submitted.stderr
        job = eventually(lambda: client.job(int(submitted.stdout.strip())),
                         lambda job: job.state.is_terminal(), 240, 1)
        if job.state is not JobState.COMPLETED:
            raise RanksFailed(f"job {job.job_id} ended {job.state.value}: "
                              f"{out.read_text()[-2000:] if out.exists() else ''}")
    return launch


@pytest.fixture(params=["here", pytest.param("srun", marks=pytest.mark.sandbox)])
def ranks(request, tmp_path: Path) -> Ranks:
    if request.param == "here":
        return Ranks(tmp_path, launch_here)
    from slurm_geo.sandbox.users import ALICE
    from tests.kit.sandbox import user_dir

    sandbox = request.getfixturevalue("sandbox")
    directory = user_dir(sandbox, ALICE, f"dcp-{request.node.name}")
    return Ranks(directory, srun_launcher(sandbox, directory), owner=ALICE.uid)


HERE_ONLY = pytest.mark.parametrize("ranks", ["here"], indirect=True)
SRUN_ONLY = pytest.mark.parametrize(
    "ranks", [pytest.param("srun", marks=pytest.mark.sandbox)], indirect=True)


@pytest.fixture
def site(ranks: Ranks) -> tuple[str, str, Repository]:
    store, key_file = ranks.subdirectory("store"), ranks.directory / "master.key"
    create_master_key_file(key_file)
    if ranks.owner is not None:
        os.chown(key_file, ranks.owner, ranks.owner)
    repository = Repository(LocalDirStore(store), load_master_key(key_file))
    return f"file://{store}", str(key_file), repository


def loaded(ranks: Ranks, world: int, store: str, key_file: str, step: int | None,
           seed: int, columns: bool) -> dict[int, dict]:
    out = ranks.subdirectory(f"load-{world}-{columns}-{step}")
    ranks.launch(world, load_and_compare, store, key_file, step, seed, columns, str(out))
    return reports(out)


def test_saved_on_4_ranks_it_loads_on_2_and_on_4_with_another_sharding(ranks, site):
    store, key_file, repository = site
    ranks.launch(4, save, store, key_file, 10, 1)

    manifest = repository.manifest(RUN, 10)
    assert manifest.format == SHARDED_FORMAT and manifest.sharded is not None
    assert manifest.sharded.ranks == 4
    weight = next(i for i in manifest.sharded.items if i.fqn == "model.layer.weight")
    assert [s.offsets for s in weight.shards] == [(0, 0), (24, 0), (48, 0), (72, 0)]
    assert repository.verify(RUN, 10) == []

    for world, columns in ((2, True), (4, True), (2, False)):
        seen = loaded(ranks, world, store, key_file, None, 1, columns)
        assert sorted(seen) == list(range(world))
        for rank, result in seen.items():
            assert "error" not in result, result
            assert all(result["equal"].values()), (world, columns, rank, result)
            assert result["trainer"] == {"step": 10, "note": "saved by 4 ranks"}
        if columns:  # really resharded: each rank holds a column block now
            assert seen[0]["local_shapes"]["layer.weight"] == [96, 40 // world]


@SRUN_ONLY
def test_a_save_interrupted_by_a_killed_rank_is_never_listed_and_the_previous_stays(
        ranks, site):
    store, key_file, repository = site
    ranks.launch(4, save, store, key_file, 10, 1)
    with pytest.raises(RanksFailed):
        ranks.launch(4, save_then_die_mid_write, store, key_file, 20, 2)

    assert repository.steps(RUN) == [10]
    assert repository.latest(RUN) == 10
    assert not repository.store.exists(manifest_name(RUN, 20))
    assert repository.verify(RUN, 10) == []
    seen = loaded(ranks, 4, store, key_file, None, 1, False)
    assert all(all(r["equal"].values()) for r in seen.values()), seen


@HERE_ONLY
def test_a_flipped_bit_in_any_ranks_data_fails_the_load_naming_the_object(ranks, site):
    store, key_file, repository = site
    ranks.launch(4, save, store, key_file, 10, 1)
    manifest = repository.manifest(RUN, 10)
    # The pack holding the last rank's rows of the weight (offset 72): not the coordinator's.
    stored = next(t for t in manifest.tensors if t.path == "model.layer.weight@72,0")
    pack = manifest.pack_object(stored.chunks[0].pack)
    path = Path(store.removeprefix("file://")) / pack
    data = bytearray(path.read_bytes())
    data[stored.chunks[0].offset + 40] ^= 0x01
    path.write_bytes(bytes(data))

    seen = loaded(ranks, 4, store, key_file, 10, 1, False)
    assert seen and all("error" in r for r in seen.values()), seen
    assert any(pack in r["error"] for r in seen.values()), seen
    assert {f.name for f in repository.verify(RUN, 10)} == {pack}


@SRUN_ONLY
def test_async_save_returns_before_the_data_is_durable_and_commits_after(ranks, site):
    store, key_file, repository = site
    out = ranks.subdirectory("async")
    ranks.launch(4, async_save_gated, store, key_file, 30, 3, str(out / "gate"), str(out))
    seen = reports(out)
    assert sorted(seen) == [0, 1, 2, 3]
    assert all(r == {"committed_on_return": False, "committed_after": True}
               for r in seen.values()), seen
    assert repository.steps(RUN) == [30]
    assert all(all(r["equal"].values())
               for r in loaded(ranks, 2, store, key_file, 30, 3, True).values())


@SRUN_ONLY
def test_async_save_through_dcps_checkpoint_process_commits_a_checkpoint_that_loads(
        ranks, site):
    store, key_file, repository = site
    ranks.launch(2, async_save_in_a_process, store, key_file, 40, 4)
    assert repository.steps(RUN) == [40]
    seen = loaded(ranks, 2, store, key_file, 40, 4, True)
    assert sorted(seen) == [0, 1] and all(all(r["equal"].values()) for r in seen.values())


@HERE_ONLY
def test_a_second_save_of_a_partly_frozen_model_writes_only_the_changed_shards(ranks, site):
    store, key_file, repository = site
    ranks.launch(4, save, store, key_file, 1, 1)
    packs_before = _pack_sizes(store)
    ranks.launch(4, save_with_changed_counts, store, key_file, 2)  # one buffer changed
    packs_after = _pack_sizes(store)

    first, second = repository.manifest(RUN, 1), repository.manifest(RUN, 2)
    assert second.parent_step == 1
    old_refs = {r.id: r for r in first.refs()}
    changed = {t.path for t in second.tensors if any(r.id not in old_refs for r in t.chunks)}
    assert changed == {"model.counts@0", "trainer.step"}  # the buffer; the step DCP pickles
    kept = [t for t in second.tensors if t.path not in changed]
    assert kept and all(old_refs[r.id] == r for t in kept for r in t.chunks)
    new_packs = {name: size for name, size in packs_after.items() if name not in packs_before}
    assert {r.pack for t in second.tensors if t.path in changed for r in t.chunks} == {
        Path(name).name for name in new_packs}
    assert sum(new_packs.values()) < 0.05 * sum(packs_before.values())


def _pack_sizes(store: str) -> dict[str, int]:
    root = Path(store.removeprefix("file://"))
    return {str(p.relative_to(root)): p.stat().st_size for p in pack_files(root)}


SCENARIOS = [  # (what happens, the verdicts every rank must see first)
    ({"stop_rank": 2, "stop_at": 3}, ["TRAIN", "TRAIN", "STOP"]),
    ({"fence_at": 4}, ["TRAIN", "TRAIN", "TRAIN", "FENCED"]),
    ({"release_at": 2, "stop_rank": 3, "stop_at": 5}, ["TRAIN", "RELEASE"]),
    ({"store_env": {"AWS_ACCESS_KEY_ID": "run-a-key", "AWS_SECRET_ACCESS_KEY": "s3cret"}},
     ["TRAIN"]),
]


@SRUN_ONLY
def test_a_stop_a_release_or_a_fence_reaches_every_rank_at_the_same_step(ranks, site):
    """The verdict of each step is the same on every rank, whichever rank (or rank 0's
    lease) caused it; and every rank holds the run's key ring rank 0 got (here rotated
    once: two keys), and the run's store key when the daemon sent one with it."""
    store, key_file, repository = site
    repository.create_run_key(RUN)
    rotate_run_keys(repository, RUN)
    ring = [k.hex() for k in repository.run_keys(RUN).data_keys]
    ranks.hand_over(Path(store.removeprefix("file://")))
    out = ranks.subdirectory("verdicts")
    ranks.launch(4, ranked_steps, store, key_file, [s for s, _ in SCENARIOS], str(out))
    seen = reports(out)
    assert sorted(seen) == [0, 1, 2, 3]
    for index, (_scenario, expected) in enumerate(SCENARIOS):
        firsts = {rank: r["results"][index]["verdicts"][:len(expected)]
                  for rank, r in seen.items()}
        assert all(first == expected for first in firsts.values()), (index, firsts)
        assert all(r["results"][index]["keys"] == ring for r in seen.values())
    assert {r["results"][3]["store_key"] for r in seen.values()} == {"s3cret"}


@SRUN_ONLY
def test_every_rank_resumes_the_step_the_daemon_verified_not_the_newest(ranks, site):
    store, key_file, repository = site
    ranks.launch(4, save_twice, store, key_file, [10, 20])
    assert repository.steps(RUN) == [10, 20]
    out = ranks.subdirectory("resumed")
    ranks.launch(2, ranked_steps, store, key_file, [{"resume_step": 10}], str(out))
    assert {rank: r["results"][0]["resumed"] for rank, r in reports(out).items()} == {
        0: 10, 1: 10}
