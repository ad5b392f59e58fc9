"""Save training state in the background and resume from the newest valid checkpoint.

`save()` stalls training only for the snapshot: every tensor of the model, optimizer,
scheduler and RNG states is copied to new CPU memory and the rest is encoded, then ONE
background thread compresses, encrypts and writes it. At most one snapshot is in flight:
a save first waits for the previous write, so memory stays bounded at one extra copy of
the state. A failed background write is raised by the next `save()` or `wait()`.

The step rule. A checkpoint's weights and optimizer state must come from the same step
(docs/format.md §7.1). The optimizer's step is derived from its own state, not taken on
trust: by default the largest `step` in its per-parameter states (Adam, AdamW, RMSprop,
... count there; parameters that missed an update lag, hence the max). A save whose
derived step differs from the global step it is given is refused before anything is
copied or written (`StepMismatch`). Optimizers that record no step (SGD) and optimizers
that have not stepped yet cannot be checked; the global step is used. Scripts whose global
step is not their optimizer's step count (gradient accumulation counted in micro-batches,
AMP skipping steps) pass their own `optimizer_step` function mapping optimizer to step.

Unchanged tensors. With `skip_unchanged`, a tensor that torch's own bookkeeping shows
untouched since the previous save (same storage, offset, shape, strides, dtype and device,
and the same version counter, which every in-place operation through torch bumps) is
named `unchanged` to the repository, which then copies its chunk refs from the parent
instead of hashing and encoding it again: a frozen base costs nothing after the first
save. It is off by default because writes that bypass torch (through a `.numpy()` view,
a raw pointer, a custom kernel outside the dispatcher) do not bump version counters, and
such a tensor would be saved with the parent's content. The snapshot copy is taken
either way, so the stall is the same.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, Protocol

import torch

from slurm_geo.ckpt import (
    CkptError,
    KeyFileError,
    Manifest,
    Metadata,
    Repository,
    StepMismatch,
    StoreUnavailable,
    Tensor,
)
from slurm_geo.ckpt.format.manifest import check_metadata
from slurm_geo.ckpt.format.names import key_name, manifest_name
from slurm_geo.closing import Closing
from slurm_geo.errors import SlurmGeoError
from slurm_geo.exitcodes import ExitCode
from slurm_geo.jobenv import JobEnv
from slurm_geo.torch.rng import capture_rng, restore_rng
from slurm_geo.torch.state import StateFormatError, flatten_state, unflatten_state

log = logging.getLogger(__name__)

Clock = Callable[[], datetime]


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...


class NoValidCheckpoint(SlurmGeoError):
    """The run has checkpoints, and every one of them is damaged."""

    exit_code = ExitCode.NO_VALID_CHECKPOINT

    def __init__(self, run: str, faults: list[tuple[int, Exception]]):
        self.faults = faults
        detail = "; ".join(f"step {step}: {exc}" for step, exc in faults)
        super().__init__(f"run {run!r} has no checkpoint that reads back intact ({detail}); "
                         "restore one from another replica")


class SavedThroughDcp(SlurmGeoError):
    """The checkpoint is a multi-rank one: Checkpointer cannot restore it, nor skip it as
    damaged (which would resume from an older one or from scratch)."""

    exit_code = ExitCode.USAGE

    def __init__(self, run: str, step: int, ranks: int):
        super().__init__(f"checkpoint {run}@{step} was saved through PyTorch Distributed "
                         f"Checkpoint by {ranks} ranks; load it with dcp.load and "
                         "slurm_geo.torch.distributed.StorageReader (docs/training.md)")


@dataclass(frozen=True)
class ResumeState:
    step: int
    epoch: int
    data_position: Any
    loss: float | None
    extra: Any
    metadata: Metadata


def optimizer_step_count(optimizer: torch.optim.Optimizer) -> int | None:
    """The largest `step` in the optimizer's per-parameter state; None when none has one."""
    steps = [state["step"] for state in optimizer.state.values() if "step" in state]
    if not steps:
        return None
    return max(int(s.item()) if isinstance(s, torch.Tensor) else int(s) for s in steps)


def utc_now() -> datetime:
    return datetime.now(UTC)


class UnchangedTensors:
    """Which tensors are untouched since the last `observe`, by torch's version counters.

    Holds the tensors it last saw, so their storage cannot be freed and reused by another
    tensor (whose pointer would then match). Any doubt (an inference tensor has no version
    counter) means changed.
    """

    def __init__(self) -> None:
        self._seen: dict[str, tuple[torch.Tensor, tuple[Any, ...] | None]] = {}

    def observe(self, tensors: Mapping[str, torch.Tensor]) -> set[str]:
        """Paths whose tensor is the same, unmodified, as at the previous call."""
        now = {path: (tensor, _signature(tensor)) for path, tensor in tensors.items()}
        same = {path for path, (_tensor, signature) in now.items()
                if signature is not None and path in self._seen
                and self._seen[path][1] == signature}
        self._seen = now
        return same


