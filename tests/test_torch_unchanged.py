"""Unchanged-tensor detection: what torch's version counters may and may not be trusted for."""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import pytest
import torch

from slurm_geo.ckpt import LocalDirStore, Manifest, Repository, create_master_key_file
from slurm_geo.torch.checkpointer import Checkpointer, UnchangedTensors
from slurm_geo.torch.state import unflatten_state

RUN = "frozen-run"


class FrozenBase(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = torch.nn.Linear(16, 16)
        self.base.requires_grad_(False)
        self.head = torch.nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.base(x)))


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.randn(4, 16)).square().sum().backward()
    optimizer.step()


def model_and_optimizer() -> tuple[FrozenBase, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = FrozenBase()
    trainable = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(trainable, lr=0.1)


def flat(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a save sees: a fresh state dict (new detached views) every time."""
    return dict(model.state_dict())


def _in_place(model: FrozenBase) -> None:
    with torch.no_grad():
        model.base.weight.add_(1e-3)


def _through_a_view(model: FrozenBase) -> None:
    with torch.no_grad():
        model.base.weight.view(-1)[0] = 5.0


def _replaced(model: FrozenBase) -> None:
    model.base.weight.data = torch.zeros_like(model.base.weight)


def _loaded(model: FrozenBase) -> None:
    other = FrozenBase()
    model.load_state_dict(other.state_dict())


def _copied_onto(model: FrozenBase) -> None:
    with torch.no_grad():
        model.base.weight.copy_(model.base.weight.clone())  # same values, still a write


@pytest.mark.parametrize(
    "modify", [_in_place, _through_a_view, _replaced, _loaded, _copied_onto],
    ids=["add_", "view", "data=", "load_state_dict", "copy_ of equal values"],
)
def test_an_in_place_change_is_never_taken_for_unchanged(
    modify: Callable[[FrozenBase], None]
) -> None:
    model, _optimizer = model_and_optimizer()
    tracker = UnchangedTensors()
    assert tracker.observe(flat(model)) == set()  # nothing seen before
    assert tracker.observe(flat(model)) == {"base.weight", "base.bias", "head.weight",
                                            "head.bias"}
    modify(model)
    assert "base.weight" not in tracker.observe(flat(model))


def test_training_steps_change_only_the_trained_tensors() -> None:
    model, optimizer = model_and_optimizer()
    tracker = UnchangedTensors()
    train_step(model, optimizer)
    tracker.observe({**flat(model), **_moments(optimizer)})
    train_step(model, optimizer)
    assert tracker.observe({**flat(model), **_moments(optimizer)}) == {"base.weight",
                                                                        "base.bias"}


def _moments(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {f"opt.{i}.{name}": value
            for i, state in optimizer.state_dict()["state"].items()
            for name, value in state.items()}


def test_a_tensor_under_another_path_or_shape_is_not_unchanged() -> None:
    weight = torch.zeros(4, 4)
    tracker = UnchangedTensors()
    tracker.observe({"a": weight, "b": weight.view(16)})
    assert tracker.observe({"a": weight.view(16), "b": weight}) == set()
    assert tracker.observe({"a": weight.view(16), "b": weight}) == {"a", "b"}


def test_inference_tensors_are_never_unchanged() -> None:
    with torch.inference_mode():
        frozen = torch.zeros(3)
    tracker = UnchangedTensors()
    tracker.observe({"x": frozen})
    assert tracker.observe({"x": frozen}) == set()


class RecordingRepository(Repository):
    """Records the `unchanged` hint of each save."""

    hints: list[set[str]]

    def write_checkpoint(self, run: str, tensors: Any, extra_state: Any, metadata: Any,
                         parent: int | None = None, delta: bool = False,
                         unchanged: Collection[str] = (), **options: Any) -> Manifest:
        self.hints.append(set(unchanged))
        return super().write_checkpoint(run, tensors, extra_state, metadata, parent=parent,
                                        delta=delta, unchanged=unchanged, **options)


@pytest.fixture
def repo(tmp_path: Path) -> RecordingRepository:
    (tmp_path / "store").mkdir()
    key = create_master_key_file(tmp_path / "master.key")
    repository = RecordingRepository(LocalDirStore(tmp_path / "store"), key)
    repository.hints = []
    return repository


def refs_of(manifest: Manifest, path: str) -> tuple[Any, ...]:
    (entry,) = [t for t in manifest.tensors if t.path == path]
    return entry.chunks


def test_frozen_tensors_are_named_unchanged_and_a_modified_one_is_saved_anew(
    repo: RecordingRepository,
) -> None:
    model, optimizer = model_and_optimizer()
    with Checkpointer(repo, RUN, skip_unchanged=True) as checkpointer:
        for step in (1, 2):
            train_step(model, optimizer)
            checkpointer.save(step, model, optimizer)
        checkpointer.wait()
        _in_place(model)  # a "frozen" tensor changed after all
        train_step(model, optimizer)
        checkpointer.save(3, model, optimizer)
        checkpointer.save(3, model, optimizer)  # a re-save: its parent (2) is not observed
    assert repo.hints[0] == set()
    assert repo.hints[1] == {"model.base.weight", "model.base.bias"}
    assert repo.hints[2] == {"model.base.bias"}
    assert repo.hints[3] == set()
    first, second = repo.manifest(RUN, 1), repo.manifest(RUN, 2)
    assert refs_of(second, "model.base.weight") == refs_of(first, "model.base.weight")
    saved = repo.read_checkpoint(RUN, 3)
    state = unflatten_state(saved.tensors, saved.extra_state)
    for name, tensor in model.state_dict().items():
        assert torch.equal(state["model"][name], tensor), name


def test_without_the_option_nothing_is_named_unchanged(repo: RecordingRepository) -> None:
    model, optimizer = model_and_optimizer()
    with Checkpointer(repo, RUN) as checkpointer:
        for step in (1, 2):
            train_step(model, optimizer)
            checkpointer.save(step, model, optimizer)
    assert repo.hints == [set(), set()]


def test_after_a_failed_write_nothing_is_named_unchanged(repo: RecordingRepository) -> None:
    model, optimizer = model_and_optimizer()
    calls = 0

    class FailingOnce(RecordingRepository):
        def write_checkpoint(self, *args: Any, **kwargs: Any) -> Manifest:
            nonlocal calls
            calls += 1
            if calls == 2:
                self.hints.append(set(kwargs.get("unchanged", ())))
                raise OSError("disk full")
            return super().write_checkpoint(*args, **kwargs)

    repo.__class__ = FailingOnce
    with Checkpointer(repo, RUN, skip_unchanged=True) as checkpointer:
        for step in (1, 2):
            train_step(model, optimizer)
            checkpointer.save(step, model, optimizer)
        with pytest.raises(OSError, match="disk full"):
            checkpointer.wait()
        train_step(model, optimizer)
        checkpointer.save(3, model, optimizer)  # parent 1; step 2's observation is void
        checkpointer.wait()
        train_step(model, optimizer)
        checkpointer.save(4, model, optimizer)
    assert repo.hints[2] == set()
    assert repo.hints[3] == {"model.base.weight", "model.base.bias"}
    assert repo.manifest(RUN, 3).parent_step == 1
