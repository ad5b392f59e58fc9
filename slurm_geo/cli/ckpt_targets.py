"""RUN and RUN@STEP as `slurm-geo ckpt` commands take them: a run or a step the store
does not hold is not found (OBJECT_MISSING, 26), one line naming it and what the store
does hold; never a config mistake, and never a damaged checkpoint."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from slurm_geo.ckpt.errors import CkptError
from slurm_geo.errors import ConfigError
from slurm_geo.exitcodes import ExitCode

STEPS_SHOWN = 5  # the newest steps named when a step is not there


class NoSuchCheckpoint(CkptError):
    """The store has no checkpoint of the run, or none at the step asked."""

    exit_code = ExitCode.OBJECT_MISSING


def no_run(run: str, where: str) -> NoSuchCheckpoint:
    return NoSuchCheckpoint(run, f"run '{run}' has no checkpoint in {where}; "
                                 f"`slurm-geo ckpt ls --store {where}` lists its runs")


def no_step(run: str, step: int, steps: Sequence[int], where: str) -> NoSuchCheckpoint:
    shown = ", ".join(str(s) for s in steps[-STEPS_SHOWN:])
    more = "..., " if len(steps) > STEPS_SHOWN else ""
    return NoSuchCheckpoint(f"{run}@{step}", f"run '{run}' has no checkpoint at step {step} "
                                             f"in {where} (its steps: {more}{shown})")


def parse_target(target: str, repository: Any, where: str) -> tuple[str, int]:
    """RUN (its latest step) or RUN@STEP, checked against the store's manifests."""
    run, _, step_text = target.partition("@")
    if not step_text:
        return run, latest(repository, run, where)
    if not step_text.isdigit():
        raise ConfigError(f"'{target}': STEP after '@' must be a whole number")
    step = int(step_text)
    steps = repository.steps(run)
    if not steps:
        raise no_run(run, where)
    if step not in steps:
        raise no_step(run, step, steps, where)
    return run, step


def latest(repository: Any, run: str, where: str) -> int:
    step = repository.latest(run)
    if step is None:
        raise no_run(run, where)
    return step


def require_run(repository: Any, run: str, where: str) -> None:
    if not repository.steps(run):
        raise no_run(run, where)


def only_run(repository: Any, path: Path) -> str:
    runs = repository.runs()
    if len(runs) != 1:
        raise ConfigError(f"{path} holds runs {', '.join(runs) or 'none'}; choose one with --run")
    return runs[0]
