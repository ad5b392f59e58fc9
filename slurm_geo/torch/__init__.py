"""The training side: checkpoint a PyTorch training loop and stop cleanly for a requeue.

`Checkpointer` snapshots model, optimizer, scheduler, RNG and data position and writes
them in the background; `RequeueOnSignal` turns Slurm's warning signal into a final
checkpoint and a requeue; `run_rank` ends a multi-rank script's process without the
interpreter teardown in which torch's leftover gloo threads abort it. docs/training.md
shows how to wire them into a script.
"""

from slurm_geo.torch.checkpointer import (
    Checkpointer,
    NoValidCheckpoint,
    ResumeState,
    optimizer_step_count,
)
from slurm_geo.torch.exit import run_rank
from slurm_geo.torch.signals import EXIT_REQUEUE, RequeueOnSignal, request_requeue
from slurm_geo.torch.state import (
    StateFormatError,
    flatten_state,
    tensors_from_torch_file,
    unflatten_state,
)

__all__ = [
    "EXIT_REQUEUE", "Checkpointer", "NoValidCheckpoint", "RequeueOnSignal", "ResumeState",
    "StateFormatError", "flatten_state", "optimizer_step_count", "request_requeue",
    "run_rank", "tensors_from_torch_file", "unflatten_state",
]
