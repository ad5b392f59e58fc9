"""The ranks' side of bench/dcp_vs_filesystem.py: FSDP2 training on CPU (gloo), and every
checkpoint saved and loaded through both DCP's FileSystemWriter/Reader and slurm-geo's
StorageWriter/Reader, side by side in the same processes.

Each rank writes what it measured to `<work>/rank-<r>.json`; the parent adds them up.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import blake3
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from slurm_geo.torch.distributed import StorageReader, StorageWriter
from slurm_geo.torch.state import tensor_bytes

WIDTH = 2048
HEAD_WIDTH = 256  # the frozen-base variant's trainable head: WIDTH -> HEAD_WIDTH -> WIDTH
BATCH = 8
FS, OURS = "FileSystemWriter", "slurm-geo"
RSS_EVERY_S = 0.005
COLD_TRIES, WARM_TRIES = 2, 3  # a load takes about a second: one try is all noise
_LIBC = ctypes.CDLL("libc.so.6")


def tree_bytes(root: Path) -> int:
    """Bytes in the files under `root`: what a writer stored there."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


@dataclass(frozen=True)
class Plan:
    """What every rank runs (picklable: torch.multiprocessing.spawn sends it)."""

    work: Path
    key_file: Path
    port: int
    ranks: int
    gb: float
    dense_saves: int
    frozen_saves: int
    steps_between: int

    def store_dir(self, series: str) -> Path:
        """Ours: one store per series (made by the parent), each save deduplicated against
        the one before."""
        return self.work / f"ours-{series}"

    def fs_dir(self, series: str, step: int) -> Path:
        return self.work / f"fs-{series}" / f"step-{step}"


@dataclass(frozen=True)
class SaveRecord:
    series: str
    step: int
    writer: str
    block_s: float  # until dcp.async_save returned: training may go on
    durable_s: float  # until its future resolved: every file fsynced, the checkpoint whole
    cpu_s: float  # this process's user + system time from the call to durable
    rss_extra: int  # bytes: peak VmRSS during the save over VmRSS just before it
    stored: int  # bytes in the writer's directory of the series after the save (rank 0)


@dataclass(frozen=True)
class LoadRecord:
    series: str
    step: int
    reader: str
    cache: str  # "cold" (files evicted from the page cache) or "warm"
    seconds: float
    cpu_s: float  # this process's user + system time during the load
    restored: bool  # every local tensor equals what was saved


def rank_main(rank: int, plan: Plan) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(plan.port))
    dist.init_process_group("gloo", rank=rank, world_size=plan.ranks)
    torch.set_num_threads(1)  # 4 ranks on the machine's cores: no oversubscription
    torch.manual_seed(rank)
    mesh = init_device_mesh("cpu", (plan.ranks,))
    saves: list[SaveRecord] = []
    loads: list[LoadRecord] = []
    for series, build, count in (("dense", dense_model, plan.dense_saves),
                                 ("frozen", frozen_model, plan.frozen_saves)):
        torch.manual_seed(1)  # the same model on every rank before sharding
        model = build(plan.gb)
        for module in model:
            fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
        torch.manual_seed(100 + rank)  # each rank its own batches
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                      lr=1e-3)
        for step in range(1, count + 1):
            for _ in range(plan.steps_between):
                train_step(model, optimizer)
            state = _state(model, optimizer)
            writers = _writers(plan, series, step)
            order = writers if step % 2 else writers[::-1]  # neither always goes first
            saves += [save_once(series, step, name, make(), state, directory)
                      for name, make, directory in order]
        loads += load_all(plan, series, count, _state(model, optimizer))
        del model, optimizer, state
    (plan.work / f"rank-{rank}.json").write_text(json.dumps(
        {"saves": [asdict(s) for s in saves], "loads": [asdict(r) for r in loads]}))
    dist.barrier()
    dist.destroy_process_group()


class Block(nn.Module):
    """A residual GELU layer, as in a transformer's MLP: gradients reach every weight, so
    AdamW's moments hold no exact zeros (dead ReLU units would give them columns of
    zeros, which compress, and are not what a transformer's optimizer state looks like)."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.linear(nn.functional.gelu(x))


def dense_model(gb: float) -> nn.Sequential:
    """Square fp32 layers holding `gb` GB with their AdamW moments (three copies)."""
    layers = max(1, round(gb * 1e9 / (12 * (WIDTH * WIDTH + WIDTH))))
    return _gaussian(nn.Sequential(*[Block(WIDTH) for _ in range(layers)]))


def frozen_model(gb: float) -> nn.Sequential:
    """A frozen base of `gb` GB of fp32 weights, and a small trainable head."""
    layers = max(1, round(gb * 1e9 / (4 * (WIDTH * WIDTH + WIDTH))))
    base = [Block(WIDTH) for _ in range(layers)]
    for block in base:
        block.requires_grad_(False)
    return _gaussian(nn.Sequential(*base, nn.Linear(WIDTH, HEAD_WIDTH),
                                   nn.Linear(HEAD_WIDTH, WIDTH)))


def _gaussian(model: nn.Sequential) -> nn.Sequential:
    """Weights as a pretrained transformer's look (gaussian, std 0.02), biases zero."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)
    return model


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(BATCH, WIDTH)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optimizer_state}


