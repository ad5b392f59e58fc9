"""What a drill runs: its training job's shape and pace, and how long it may take; and
the pace that suits a checkpoint of a given size on a link of a given rate (pure)."""

from __future__ import annotations

import math
from dataclasses import dataclass

MIB = 1024 * 1024
# Bytes of checkpoint per parameter: the fp32 weight and AdamW's two fp32 moments.
BYTES_PER_PARAMETER = 3 * 4
# The trainers' fixed widths (slurm_geo.examples.train, slurm_geo.examples.sharded_train).
FEATURES, OUTPUTS = 16, 4
# Checkpoints come at least this much slower than checkpoint-sync handles one, which is
# one crossing of the link: the copy, verified as it is written (issue 32; until then a
# verification read the replica back whole, a second crossing, and a drill paced for one
# fell behind at 50 Mbit/s by a checkpoint every 10 intervals). So checkpoint-sync keeps
# up with the job (the newest checkpoint at a kill is at most one interval behind, the
# drill's RPO target), with room for the machine's noise.
INTERVAL_OVER_TRANSFER = 1.5
CROSSINGS_PER_CHECKPOINT = 1
# Past this size a drill trains fewer, longer steps: ten checkpoints of 512 MB would be
# 5 GB written and replicated for a figure that two or three checkpoints already give.
LARGE_STATE_MB = 16.0


@dataclass(frozen=True)
class DrillSettings:
    """The drill's training job (steps, checkpoint interval, pace), how many checkpoints
    must be verified off-site before the loss, and how long it all may take."""

    steps: int = 400
    ckpt_every: int = 40
    step_delay_s: float = 0.05
    verified_before_kill: int = 2
    timeout_s: float = 300.0
    hidden: int = 32  # the trainer's hidden width; wider: bigger checkpoints
    ranks: int = 1  # more: a sharded job under srun, 2 ranks per node (drills.sharded)
    reshard: bool = False  # with ranks: the target offers one node, the job resumes on fewer
    state_mb: float | None = None  # the checkpoint size the width was chosen for (sized)
    link_mbit: float | None = None  # the home -> remote rate the pace was chosen for
    lose: str = "cluster"  # what is taken away: drills.losses.LOSSES
    return_after_s: float | None = None  # home back this long after the loss; else at the end
    world_mb: float | None = None  # the job reads a dataset this large from its world


def hidden_for(state_mb: float, ranks: int = 1) -> int:
    """The trainer's hidden width whose checkpoint (weights and AdamW moments) is about
    `state_mb` MiB: 16 -> h -> 4 for one rank (21h + 4 parameters); 16 -> h -> h -> 4
    for the sharded trainer (h² + 22h + 4)."""
    parameters = state_mb * MIB / BYTES_PER_PARAMETER
    if ranks == 1:
        return max(1, round((parameters - OUTPUTS) / (FEATURES + 1 + OUTPUTS)))
    linear = FEATURES + 1 + 1 + OUTPUTS
    return max(1, round((-linear + math.sqrt(linear ** 2 + 4 * parameters)) / 2))


def transfer_s(state_mb: float, link_mbit: float) -> float:
    """Seconds one checkpoint of `state_mb` MiB takes at `link_mbit` (10^6 bit/s)."""
    return state_mb * MIB * 8 / (link_mbit * 1e6)


def sized(state_mb: float, link_mbit: float, *, ranks: int = 1, reshard: bool = False,
          steps: int | None = None, ckpt_every: int | None = None,
          step_delay_s: float | None = None, lose: str = "cluster",
          return_after_s: float | None = None) -> DrillSettings:
    """A drill whose checkpoints are about `state_mb` MiB, paced for a `link_mbit` link:
    checkpoints come INTERVAL_OVER_TRANSFER times slower than checkpoint-sync copies one
    across the link (CROSSINGS_PER_CHECKPOINT), and the drill may take as long as its
    checkpoints need. Explicit steps, interval or delay win.
    """
    if state_mb <= 0 or link_mbit <= 0:
        raise ValueError("state_mb and link_mbit must be positive")
    base = DrillSettings()
    large = state_mb > LARGE_STATE_MB
    every = ckpt_every or (10 if large else base.ckpt_every)
    total = steps or (6 * every if large else base.steps)
    one = transfer_s(state_mb, link_mbit)
    delay = step_delay_s if step_delay_s is not None else \
        max(base.step_delay_s, INTERVAL_OVER_TRANSFER * CROSSINGS_PER_CHECKPOINT * one / every)
    # Until the kill, the verified checkpoints and one more interval; after it, the rest
    # of the steps and the resume; each interval at least one transfer long.
    intervals = total / every + 2
    timeout = base.timeout_s + intervals * max(CROSSINGS_PER_CHECKPOINT * one,
                                               delay * every) * 1.5
    return DrillSettings(steps=total, ckpt_every=every, step_delay_s=round(delay, 3),
                         timeout_s=round(timeout), hidden=hidden_for(state_mb, ranks),
                         ranks=ranks, reshard=reshard, state_mb=state_mb,
                         link_mbit=link_mbit, lose=lose, return_after_s=return_after_s)
