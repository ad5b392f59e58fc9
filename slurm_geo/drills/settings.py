"""What a drill runs: its training job's shape and pace, and how long it may take."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DrillSettings:
    steps: int = 400
    ckpt_every: int = 40
    step_delay_s: float = 0.05
    verified_before_kill: int = 2
    timeout_s: float = 300.0
    hidden: int = 32  # the trainer's hidden width; wider: bigger checkpoints
    ranks: int = 1  # more: a sharded job under srun, 2 ranks per node (drills.sharded)
    reshard: bool = False  # with ranks: the target offers one node, the job resumes on fewer