def _writers(plan: Plan, series: str, step: int
             ) -> list[tuple[str, Callable[[], Any], Path]]:
    """FileSystemWriter with its defaults (sync_files=True, thread_count=1, one file per
    rank), a new directory per checkpoint; ours into one store per series. Each with the
    directory holding everything it stored of the series."""
    return [
        (FS, lambda: dcp.FileSystemWriter(plan.fs_dir(series, step)),
         plan.fs_dir(series, step).parent),
        (OURS, lambda: StorageWriter(f"file://{plan.store_dir(series)}", run=series,
                                     step=step, key_file=plan.key_file),
         plan.store_dir(series)),
    ]


def save_once(series: str, step: int, writer: str, storage_writer: Any,
              state: dict[str, Any], directory: Path) -> SaveRecord:
    if dist.get_rank() == 0:
        os.sync()  # no writer's dirty pages left for the next one to wait on
    dist.barrier()
    with RssSampler() as rss:
        began, cpu = time.perf_counter(), _cpu_seconds()
        future = dcp.async_save(state, storage_writer=storage_writer)
        block = time.perf_counter() - began
        future.result()
        durable, cpu = time.perf_counter() - began, _cpu_seconds() - cpu
    stored = tree_bytes(directory) if dist.get_rank() == 0 else 0
    dist.barrier()
    return SaveRecord(series, step, writer, block, durable, cpu, rss.peak - rss.baseline,
                      stored)


def load_all(plan: Plan, series: str, step: int, state: dict[str, Any]) -> list[LoadRecord]:
    """The last checkpoint loaded by both readers in turn, COLD_TRIES times from disk (its
    files evicted from the page cache first), then WARM_TRIES times from the page cache;
    the parent keeps each reader's best try of each."""
    expected = digests(state)
    readers = [(FS, lambda: dcp.FileSystemReader(plan.fs_dir(series, step))),
               (OURS, lambda: StorageReader(f"file://{plan.store_dir(series)}", run=series,
                                            step=step, key_file=plan.key_file))]
    records = []
    for cache, tries in (("cold", COLD_TRIES), ("warm", WARM_TRIES)):
        for attempt in range(tries):
            for name, make in readers if attempt % 2 else readers[::-1]:
                if cache == "cold":
                    _evict(plan.fs_dir(series, step), plan.store_dir(series))
                seconds, cpu = load_once(make(), state)
                records.append(LoadRecord(series, step, name, cache, seconds, cpu,
                                          digests(state) == expected))
    return records


def load_once(storage_reader: Any, state: dict[str, Any]) -> tuple[float, float]:
    """Seconds until every rank has loaded, and this process's CPU seconds meanwhile."""
    for tensor in _local_tensors(state):
        tensor.zero_()  # what the load leaves there is all it wrote
    dist.barrier()
    began, cpu = time.perf_counter(), _cpu_seconds()
    dcp.load(state, storage_reader=storage_reader)
    cpu = _cpu_seconds() - cpu
    dist.barrier()
    return time.perf_counter() - began, cpu


def _cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def _evict(*roots: Path) -> None:
    """Drop the files under `roots` from the page cache (clean pages only, so sync first)."""
    if dist.get_rank() == 0:
        os.sync()
        for root in roots:
            for path in root.rglob("*"):
                if path.is_file():
                    fd = os.open(path, os.O_RDONLY)
                    try:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    finally:
                        os.close(fd)
    dist.barrier()


def digests(state: dict[str, Any]) -> list[str]:
    return [blake3.blake3(tensor_bytes(t)).hexdigest() for t in _local_tensors(state)]


def _local_tensors(node: Any) -> Iterator[torch.Tensor]:
    """Every tensor of a nested state dict as this rank holds it, in a fixed order."""
    if isinstance(node, dict):
        for key in sorted(node, key=str):
            yield from _local_tensors(node[key])
    elif isinstance(node, list | tuple):
        for value in node:
            yield from _local_tensors(value)
    elif isinstance(node, DTensor):
        yield node.to_local()
    elif isinstance(node, torch.Tensor):
        yield node


class RssSampler:
    """Peak VmRSS of this process, sampled every RSS_EVERY_S in a thread, and the VmRSS
    when it started (`baseline`), after freed memory went back to the system: what a
    previous save left in the allocator's free lists would otherwise be reused unseen."""

    def __enter__(self) -> RssSampler:
        gc.collect()
        _LIBC.malloc_trim(0)
        self.baseline = self.peak = self.now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())

    def _sample(self) -> None:
        while not self._stop.wait(RSS_EVERY_S):
            self.peak = max(self.peak, self.now())

    @staticmethod
    def now() -> int:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS in /proc/self/status")
