"""Helpers for tests that run real gloo process groups on this host: `spawn(world, fn,
*args)` runs `fn(rank, world, *args)` in `world` processes joined in one process group,
and each rank's `report` lands in a JSON file the test reads back.

The workers live here, not in the test module, so torch.multiprocessing's spawn can import
them by name in each child."""

from __future__ import annotations

import json
import os
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from slurm_geo.torch.distributed import StorageReader, StorageWriter

RUN = "sharded-run"
# A dead rank fails its peers' collectives when gloo notices, at the latest after this.
GROUP_TIMEOUT = timedelta(seconds=60)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def spawn(world: int, fn: Any, *args: Any) -> None:
    mp.spawn(join, args=(world, free_port(), fn, args), nprocs=world, join=True)


def join(rank: int, world: int, port: int, fn: Any, args: tuple[Any, ...]) -> None:
    """Join a gloo process group of `world` ranks as `rank`, run fn(rank, world, *args)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=GROUP_TIMEOUT)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def report(directory: Path, rank: int, **values: Any) -> None:
    (directory / f"rank{rank}.json").write_text(json.dumps(values))


def reports(directory: Path) -> dict[int, dict[str, Any]]:
    return {int(p.stem.removeprefix("rank")): json.loads(p.read_text())
            for p in directory.glob("rank*.json")}


def full_state(seed: int) -> dict[str, torch.Tensor]:
    """The whole model: a 2-D weight whose rows and columns both split, a vector, a
    bfloat16 table, and an integer buffer."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "layer.weight": torch.randn(96, 40, generator=generator),
        "layer.bias": torch.randn(40, generator=generator),
        "embed": torch.randn(64, 24, generator=generator).to(torch.bfloat16),
        "counts": torch.arange(48, dtype=torch.int64) * seed,
    }


def sharded(state: dict[str, torch.Tensor], world: int, columns: bool) -> dict[str, Any]:
    """`state` as DTensors over all ranks: rows split (Shard(0)), or columns (Shard(1))
    for the 2-D tensors; the integer buffer replicated."""
    mesh = init_device_mesh("cpu", (world,))

    def placement(name: str, tensor: torch.Tensor) -> Any:
        if name == "counts":
            return Replicate()
        return Shard(1) if columns and tensor.dim() == 2 else Shard(0)

    return {name: distribute_tensor(t, mesh, [placement(name, t)]) for name, t in state.items()}


def writer(store: str, key_file: str, step: int, **kwargs: Any) -> StorageWriter:
    return StorageWriter(store, run=RUN, step=step, key_file=key_file, **kwargs)


def reader(store: str, key_file: str, step: int | None = None) -> StorageReader:
    return StorageReader(store, run=RUN, step=step, key_file=key_file)


def save(rank: int, world: int, store: str, key_file: str, step: int, seed: int,
         columns: bool = False) -> None:
    state = {"model": sharded(full_state(seed), world, columns),
             "trainer": {"step": step, "note": f"saved by {world} ranks"}}
    dcp.save(state, storage_writer=writer(store, key_file, step))


def load_and_compare(rank: int, world: int, store: str, key_file: str, step: int | None,
                     seed: int, columns: bool, out: str) -> None:
    expected = full_state(seed)
    state = {"model": sharded({k: torch.zeros_like(v) for k, v in expected.items()}, world,
                              columns),
             "trainer": {"step": -1, "note": ""}}
    try:
        dcp.load(state, storage_reader=reader(store, key_file, step))
    except BaseException as exc:  # DCP's CheckpointException is one; the test asserts on it
        report(Path(out), rank, error=str(exc))
        return
    equal = {name: bool(torch.equal(state["model"][name].full_tensor(), tensor))
             for name, tensor in expected.items()}
    report(Path(out), rank, equal=equal, trainer=state["trainer"],
           local_shapes={n: list(t.to_local().shape) for n, t in state["model"].items()})


