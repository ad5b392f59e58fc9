"""Series of real torch checkpoints for bench/ckpt_vs_restic.py.

Each series yields `Step`s: the flat state (path -> CPU tensor) after one more step of
training, the object to hand `torch.save` for the restic side, and the paths whose
tensors were not modified since the previous step, found as a training loop would find
them: by torch's per-tensor version counters (every in-place update bumps them).

(a) dense: an MLP in fp32 trained with AdamW; every weight and moment changes each step.
(b) LoRA: a frozen fp32 base with rank-8 adapters on every layer and a small trainable
    head; only adapters, head and their AdamW moments change.
(c) bf16: bf16 weights of which about 1 % of the values change per step.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

WIDTH = 2048
BATCH = 32


@dataclass
class Step:
    step: int
    state: dict[str, torch.Tensor]
    saved: Any  # what torch.save writes for restic: the usual {"model", "optimizer"} dict
    unchanged: set[str]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())


class VersionTracker:
    """Which tensors are untouched since the last call: same storage, same version counter.

    Detached views share their tensor's version counter; holding the previous tensors
    keeps their storage from being freed and reused by another tensor meanwhile.
    """

    def __init__(self) -> None:
        self._seen: dict[str, tuple[torch.Tensor, int, int]] = {}

    def unchanged(self, state: dict[str, torch.Tensor]) -> set[str]:
        now = {path: (t, t.untyped_storage().data_ptr(), t._version)
               for path, t in state.items()}
        same = {path for path, (_t, ptr, version) in now.items()
                if path in self._seen and self._seen[path][1:] == (ptr, version)}
        self._seen = now
        return same


def flat_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    state = {f"model.{k}": v.detach() for k, v in model.state_dict(keep_vars=True).items()}
    if optimizer is not None:
        for index, moments in optimizer.state_dict()["state"].items():
            for name, value in moments.items():
                state[f"optimizer.{index}.{name}"] = value
    return state


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(BATCH, WIDTH)).float().pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _series(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> Iterator[Step]:
    tracker = VersionTracker()
    for step in range(1, steps + 1):
        train_step(model, optimizer)
        state = flat_state(model, optimizer)
        saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        yield Step(step, state, saved, tracker.unchanged(state))


def dense_adamw(params: float, steps: int = 3) -> Iterator[Step]:
    """(a) `params` parameters in square fp32 layers, AdamW moments for all of them."""
    torch.manual_seed(1)
    layers = max(1, round(params / (WIDTH * WIDTH)))
    model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(WIDTH, WIDTH),
                                                                 nn.ReLU())])
    yield from _series(model, torch.optim.AdamW(model.parameters(), lr=1e-3), steps)


class LoraLinear(nn.Module):
    def __init__(self, rank: int = 8):
        super().__init__()
        self.base = nn.Linear(WIDTH, WIDTH)
        nn.init.normal_(self.base.weight, std=0.02)  # like a pretrained transformer's
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, WIDTH) * 0.01)
        self.lora_b = nn.Parameter(torch.zeros(WIDTH, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.T) @ self.lora_b.T


def lora_finetune(base_params: float, steps: int = 3) -> Iterator[Step]:
    """(b) a frozen base of `base_params` fp32 parameters, LoRA on every layer, a head."""
    torch.manual_seed(2)
    layers = max(1, round(base_params / (WIDTH * WIDTH)))
    model = nn.Sequential(*[LoraLinear() for _ in range(layers)], nn.Linear(WIDTH, 64),
                          nn.Linear(64, WIDTH))
    trainable = [p for p in model.parameters() if p.requires_grad]
    yield from _series(model, torch.optim.AdamW(trainable, lr=1e-3), steps)


def bf16_sparse_updates(params: float, steps: int = 3, changed: float = 0.01) -> Iterator[Step]:
    """(c) `params` bf16 weights; each step changes `changed` of the values in place."""
    generator = torch.Generator().manual_seed(3)
    count = max(1, round(params / (WIDTH * WIDTH)))
    weights = {f"model.layers.{i}.weight":
               (torch.randn(WIDTH, WIDTH, generator=generator) * 0.02).to(torch.bfloat16)
               for i in range(count)}
    tracker = VersionTracker()
    for step in range(1, steps + 1):
        if step > 1:
            for tensor in weights.values():
                flat = tensor.view(-1)
                index = torch.randint(flat.numel(), (round(flat.numel() * changed),),
                                      generator=generator)
                bumped = flat[index].float() * 1.01 + 1e-3  # a new bf16 value almost always
                flat[index] = bumped.to(torch.bfloat16)
        state = dict(weights)
        yield Step(step, state, {"model": state}, tracker.unchanged(state))
