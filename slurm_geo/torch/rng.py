"""The process-global random number generators a training step may draw from.

Captured: torch's CPU generator, every CUDA device's generator when CUDA is in use, Python's
`random`, and numpy's legacy global generator (`numpy.random.*`) when numpy is importable.
Generators a script creates itself (`torch.Generator()`, `numpy.random.default_rng()`) are
not global: put their state in the data position or `extra`, or derive them from it.
"""

from __future__ import annotations

import random
from typing import Any

import torch

try:
    import numpy
except ImportError:
    numpy = None  # type: ignore[assignment]


def capture_rng() -> dict[str, Any]:
    """The global generators' states, as plain values and tensors (see state.py)."""
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
    }
    # Reading CUDA state initializes CUDA; only a process already using it has any to save.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    if numpy is not None:
        states["numpy"] = numpy.random.get_state()
    return states


def restore_rng(states: dict[str, Any]) -> None:
    """Set the global generators to `states`; a generator absent from it is left alone."""
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    if "numpy" in states and numpy is not None:
        numpy.random.set_state(states["numpy"])