def save_then_die_mid_write(rank: int, world: int, store: str, key_file: str, step: int,
                            seed: int) -> None:
    """Rank 2 stores half of its shards, then is killed as by the OOM killer."""
    if rank == 2:
        import slurm_geo.torch.distributed as module

        real = module.write_shards

        def half_then_die(repository: Any, run: str, tensors: Any, parent: Any) -> Any:
            real(repository, run, tensors[: max(1, len(tensors) // 2)], parent)
            os._exit(9)

        module.write_shards = half_then_die  # type: ignore[assignment]
    save(rank, world, store, key_file, step, seed)


def async_save_gated(rank: int, world: int, store: str, key_file: str, step: int, seed: int,
                     gate: str, out: str) -> None:
    """dcp.async_save whose first pack put waits for the file `gate`: what is committed
    when async_save returns, and after its future completes."""
    from slurm_geo.ckpt import LocalDirStore, Repository, load_master_key

    real_put = LocalDirStore.put

    def gated_put(self: Any, name: str, data: Any) -> None:
        if name.startswith("packs/"):
            while not Path(gate).exists():
                os.sched_yield()
        real_put(self, name, data)

    LocalDirStore.put = gated_put  # type: ignore[method-assign]
    saving_group = dist.new_group(backend="gloo")  # the background save's collectives
    state = {"model": sharded(full_state(seed), world, False),
             "trainer": {"step": step, "note": f"saved by {world} ranks"}}
    future = dcp.async_save(state, storage_writer=writer(store, key_file, step),
                            process_group=saving_group)
    repository = Repository(LocalDirStore(Path(store.removeprefix("file://"))),
                            load_master_key(Path(key_file)))
    committed_on_return = step in repository.steps(RUN)
    dist.barrier()
    if rank == 0:
        Path(gate).touch()
    future.result()
    dist.barrier()
    report(Path(out), rank, committed_on_return=committed_on_return,
           committed_after=step in repository.steps(RUN))


def save_with_changed_counts(rank: int, world: int, store: str, key_file: str, step: int
                             ) -> None:
    """The state of `save(seed=1)` but for one buffer."""
    state = full_state(1)
    state["counts"] = torch.arange(48, dtype=torch.int64) * 2
    dcp.save({"model": sharded(state, world, False),
              "trainer": {"step": step, "note": f"saved by {world} ranks"}},
             storage_writer=writer(store, key_file, step))


def async_save_in_a_process(rank: int, world: int, store: str, key_file: str, step: int,
                            seed: int) -> None:
    """dcp.async_save with DCP's process checkpointer: the writer is pickled into a
    checkpoint process of DCP's own, which writes and commits."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    state = {"model": sharded(full_state(seed), world, False),
             "trainer": {"step": step, "note": f"saved by {world} ranks"}}
    future = dcp.async_save(state, storage_writer=writer(store, key_file, step),
                            async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    future.result()


class FakeFederated:
    """What RankedRun asks of FederatedRun, on rank 0 (the only one asking the daemon):
    the lease is lost at its `fence_at`-th check, the daemon asks for the lease back at
    the `release_at`-th; an incarnation the daemon submitted (a lease secret), placed at
    `resume_step`."""

    def __init__(self, store: str, key_file: str, *, fence_at: int = 0, release_at: int = 0,
                 resume_step: int | None = None, store_env: dict[str, str] | None = None):
        from slurm_geo.lease.client import Placement

        self.placement = Placement(RUN, "rented", 7, 0, 1, resume_step, "", store, "",
                                   lease_secret="ab" * 32)
        self.store, self.key_file = store, key_file
        self.fence_at, self.release_at, self.checks = fence_at, release_at, 0
        self.release_requested = False
        self.reported: list[int] = []
        # The run's own S3 key, as the daemon sends it with the run key to an incarnation
        # submitted before its job named a run: rank 0 passes it on.
        self.store_env = dict(store_env or {})

    def acquire(self) -> None:
        pass

    def run_key(self) -> tuple[str, Any]:
        from slurm_geo.ckpt import LocalDirStore, load_master_key
        from slurm_geo.ckpt.repo.runkey import unwrap_run_keys

        store = LocalDirStore(Path(self.store.removeprefix("file://")))
        os.environ.update(self.store_env)  # only rank 0 asks, as FederatedRun.run_key does
        return RUN, unwrap_run_keys(store, load_master_key(Path(self.key_file)), RUN)

    def wait_for_lease(self) -> None:
        from slurm_geo.lease.client import Fenced

        self.checks += 1
        if self.checks == self.release_at:
            self.release_requested = True
        if self.checks == self.fence_at:
            raise Fenced("the daemon fenced this incarnation")

    def checkpointed(self, step: int) -> None:
        self.reported.append(step)

    def release(self, step: int | None) -> None:
        pass


def ranked_steps(rank: int, world: int, store: str, key_file: str,
                 scenarios: list[dict[str, Any]], out: str) -> None:
    """Per scenario, a fresh RankedRun's verdict at each of 8 steps (rank `stop_rank`
    asking to stop at `stop_at`, the fake lease fenced or released at a check); with a
    `resume_step`, the step every rank resumed."""
    from slurm_geo.torch.ranks import RankedRun

    results = []
    for scenario in scenarios:
        federated = FakeFederated(store, key_file, fence_at=scenario.get("fence_at", 0),
                                  release_at=scenario.get("release_at", 0),
                                  resume_step=scenario.get("resume_step"),
                                  store_env=scenario.get("store_env"))
        ranked = RankedRun(federated)  # type: ignore[arg-type]
        ranked.acquire()
        verdicts = [ranked.step_verdict(rank == scenario.get("stop_rank")
                                        and step == scenario.get("stop_at")).name
                    for step in range(1, 9)]
        resumed = None
        if "resume_step" in scenario:
            shapes = full_state(1)
            state = {"model": sharded({k: torch.zeros_like(v) for k, v in shapes.items()},
                                      world, True), "trainer": {"step": -1, "note": ""}}
            resumed = ranked.resume(state)
            assert state["trainer"]["step"] == resumed
        results.append({"verdicts": verdicts,
                        "keys": [k.hex() for k in ranked._run_key().data_keys],
                        "store_key": os.environ.get("AWS_SECRET_ACCESS_KEY"),
                        "resumed": resumed})
    report(Path(out), rank, results=results)


def save_twice(rank: int, world: int, store: str, key_file: str, steps: list[int]) -> None:
    for seed, step in enumerate(steps, start=1):
        save(rank, world, store, key_file, step, seed)
