"""A small, deterministic CPU training script wired to Checkpointer and RequeueOnSignal.

    python -m slurm_geo.examples.train --run RUN --store DIR --key-file F \\
        --steps N --ckpt-every K [--stop-after M] [--init-key] [--delta]
    python -m slurm_geo.examples.train --run RUN --federated --steps N --ckpt-every K

With --federated the job holds a training lease from the federation daemon and finds its
store from the site config or, on a cluster it was moved to, its environment
(slurm_geo.lease.client); it trains only while the lease is current. Its run's data key
comes from the daemon once the lease is granted (at home by MUNGE: the master key is
never read), and --key-file is not used.

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
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slurm_geo.ckpt import LocalDirStore, Repository, create_master_key_file, load_master_key
from slurm_geo.errors import SlurmGeoError
from slurm_geo.lease.client import FederatedRun
from slurm_geo.stage.homestart import stage_home_world
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
    step_delay_s: float = 0.0  # stands in for a GPU's time per step (drills, demos)
    hidden: int = HIDDEN  # width of the hidden layer: wider means bigger checkpoints


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


def build(seed: int, hidden: int = HIDDEN) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Dropout(0.1),
                          nn.Linear(hidden, OUTPUTS))
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
          say: Callable[[str], None] = print, federated: FederatedRun | None = None,
          trace: Callable[[int], None] = lambda _step: None) -> Outcome:
    seed_everything(config.seed)
    model, optimizer, scheduler = build(config.seed, config.hidden)
    data = dataset(config.seed)
    resumed = _resume(checkpointer, model, optimizer, scheduler, federated)
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
        if federated is not None:
            if federated.release_requested:
                break
            federated.wait_for_lease()
        if config.step_delay_s:
            time.sleep(config.step_delay_s)
        inputs, targets = batch_at(data, position, config.seed)
        loss = nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        step, position = step + 1, position + 1
        if step == config.stop_after:
            stop.request()
        if federated is not None:
            # A process frozen mid-step (a partition) must not count the step, let alone
            # save it, unless its lease is still current now: else it is fenced here.
            federated.wait_for_lease()
        trace(step)
        if step % config.ckpt_every == 0:
            save()
            if federated is not None:
                checkpointer.wait()
                federated.checkpointed(step)
    checkpointer.wait()
    if checkpointer.last_step != step:
        if federated is not None:
            federated.wait_for_lease()
        save()  # the final checkpoint: at the end, or where the stop was noticed
    checkpointer.wait()
    return Outcome(step, step < config.steps, model, optimizer, scheduler)


def _resume(checkpointer: Checkpointer, model: nn.Module, optimizer: torch.optim.Optimizer,
            scheduler: Any, federated: FederatedRun | None) -> Any:
    """The first incarnation of a generation the daemon placed starts exactly where it
    says (the checkpoint it verified, or from scratch); any other starts from its newest."""
    placement = None if federated is None else federated.placement
    if placement is not None and placement.generation > 0 and placement.restart == 0:
        if placement.resume_step is None:
            return None
        return checkpointer.resume(model, optimizer, scheduler, at_step=placement.resume_step)
    return checkpointer.resume(model, optimizer, scheduler)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="run id")
    parser.add_argument("--store", type=Path, help="checkpoint directory")
    parser.add_argument("--key-file", type=Path, help="site master key file")
    parser.add_argument("--federated", action="store_true",
                        help="hold a lease from the federation daemon; store and key from it")
    parser.add_argument("--step-delay", type=float, default=0.0, metavar="S",
                        help="sleep S seconds per step (stands in for GPU time)")
    parser.add_argument("--trace", type=Path, help="append 'time generation job step' "
                        "per trained step to this file")
    parser.add_argument("--init-key", action="store_true", help="create the key file if absent")
    parser.add_argument("--steps", required=True, type=int, help="train up to this step")
    parser.add_argument("--ckpt-every", required=True, type=int, help="checkpoint interval")
    parser.add_argument("--stop-after", type=int, help="stop as if signalled at this step")
    parser.add_argument("--delta", action="store_true", help="store xor deltas to the parent")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=HIDDEN, metavar="N",
                        help=f"hidden layer width (default {HIDDEN}; wider: bigger checkpoints)")
    args = parser.parse_args(argv)
    if not args.federated and (args.store is None or args.key_file is None):
        parser.error("--store and --key-file are required without --federated")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    config = TrainConfig(args.steps, args.ckpt_every, args.stop_after, args.seed,
                         args.step_delay, hidden=args.hidden)
    try:
        with RequeueOnSignal() as stop:
            federated = None
            if args.federated:
                federated = FederatedRun.from_environment(args.run, stage_world=stage_home_world)
                federated.acquire()
                repository = federated.repository()
                run = federated.placement.run
            else:
                if args.init_key and not args.key_file.exists():
                    create_master_key_file(args.key_file)
                args.store.mkdir(parents=True, exist_ok=True)
                repository = Repository(LocalDirStore(args.store),
                                        load_master_key(args.key_file))
                run = args.run
            trace = _tracer(args.trace, federated)
            guard = (lambda: None) if federated is None else federated.wait_for_lease
            with Checkpointer(repository, run, delta=args.delta,
                              before_commit=guard) as checkpointer:
                outcome = train(checkpointer, config, stop, lambda line: print(line, flush=True),
                                federated, trace)
            if federated is not None:
                moving = federated.release_requested
                federated.release(outcome.step)
                if moving:
                    print(f"moving: released the lease at step {outcome.step}", flush=True)
                    return 0
            print(f"final step {outcome.step} weights {weights_hash(outcome.model)}", flush=True)
            if outcome.stopped:
                print(f"stopped at step {outcome.step}: checkpoint saved, exiting "
                      f"{EXIT_REQUEUE} to be requeued", flush=True)
                stop.requeue_and_exit()
    except SlurmGeoError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


def _tracer(path: Path | None, federated: FederatedRun | None) -> Callable[[int], None]:
    """One line per trained step, so drills can show no two incarnations ever overlapped."""
    if path is None:
        return lambda _step: None
    handle = open(path, "a", buffering=1)  # noqa: SIM115 (open for the process's life)
    who = "-" if federated is None else \
        f"{federated.placement.generation} {federated.placement.cluster}:" \
        f"{federated.placement.job_id}"

    def trace(step: int) -> None:
        handle.write(f"{time.time():.3f} {who} {step}\n")
    return trace


if __name__ == "__main__":
    sys.exit(main())
