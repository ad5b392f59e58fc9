"""A small, deterministic CPU training script wired to Checkpointer and RequeueOnSignal.

    python -m slurm_geo.torch.example_train --run RUN --store DIR --key-file F \\
        --steps N --ckpt-every K [--stop-after M] [--init-key] [--delta]

It resumes from the run's newest valid checkpoint, trains to step N, checkpointing every
K steps, and prints `final step S weights <sha256>`. On SIGUSR1, or on reaching step M
with --stop-after, it saves a final checkpoint, asks Slurm to requeue the job and exits
75 (signals.EXIT_REQUEUE). A run stopped and resumed prints the same hash as one run
straight through: every source of randomness is either a checkpointed global generator
(dropout: torch; input scaling: `random`; input noise: numpy) or derived from the data
position (the epoch's shuffle).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slurm_geo.ckpt import LocalDirStore, Repository, create_master_key_file, load_master_key
from slurm_geo.errors import SlurmGeoError
from slurm_geo.torch.checkpointer import Checkpointer
from slurm_geo.torch.signals import EXIT_REQUEUE, RequeueOnSignal

try:
    import numpy
except ImportError:
    numpy = None  # type: ignore[assignment]

SAMPLES, FEATURES, HIDDEN, OUTPUTS, BATCH = 256, 16, 32, 4, 32
BATCHES_PER_EPOCH = SAMPLES // BATCH


@dataclass(frozen=True)
class TrainConfig:
    steps: int
    ckpt_every: int
    stop_after: int | None = None
    seed: int = 0


@dataclass
class Outcome:
    step: int
    stopped: bool  # True: stopped early on request, state saved, run again to continue
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    if numpy is not None:
        numpy.random.seed(seed)


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Dropout(0.1),
                          nn.Linear(HIDDEN, OUTPUTS))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=5)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=50)
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], [5])
    return model, optimizer, scheduler


def dataset(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(SAMPLES, FEATURES, generator=generator)
    weights = torch.randn(FEATURES, OUTPUTS, generator=generator)
    return inputs, inputs @ weights + 0.1 * torch.randn(SAMPLES, OUTPUTS, generator=generator)


def batch_at(data: tuple[torch.Tensor, torch.Tensor], position: int,
             seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch number `position`: the epoch's shuffle comes from the position, not a live RNG."""
    epoch, index = divmod(position, BATCHES_PER_EPOCH)
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
    picked = order[index * BATCH:(index + 1) * BATCH]
    inputs = data[0][picked] * random.uniform(0.9, 1.1)
    if numpy is not None:
        noise = numpy.random.standard_normal(inputs.shape).astype("float32")
        inputs = inputs + 0.01 * torch.from_numpy(noise)
    return inputs, data[1][picked]


def weights_hash(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def train(checkpointer: Checkpointer, config: TrainConfig, stop: RequeueOnSignal,
          say: Callable[[str], None] = print) -> Outcome:
    seed_everything(config.seed)
    model, optimizer, scheduler = build(config.seed)
    data = dataset(config.seed)
    resumed = checkpointer.resume(model, optimizer, scheduler)
    step = position = 0
    if resumed is not None:
        step, position = resumed.step, resumed.data_position["batch"]
    say(f"started at step {step}")
    loss = torch.tensor(float("nan"))

    def save() -> None:
        checkpointer.save(step, model, optimizer, scheduler, data_position={"batch": position},
                          epoch=position // BATCHES_PER_EPOCH, loss=loss)

    model.train()
    while step < config.steps and not stop.requested:
        inputs, targets = batch_at(data, position, config.seed)
        loss = nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        step, position = step + 1, position + 1
        if step == config.stop_after:
            stop.request()
        if step % config.ckpt_every == 0:
            save()
    checkpointer.wait()
    if checkpointer.last_step != step:
        save()  # the final checkpoint: at the end, or where the stop was noticed
    checkpointer.wait()
    return Outcome(step, step < config.steps, model, optimizer, scheduler)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="run id")
    parser.add_argument("--store", required=True, type=Path, help="checkpoint directory")
    parser.add_argument("--key-file", required=True, type=Path, help="site master key file")
    parser.add_argument("--init-key", action="store_true", help="create the key file if absent")
    parser.add_argument("--steps", required=True, type=int, help="train up to this step")
    parser.add_argument("--ckpt-every", required=True, type=int, help="checkpoint interval")
    parser.add_argument("--stop-after", type=int, help="stop as if signalled at this step")
    parser.add_argument("--delta", action="store_true", help="store xor deltas to the parent")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    config = TrainConfig(args.steps, args.ckpt_every, args.stop_after, args.seed)
    try:
        with RequeueOnSignal() as stop:
            if args.init_key and not args.key_file.exists():
                create_master_key_file(args.key_file)
            args.store.mkdir(parents=True, exist_ok=True)
            repository = Repository(LocalDirStore(args.store), load_master_key(args.key_file))
            with Checkpointer(repository, args.run, delta=args.delta) as checkpointer:
                outcome = train(checkpointer, config, stop, lambda line: print(line, flush=True))
            print(f"final step {outcome.step} weights {weights_hash(outcome.model)}", flush=True)
            if outcome.stopped:
                print(f"stopped at step {outcome.step}: checkpoint saved, exiting "
                      f"{EXIT_REQUEUE} to be requeued", flush=True)
                stop.requeue_and_exit()
    except SlurmGeoError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
