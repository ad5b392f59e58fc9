"""A small MLP sharded with FSDP2 on CPU (gloo), checkpointed through PyTorch Distributed
Checkpoint into a slurm-geo store (docs/training.md, "Sharded, multi-rank jobs").

    torchrun --standalone --nproc-per-node 2 -m slurm_geo.examples.dcp_train -- \\
        --store file:///shared/ckpt --run RUN --key-file master.key --steps N --every K \\
        [--init-key]

(`python -m torch.distributed.run` is torchrun. The `--` keeps torchrun's own parser off
the script's flags: it would take `--run` for an abbreviation of its `--run-path`.)

Every rank holds a shard of each parameter and of its optimizer state (`fully_shard`).
Every K steps the job saves with `dcp.async_save` and slurm-geo's StorageWriter: the call
returns once the state is copied (staged) into new CPU memory, training goes on while
the ranks store their shards, and the save commits when all of them have. The job waits
for that save before it starts the next one. It resumes from the run's newest checkpoint
with slurm-geo's StorageReader, with as many ranks as it was saved with or any other
number: DCP reshards on load.

Rank 0 prints `resumed from step S weights <sha256>` after a resume, `saving step S
weights <sha256>` as each save starts, `committed step S` once it has committed, and
`final step S weights <sha256>` at the end; the hash is over the full (unsharded) model
and optimizer state, so a resume on another number of ranks prints the hash that was
saved. The first layer is frozen (a stand-in for a pretrained encoder): its shards do
not change, so a save stores none of its bytes again, only after a change in the number
of ranks (its shards are then cut anew) once more.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from slurm_geo.ckpt import Repository, create_master_key_file, load_master_key
from slurm_geo.ckpt.stores.open_store import open_store_or_named
from slurm_geo.errors import SlurmGeoError
from slurm_geo.torch.distributed import StorageReader, StorageWriter
from slurm_geo.torch.exit import run_rank

SAMPLES, FEATURES, HIDDEN, OUTPUTS, BATCH = 256, 16, 64, 4, 32  # BATCH: the global batch


@dataclass(frozen=True)
class Where:
    """The store, run and key every rank's writer and reader are built from."""

    store: str
    run: str
    key_file: Path

    def writer(self) -> StorageWriter:
        """One writer for the whole run, each save naming its step (checkpoint_id=step)."""
        return StorageWriter(self.store, run=self.run, key_file=self.key_file)

    def reader(self, step: int) -> StorageReader:
        return StorageReader(self.store, run=self.run, step=step, key_file=self.key_file)

    def newest_step(self) -> int | None:
        repository = Repository(open_store_or_named(self.store), load_master_key(self.key_file))
        return repository.latest(self.run)


class AppState(Stateful):
    """Model, optimizer and step as one object for dcp.save and dcp.load (torchtitan's
    pattern). get_state_dict gives each rank its shards (DTensors) keyed by the
    parameters' full names, so a checkpoint does not depend on how it was sharded."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int = 0):
        self.model, self.optimizer, self.step = model, optimizer, step

    def state_dict(self) -> dict[str, Any]:
        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optimizer": optimizer, "step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optimizer"])
        self.step = int(state_dict["step"])


def build(seed: int, mesh: DeviceMesh) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The same full model on every rank (same seed), then sharded along the mesh."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(),
                          nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUTPUTS))
    model[0].requires_grad_(False)  # frozen: a pretrained encoder
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.01)


def dataset(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(SAMPLES, FEATURES, generator=generator)
    weights = torch.randn(FEATURES, OUTPUTS, generator=generator)
    return inputs, inputs @ weights


def local_batch(data: tuple[torch.Tensor, torch.Tensor], step: int, rank: int,
                world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of global batch `step`: the global batch does not depend on the
    number of ranks, so a resharded resume trains on the same data."""
    start = step * BATCH % SAMPLES
    rows = torch.arange(start, start + BATCH)[rank::world]
    return data[0][rows], data[1][rows]


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer,
               batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    loss = nn.functional.mse_loss(model(batch[0]), batch[1])
    optimizer.zero_grad(set_to_none=True)
    loss.backward()  # FSDP2 reduce-scatters the gradients: each rank keeps its shard's
    optimizer.step()


