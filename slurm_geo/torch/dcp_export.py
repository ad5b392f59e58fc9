"""A multi-rank (DCP) checkpoint out of the store as files torch reads without slurm-geo:
a DCP checkpoint directory (`torch.distributed.checkpoint.load` with `FileSystemReader`)
or a torch.save file. `slurm-geo ckpt pull` writes them.

The whole state is assembled in this one process, every chunk verified as it is read,
as torch's own `format_utils.dcp_to_torch_save` assembles a directory's: it needs memory
for the whole state dict.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from slurm_geo.torch.distributed import StorageReader


def load_whole_state(store: str, *, run: str, step: int,
                     key_file: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint's state dict, nested as it was saved, every item at its full size.

    A damaged or missing object raises its own error (which names it), not DCP's
    CheckpointException around it, so the CLI reports it in one line.
    """
    state: dict[str, Any] = {}
    reader = StorageReader(store, run=run, step=step, key_file=key_file)
    try:
        with _single_process():
            # dcp.load fills only the keys it is given; this planner takes them from the
            # checkpoint's own metadata instead.
            _load_state_dict(state, storage_reader=reader,
                             planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    except CheckpointException as exc:
        failure, _trace = next(iter(exc.failures.values()))
        raise failure from None
    return state


def write_dcp_directory(state: dict[str, Any], path: Path) -> None:
    with _single_process():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)


def write_torch_file(state: dict[str, Any], path: Path) -> None:
    """A file `torch.load(weights_only=True)` reads: numpy arrays (numpy's RNG state) are
    saved as tensors of their dtype and shape, numpy scalars as plain numbers, as a pull
    of a single-process checkpoint writes them."""
    torch.save(_weights_only_form(state), path)


def _weights_only_form(value: Any) -> Any:
    if isinstance(value, numpy.ndarray) and value.dtype != object:
        return torch.from_numpy(numpy.ascontiguousarray(value))
    if isinstance(value, numpy.generic):
        return value.item()
    if isinstance(value, dict):
        converted = type(value)((k, _weights_only_form(v)) for k, v in value.items())
        if hasattr(value, "_metadata"):
            converted._metadata = value._metadata  # type: ignore[attr-defined]
        return converted
    if type(value) in (list, tuple):
        return type(value)(_weights_only_form(v) for v in value)
    return value


@contextmanager
def _single_process() -> Iterator[None]:
    """DCP warns that it assumes one process when there is no process group: here that is
    the intent, and a CLI user has nothing to do about it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