def _signature(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    try:
        version = tensor._version
        pointer = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # inference or storage-less tensors
        return None
    return (pointer, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(),
            tensor.dtype, tensor.device, version)


class Checkpointer(Closing):
    """Checkpoints of one run in `repository`, written by one background thread."""

    def __init__(
        self, repository: Repository, run_id: str, *,
        keep_parent_chain: bool = True,
        delta: bool = False,
        skip_unchanged: bool = False,
        before_commit: Callable[[], None] = lambda: None,
        optimizer_step: Callable[[torch.optim.Optimizer], int | None] = optimizer_step_count,
        clock: Clock = utc_now,
        env: Mapping[str, str] = os.environ,
    ):
        """`keep_parent_chain` names the previous checkpoint as parent, so unchanged chunks
        are stored once; `delta` also stores changed chunks as deltas against it;
        `skip_unchanged` names tensors untouched since the previous save (module docs);
        `before_commit` runs right before each checkpoint is committed, in the writer
        thread, and may refuse it by raising (FederatedRun.wait_for_lease does)."""
        if delta and not keep_parent_chain:
            raise ValueError("delta checkpoints need keep_parent_chain")
        self._repository = repository
        self._run = run_id
        self._keep_parent_chain = keep_parent_chain
        self._delta = delta
        self._before_commit = before_commit
        self._unchanged = UnchangedTensors() if skip_unchanged else None
        self._observed_step: int | None = None  # the save `_unchanged` last observed
        self._optimizer_step = optimizer_step
        self._clock = clock
        self._env = env
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slurm-geo-ckpt")
        self._pending: tuple[int, int | None, Future[Manifest]] | None = None
        self._last: tuple[int, int | None] | None = None  # (step, its parent) last committed

    @property
    def run_id(self) -> str:
        return self._run

    @property
    def last_step(self) -> int | None:
        """The step of the last checkpoint saved (written) or resumed from."""
        return None if self._last is None else self._last[0]

    def save(
        self, step: int, model: Stateful, optimizer: torch.optim.Optimizer,
        scheduler: Stateful | None = None, *, data_position: Any = None, epoch: int = 0,
        loss: float | torch.Tensor | None = None, extra: Any = None,
    ) -> None:
        """Snapshot the state at `step` and write it in the background.

        Waits for the previous write first and raises its error, if it failed. Refuses
        (StepMismatch, ValueError) before copying anything if the optimizer's step is
        not `step`. `data_position` and `extra` are plain values, tensors or arrays.
        """
        self.wait()
        metadata = self._metadata(step, optimizer, epoch, loss)
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": None if scheduler is None else scheduler.state_dict(),
            "rng": capture_rng(),
            "data_position": data_position,
            "extra": extra,
        }
        sources: dict[str, torch.Tensor] = {}
        tensors, extra_state = flatten_state(state, copy=True, sources=sources)
        parent = self._parent_for(step)
        unchanged = self._unchanged_since(parent, step, sources)
        future = self._executor.submit(self._write, tensors, extra_state, metadata, parent,
                                       unchanged)
        self._pending = (step, parent, future)

    def wait(self) -> Manifest | None:
        """Wait for the write in flight; its manifest, or None if there was none."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        step, parent, future = pending
        try:
            manifest = future.result()
        except BaseException as exc:
            self._observed_step = None  # what was observed was never written
            exc.add_note(f"while writing checkpoint {step} of run {self._run!r} in the background")
            raise
        self._last = (step, parent)
        return manifest

    def close(self) -> None:
        """Wait for the last write (raising its error) and stop the writer thread."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)

    def resume(
        self, model: Stateful, optimizer: torch.optim.Optimizer, scheduler: Stateful | None = None,
        *, at_step: int | None = None,
    ) -> ResumeState | None:
        """Restore the newest checkpoint that reads back intact; None if the run has none.

        `at_step` restores that checkpoint (the one the federation daemon chose for a move,
        from its verification record and a presence check, docs/format.md §8.7) or, should
        it not read back intact, the newest older one that does: never a newer one.

        Every chunk is verified while it is read. A damaged checkpoint (corrupt or missing
        objects, a skeleton this module cannot read) is logged and skipped for the next
        older one. An unreachable store, an unreadable key file and a run key that does not
        open (the wrong master key) are raised, never taken for damage, lest the run
        restart from scratch. Raises NoValidCheckpoint when every checkpoint is damaged.
        """
        self.wait()
        faults: list[tuple[int, Exception]] = []
        steps = list(reversed(self._repository.steps(self._run)))
        candidates = steps if at_step is None \
            else [at_step, *(s for s in steps if s < at_step)]
        for step in candidates:
            try:
                layout = self._repository.manifest(self._run, step).sharded
                if layout is not None:
                    raise SavedThroughDcp(self._run, step, layout.ranks)
                checkpoint = self._repository.read_checkpoint(self._run, step)
                state = _training_state(unflatten_state(checkpoint.tensors,
                                                        checkpoint.extra_state))
            except (CkptError, StateFormatError) as exc:
                if not _is_damage(exc, self._run):
                    raise
                log.warning("run %s: skipping checkpoint at step %d, it is damaged: %s",
                            self._run, step, exc)
                faults.append((step, exc))
                continue
            if faults:
                log.warning("run %s: resuming from step %d, older than the newest (%d)",
                            self._run, step, faults[0][0])
            return self._restore(checkpoint.manifest, state, model, optimizer, scheduler)
        if faults:
            raise NoValidCheckpoint(self._run, faults)
        return None

    def _restore(self, manifest: Manifest, state: dict[str, Any], model: Stateful,
                 optimizer: torch.optim.Optimizer, scheduler: Stateful | None) -> ResumeState:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None:
            if state["scheduler"] is None:
                raise ValueError(f"checkpoint {manifest.step} of run {self._run!r} was saved "
                                 "without a scheduler; resume without one")
            scheduler.load_state_dict(state["scheduler"])
        restore_rng(state["rng"])
        self._last = (manifest.step, manifest.parent_step)
        self._observed_step = None  # the loaded tensors were never observed
        meta = manifest.metadata
        return ResumeState(meta.global_step, meta.epoch, state["data_position"], meta.loss,
                           state["extra"], meta)

    def _metadata(self, step: int, optimizer: torch.optim.Optimizer, epoch: int,
                  loss: float | torch.Tensor | None) -> Metadata:
        derived = self._optimizer_step(optimizer)
        name = manifest_name(self._run, step)
        if derived is not None and derived != step:
            raise StepMismatch(name, step, derived)
        job = JobEnv.from_environ(self._env)
        metadata = Metadata(
            global_step=step, optimizer_step=step if derived is None else derived, epoch=epoch,
            loss=_loss_value(loss),
            created_at=_moment(self._clock()),
            cluster=job.cluster, job_id=job.job_id,
        )
        check_metadata(name, metadata)
        return metadata

    def _parent_for(self, step: int) -> int | None:
        if not self._keep_parent_chain or self._last is None:
            return None
        last_step, last_parent = self._last
        if last_step < step:
            return last_step
        return last_parent if last_step == step else None  # re-save / rollback

    def _unchanged_since(self, parent: int | None, step: int,
                         sources: dict[str, torch.Tensor]) -> set[str]:
        """Tensors untouched since the save of `parent`, if that is the one last observed."""
        if self._unchanged is None:
            return set()
        same = self._unchanged.observe(sources)
        observed, self._observed_step = self._observed_step, step
        return same if parent is not None and parent == observed else set()

    def _write(self, tensors: list[Tensor], extra_state: bytes, metadata: Metadata,
               parent: int | None, unchanged: set[str]) -> Manifest:
        return self._repository.write_checkpoint(self._run, tensors, extra_state, metadata,
                                                 parent=parent, delta=self._delta,
                                                 unchanged=unchanged,
                                                 before_commit=self._before_commit,
                                                 stamp=self._committed_at)

    def _committed_at(self, metadata: Metadata) -> Metadata:
        """`created_at` is when the checkpoint is committed (its packs written, its lease
        checked, its manifest next), to the millisecond: where checkpoint-sync's
        replication lag starts, not counting the job's own write of it
        (docs/checkpoint-sync.md, Metrics)."""
        return replace(metadata, created_at=_moment(self._clock()))


def _moment(when: datetime) -> str:
    """ISO 8601 in UTC to the millisecond: 2026-12-06T17:37:25.144Z."""
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _loss_value(loss: float | torch.Tensor | None) -> float | None:
    if isinstance(loss, torch.Tensor):
        return float(loss.detach())
    return None if loss is None else float(loss)


def _is_damage(exc: Exception, run: str) -> bool:
    """Damage to one checkpoint, as opposed to a fault every checkpoint would hit."""
    if isinstance(exc, (StoreUnavailable, KeyFileError)):
        return False
    return not (isinstance(exc, CkptError) and exc.name == key_name(run))  # wrong master key


def _training_state(state: Any) -> dict[str, Any]:
    keys = {"model", "optimizer", "scheduler", "rng", "data_position", "extra"}
    if not isinstance(state, dict) or not keys <= state.keys():
        raise StateFormatError("the checkpoint does not hold a Checkpointer's training state")
    return state