def full_state_hash(state: AppState) -> str:
    """sha256 of the unsharded model and optimizer state (a collective: every rank calls
    it, rank 0 gets the hash, the others an empty string)."""
    model, optimizer = get_state_dict(state.model, state.optimizer, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True))
    digest = hashlib.sha256()
    for name, tensor in _tensors({"model": model, "optimizer": optimizer}):
        digest.update(name.encode())
        digest.update(tensor.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest() if model else ""


def _tensors(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for key in sorted(tree, key=str):
            yield from _tensors(tree[key], f"{prefix}.{key}")
    elif isinstance(tree, list | tuple):
        for index, value in enumerate(tree):
            yield from _tensors(value, f"{prefix}.{index}")


def resume(where: Where, state: AppState, say: Callable[[str], None]) -> None:
    """Load the newest checkpoint, if there is one. Rank 0 finds its step and tells the
    others, so every rank loads the same one (each rank reads DCP's metadata itself)."""
    found: list[int | None] = [where.newest_step() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(found, src=0)
    if found[0] is None:
        return
    dcp.load({"app": state}, storage_reader=where.reader(found[0]))
    say(f"resumed from step {state.step} weights {full_state_hash(state)}")


def train(where: Where, steps: int, every: int, seed: int,
          say: Callable[[str], None]) -> AppState:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model, optimizer = build(seed, mesh)
    state = AppState(model, optimizer)
    resume(where, state, say)
    say(f"world size {world}, starting at step {state.step}")
    # The background save runs collectives of its own while training runs FSDP's: on a
    # group of its own, so the two never interleave on one communicator.
    ckpt_group = dist.new_group(backend="gloo")
    data = dataset(seed)
    writer = where.writer()
    pending: Future[Any] | None = None
    saved = state.step
    while state.step < steps:
        train_step(model, optimizer, local_batch(data, state.step, rank, world))
        state.step += 1
        if state.step % every == 0 or state.step == steps:
            if pending is not None:
                pending.result()  # the previous save has committed (or raises why not)
                say(f"committed step {saved}")
            say(f"saving step {state.step} weights {full_state_hash(state)}")
            saved = state.step
            pending = _async_save(state, writer, saved, ckpt_group)
    if pending is not None:
        pending.result()
        say(f"committed step {saved}")
    say(f"final step {state.step} weights {full_state_hash(state)}")
    return state


def _async_save(state: AppState, writer: StorageWriter, step: int,
                group: dist.ProcessGroup) -> Future[Any]:
    """dcp.async_save returns once the state is staged; without an async stager of our
    own its result is a plain Future (not an AsyncSaveResponse)."""
    response = dcp.async_save({"app": state}, checkpoint_id=str(step), storage_writer=writer,
                              process_group=group)
    assert isinstance(response, Future)
    return response


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", required=True,
                        help="checkpoint store: file:///DIR, s3://BUCKET/PREFIX or a store "
                        "name from the site config")
    parser.add_argument("--run", required=True, help="run id")
    parser.add_argument("--key-file", required=True, type=Path, help="site master key file")
    parser.add_argument("--init-key", action="store_true",
                        help="create the key file if absent (rank 0, before training)")
    parser.add_argument("--steps", required=True, type=int, help="train up to this step")
    parser.add_argument("--every", required=True, type=int, metavar="K",
                        help="checkpoint every K steps (and at the end)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.every < 1 or args.steps < 0:
        parser.error("--every must be at least 1 and --steps at least 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        print("error: run under torchrun (python -m torch.distributed.run "
              "--nproc-per-node N -m slurm_geo.examples.dcp_train -- --run ...)",
              file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def say(line: str) -> None:
        if rank == 0:
            print(line, flush=True)

    try:
        if rank == 0 and args.init_key and not args.key_file.exists():
            create_master_key_file(args.key_file)
        dist.barrier()
        train(Where(args.store, args.run, args.key_file), args.steps, args.every, args.seed,
              say)
    except SlurmGeoError as exc:
        print(f"error: rank {rank}: {exc}", file=sys.stderr)
        return exc.exit_code
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    run_rank(main)
