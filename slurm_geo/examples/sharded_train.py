"""A small, deterministic training script of many ranks (srun or torchrun, gloo on CPU):
an MLP sharded with FSDP2, AdamW, checkpointed through DCP into a slurm-geo store.

    srun python -m slurm_geo.examples.sharded_train --run RUN --federated \\
        --steps N --ckpt-every K
    python -m torch.distributed.run --nproc-per-node 4 .../examples/sharded_train.py --run RUN \\
        --store file:///DIR --key-file F --steps N --ckpt-every K

With --federated rank 0 holds the run's lease (slurm_geo.torch.ranks.RankedRun) and every
rank gets the run key from it; without, every rank opens the store with --key-file.

It resumes from the run's newest checkpoint that loads (a new generation the daemon
placed: from the step it verified), on however many ranks it has now: DCP reshards. It
trains to step N, checkpointing every K steps; rank 0 prints `saved step S weights H`
after each checkpoint, `resumed step S weights H` after loading one and `final step N
weights H` at the end, where H is the SHA-256 of the whole (unsharded) model, so a run
moved, resumed or resharded can be compared with one run straight through. On SIGUSR1 to
any rank (sbatch --signal=USR1@T signals every task of srun), or at --stop-after, every
rank saves the same final step; rank 0 asks Slurm to requeue the job, all exit 75.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from slurm_geo.ckpt import Repository, load_master_key
from slurm_geo.ckpt.stores.open_store import open_store_or_named
from slurm_geo.errors import SlurmGeoError
from slurm_geo.lease.client import Fenced
from slurm_geo.torch.distributed import StorageReader, StorageWriter
from slurm_geo.torch.exit import run_rank
from slurm_geo.torch.ranks import RankedRun, Verdict
from slurm_geo.torch.signals import EXIT_REQUEUE, RequeueOnSignal

SAMPLES, FEATURES, HIDDEN, OUTPUTS, GLOBAL_BATCH = 512, 16, 64, 4, 32
BATCHES_PER_EPOCH = SAMPLES // GLOBAL_BATCH


def init_ranks() -> tuple[int, int]:
    """Join the job's process group: srun's task ids, else torchrun's variables. Rank 0's
    node is srun's launch node; the port follows from the job id (one job per port)."""
    rank = int(os.environ.get("SLURM_PROCID", os.environ.get("RANK", "0")))
    world = int(os.environ.get("SLURM_NTASKS", os.environ.get("WORLD_SIZE", "1")))
    os.environ.setdefault("MASTER_ADDR", os.environ.get("SLURM_LAUNCH_NODE_IPADDR",
                                                        "127.0.0.1"))
    os.environ.setdefault("MASTER_PORT",
                          str(20000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 20000))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(minutes=5))
    return rank, world


def build(hidden: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same initial weights on every rank, before sharding
    model = nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                          nn.ReLU(), nn.Linear(hidden, OUTPUTS))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(SAMPLES, FEATURES, generator=generator)
    weights = torch.randn(FEATURES, OUTPUTS, generator=generator)
    return inputs, inputs @ weights + 0.1 * torch.randn(SAMPLES, OUTPUTS, generator=generator)


def local_batch(data: tuple[torch.Tensor, torch.Tensor], position: int, rank: int,
                world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of global batch `position` (the epoch's shuffle comes from the
    position): the same global batch whatever the world size."""
    epoch, index = divmod(position, BATCHES_PER_EPOCH)
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(7919 + epoch))
    picked = order[index * GLOBAL_BATCH:(index + 1) * GLOBAL_BATCH][rank::world]
    return data[0][picked], data[1][picked]


def weights_hash(model: nn.Module) -> str:
    """SHA-256 of the whole model (a collective: every rank calls it)."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    digest = hashlib.sha256()
    for name in sorted(full):
        tensor = full[name]
        assert isinstance(tensor, torch.Tensor), name
        digest.update(name.encode())
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class Storage:
    """Where checkpoints go: the federated run's store and key, or --store/--key-file."""

    def __init__(self, args: argparse.Namespace, ranked: RankedRun | None):
        self.args, self.ranked = args, ranked
        self.run = ranked.run if ranked is not None else args.run

    def writer(self, step: int) -> StorageWriter:
        if self.ranked is not None:
            return self.ranked.writer(step)
        return StorageWriter(self.args.store, run=self.run, step=step,
                             key_file=self.args.key_file)

    def resume(self, state: dict[str, Any]) -> int | None:
        if self.ranked is not None:
            return self.ranked.resume(state)
        steps = Repository(open_store_or_named(self.args.store),
                           load_master_key(Path(self.args.key_file))).steps(self.run)
        if not steps:
            return None
        dcp.load(state, storage_reader=StorageReader(self.args.store, run=self.run,
                                                     step=steps[-1],
                                                     key_file=self.args.key_file))
        return steps[-1]


def train(args: argparse.Namespace, storage: Storage, ranked: RankedRun | None,
          stop: RequeueOnSignal, say: Callable[[str], None]) -> tuple[int, str, Verdict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = build(args.hidden)
    data = dataset()

    def state(step: int, position: int) -> dict[str, Any]:
        model_state, optim_state = get_state_dict(model, optimizer)
        return {"model": model_state, "optim": optim_state,
                "trainer": {"step": step, "position": position}}

    step = position = 0
    loading = state(0, 0)
    resumed = storage.resume(loading)
    if resumed is not None:
        set_state_dict(model, optimizer, model_state_dict=loading["model"],
                       optim_state_dict=loading["optim"])
        step, position = loading["trainer"]["step"], loading["trainer"]["position"]
        say(f"resumed step {step} on {world} ranks weights {weights_hash(model)}")
    say(f"started at step {step}")

    def save() -> None:
        dcp.save(state(step, position), storage_writer=storage.writer(step))
        digest = weights_hash(model)
        say(f"saved step {step} weights {digest}")
        if ranked is not None:
            ranked.checkpointed(step)

    verdict, saved = Verdict.TRAIN, resumed
    while step < args.steps:
        verdict = _verdict(ranked, stop.requested or step == args.stop_after)
        if verdict is not Verdict.TRAIN:
            break
        if args.step_delay:
            time.sleep(args.step_delay)
        inputs, targets = local_batch(data, position, rank, world)
        loss = nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step, position = step + 1, position + 1
        if args.trace and rank == 0:
            _trace(args.trace, ranked, step)
        if step % args.ckpt_every == 0:
            save()
            saved = step
    if verdict is Verdict.FENCED:
        raise Fenced("rank 0 lost the lease: no rank trains another step")
    if saved != step:
        save()  # the final checkpoint: at the end, or where the stop was noticed
    return step, weights_hash(model), verdict


def _verdict(ranked: RankedRun | None, stop_requested: bool) -> Verdict:
    if ranked is not None:
        return ranked.step_verdict(stop_requested)
    flag = torch.tensor([int(stop_requested)], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return Verdict.STOP if flag.item() else Verdict.TRAIN


def _trace(path: str, ranked: RankedRun | None, step: int) -> None:
    """One line per trained step (rank 0), so drills can show no two incarnations
    ever trained at once."""
    who = "-" if ranked is None else (f"{ranked.federated.placement.generation} "
                                      f"{ranked.federated.placement.cluster}:"
                                      f"{ranked.federated.placement.job_id}")
    with open(path, "a") as handle:
        handle.write(f"{time.time():.3f} {who} {step}\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="run id")
    parser.add_argument("--store", help="store URL or configured name, without --federated")
    parser.add_argument("--key-file", help="site master key file, without --federated")
    parser.add_argument("--federated", action="store_true",
                        help="rank 0 holds the lease; store and key come with it")
    parser.add_argument("--steps", required=True, type=int, help="train up to this step")
    parser.add_argument("--ckpt-every", required=True, type=int, help="checkpoint interval")
    parser.add_argument("--stop-after", type=int, help="stop as if signalled at this step")
    parser.add_argument("--step-delay", type=float, default=0.0, metavar="S",
                        help="sleep S seconds per step (stands in for GPU time)")
    parser.add_argument("--hidden", type=int, default=HIDDEN, help="hidden layer width")
    parser.add_argument("--trace", help="rank 0 appends 'time generation job step' per step")
    args = parser.parse_args(argv)
    if not args.federated and (args.store is None or args.key_file is None):
        parser.error("--store and --key-file are required without --federated")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    with RequeueOnSignal() as stop:
        rank, world = init_ranks()

        def say(line: str) -> None:
            if rank == 0:
                print(line, flush=True)

        try:
            ranked = None
            if args.federated:
                ranked = RankedRun.from_environment(args.run)
                ranked.acquire()
            step, digest, verdict = train(args, Storage(args, ranked), ranked, stop, say)
            if ranked is not None:
                ranked.release(step)
            if verdict is Verdict.RELEASE:
                say(f"moving: released the lease at step {step}")
                return 0
            say(f"final step {step} weights {digest}")
            if verdict is Verdict.STOP:
                say(f"stopped at step {step}: checkpoint saved, exiting {EXIT_REQUEUE} "
                    "to be requeued")
                if rank == 0:
                    stop.requeue_and_exit()
                return EXIT_REQUEUE
        except SlurmGeoError as exc:
            print(f"error (rank {rank} of {world}): {exc}", file=sys.stderr, flush=True)
            return exc.exit_code
        finally:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    run_rank(main)
