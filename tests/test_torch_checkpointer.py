"""Checkpointer: bit-identical resume, damaged checkpoints, background writes, the step rule."""

from __future__ import annotations

import copy
import logging
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import torch

from slurm_geo.ckpt import (
    LocalDirStore,
    Repository,
    StepMismatch,
    StoreUnavailable,
    WrongKey,
    create_master_key_file,
)
from slurm_geo.ckpt.stores.store import Bytes
from slurm_geo.examples.train import TrainConfig, train
from slurm_geo.torch import checkpointer as checkpointer_module
from slurm_geo.torch.checkpointer import (
    Checkpointer,
    NoValidCheckpoint,
    optimizer_step_count,
)
from slurm_geo.torch.signals import RequeueOnSignal
from slurm_geo.torch.state import unflatten_state
from tests.helpers import pack_files

RUN = "run-1"


@pytest.fixture
def key(tmp_path: Path) -> bytes:
    return create_master_key_file(tmp_path / "master.key")


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    path = tmp_path / "store"
    path.mkdir()
    return path


def repository(store_dir: Path, key: bytes) -> Repository:
    """A new Repository each time: nothing cached from an earlier 'process'."""
    return Repository(LocalDirStore(store_dir), key)


def assert_same(a: Any, b: Any) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def small_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(8, 2)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def take_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, count: int) -> None:
    for _ in range(count):
        optimizer.zero_grad()
        model(torch.randn(4, 8)).square().sum().backward()
        optimizer.step()


def quiet(_line: str) -> None:
    pass


def run_training(repo: Repository, run: str, config: TrainConfig, delta: bool = False) -> Any:
    with Checkpointer(repo, run, delta=delta) as checkpointer:
        return train(checkpointer, config, RequeueOnSignal(), say=quiet)


@pytest.mark.parametrize("delta", [False, True], ids=["dedup", "delta"])
def test_stop_and_resume_is_bit_identical_to_a_straight_run(
    store_dir: Path, key: bytes, delta: bool
) -> None:
    straight = run_training(repository(store_dir, key), "straight", TrainConfig(30, 7))
    first = run_training(repository(store_dir, key), "split", TrainConfig(30, 7, 13), delta)
    assert (first.step, first.stopped) == (13, True)
    second = run_training(repository(store_dir, key), "split", TrainConfig(30, 7), delta)
    assert (second.step, second.stopped) == (30, False)
    assert_same(second.model.state_dict(), straight.model.state_dict())
    assert_same(second.optimizer.state_dict(), straight.optimizer.state_dict())
    assert_same(second.scheduler.state_dict(), straight.scheduler.state_dict())
    assert repository(store_dir, key).steps("split") == [7, 13, 14, 21, 28, 30]


def test_resume_without_the_rng_states_diverges(
    store_dir: Path, key: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bit-identical test has teeth: the example draws from every global generator."""
    straight = run_training(repository(store_dir, key), "straight", TrainConfig(20, 5))
    run_training(repository(store_dir, key), "split", TrainConfig(20, 5, 10))
    monkeypatch.setattr(checkpointer_module, "restore_rng", lambda states: None)
    second = run_training(repository(store_dir, key), "split", TrainConfig(20, 5))
    assert not torch.equal(second.model[0].weight, straight.model[0].weight)


def save_steps_2_and_4(store_dir: Path, key: bytes) -> Any:
    """Checkpoints at steps 2 and 4; the model and optimizer state as saved at step 2."""
    model, optimizer = small_model()
    with Checkpointer(repository(store_dir, key), RUN) as checkpointer:
        take_steps(model, optimizer, 2)
        checkpointer.save(2, model, optimizer, data_position={"batch": 2})
        expected = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
        take_steps(model, optimizer, 2)
        checkpointer.save(4, model, optimizer, data_position={"batch": 4})
    return expected


def flip_a_bit_of_step_4s_own_pack(store_dir: Path, key: bytes) -> str:
    """Damage the pack step 4 holds and step 2 does not; its id."""
    repo = repository(store_dir, key)
    older = {ref.pack for ref in repo.manifest(RUN, 2).refs()}
    (damaged,) = {ref.pack for ref in repo.manifest(RUN, 4).refs()} - older
    pack = store_dir / repo.manifest(RUN, 4).pack_object(damaged)
    data = bytearray(pack.read_bytes())
    data[len(data) // 2] ^= 0x01
    pack.write_bytes(bytes(data))
    return damaged


def test_resume_skips_a_damaged_newest_checkpoint(
    store_dir: Path, key: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    expected = save_steps_2_and_4(store_dir, key)
    damaged = flip_a_bit_of_step_4s_own_pack(store_dir, key)

    fresh_model, fresh_optimizer = small_model()
    with caplog.at_level(logging.WARNING, logger="slurm_geo.torch.checkpointer"):
        resumed = Checkpointer(repository(store_dir, key), RUN).resume(fresh_model,
                                                                        fresh_optimizer)
    assert resumed is not None
    assert (resumed.step, resumed.data_position) == (2, {"batch": 2})
    assert_same((fresh_model.state_dict(), fresh_optimizer.state_dict()), expected)
    assert "step 4" in caplog.text and damaged in caplog.text and "step 2" in caplog.text


def test_resume_raises_when_every_checkpoint_is_damaged(store_dir: Path, key: bytes) -> None:
    model, optimizer = small_model()
    with Checkpointer(repository(store_dir, key), RUN) as checkpointer:
        checkpointer.save(0, model, optimizer)
    for pack in pack_files(store_dir):
        pack.write_bytes(pack.read_bytes()[:-1])
    with pytest.raises(NoValidCheckpoint, match="step 0"):
        Checkpointer(repository(store_dir, key), RUN).resume(model, optimizer)


def test_resume_of_a_new_run_is_none_and_an_unreachable_store_is_an_error(
    store_dir: Path, key: bytes
) -> None:
    model, optimizer = small_model()
    assert Checkpointer(repository(store_dir, key), RUN).resume(model, optimizer) is None

    class Unreachable(LocalDirStore):
        def list(self, prefix: str) -> list[str]:
            raise StoreUnavailable(prefix, "mount is gone")

    repo = Repository(Unreachable(store_dir), key)
    with pytest.raises(StoreUnavailable):  # not None: that would restart the run from zero
        Checkpointer(repo, RUN).resume(model, optimizer)


def test_resume_with_the_wrong_master_key_is_an_error_not_damage(
    tmp_path: Path, store_dir: Path, key: bytes
) -> None:
    model, optimizer = small_model()
    with Checkpointer(repository(store_dir, key), RUN) as checkpointer:
        checkpointer.save(0, model, optimizer)
    other = create_master_key_file(tmp_path / "other.key")
    with pytest.raises(WrongKey, match="keys/run-1"):
        Checkpointer(repository(store_dir, other), RUN).resume(model, optimizer)


class GatedStore(LocalDirStore):
    """Every put blocks until the test opens the gate."""

    def __init__(self, root: Path):
        super().__init__(root)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def put(self, name: str, data: Bytes) -> None:
        self.entered.set()
        self.gate.wait(timeout=60)
        super().put(name, data)


def test_save_returns_after_the_snapshot_and_writes_it_in_the_background(
    store_dir: Path, key: bytes
) -> None:
    store = GatedStore(store_dir)
    checkpointer = Checkpointer(Repository(store, key), RUN)
    model, optimizer = small_model()
    try:
        take_steps(model, optimizer, 1)
        snapshot = copy.deepcopy(model.state_dict())
        checkpointer.save(1, model, optimizer)  # returns while no put can complete
        assert store.entered.wait(timeout=30)
        assert repository(store_dir, key).steps(RUN) == []
        take_steps(model, optimizer, 1)  # training goes on and changes the weights in place
        outcome: list[BaseException | None] = []

        def second_save() -> None:
            try:
                checkpointer.save(2, model, optimizer)
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=second_save)
        thread.start()
        thread.join(timeout=0.2)
        assert thread.is_alive() and not outcome  # one snapshot in flight at most
    finally:
        store.gate.set()
    thread.join(timeout=30)
    assert outcome == [None]
    checkpointer.close()
    repo = repository(store_dir, key)
    assert repo.steps(RUN) == [1, 2]
    saved = repo.read_checkpoint(RUN, 1)
    assert_same(unflatten_state(saved.tensors, saved.extra_state)["model"], snapshot)


class FlakyStore(LocalDirStore):
    failing = False

    def put(self, name: str, data: Bytes) -> None:
        if self.failing:
            raise StoreUnavailable(name, "disk full")
        super().put(name, data)


def test_a_failed_background_write_surfaces_at_the_next_save_and_wait(
    store_dir: Path, key: bytes
) -> None:
    store = FlakyStore(store_dir)
    checkpointer = Checkpointer(Repository(store, key), RUN)
    model, optimizer = small_model()
    store.failing = True
    take_steps(model, optimizer, 1)
    checkpointer.save(1, model, optimizer)  # the failure happens in the background
    take_steps(model, optimizer, 1)
    with pytest.raises(StoreUnavailable) as raised:
        checkpointer.save(2, model, optimizer)
    assert any("checkpoint 1" in note for note in raised.value.__notes__)
    store.failing = False
    checkpointer.save(2, model, optimizer)  # reported once; the next save goes ahead
    manifest = checkpointer.wait()
    assert manifest is not None and manifest.parent_step is None  # step 1 never committed
    store.failing = True
    take_steps(model, optimizer, 1)
    checkpointer.save(3, model, optimizer)
    with pytest.raises(StoreUnavailable):
        checkpointer.wait()
    checkpointer.close()
    assert repository(store_dir, key).steps(RUN) == [2]


def test_weights_and_optimizer_from_different_steps_are_refused_before_any_write(
    store_dir: Path, key: bytes
) -> None:
    checkpointer = Checkpointer(repository(store_dir, key), RUN)
    model, optimizer = small_model()
    take_steps(model, optimizer, 3)
    for wrong in (2, 4):
        with pytest.raises(StepMismatch, match=f"step {wrong} but the optimizer state is from"
                                               " step 3"):
            checkpointer.save(wrong, model, optimizer)
    assert checkpointer.wait() is None
    assert [p for p in store_dir.rglob("*") if p.is_file()] == []
    checkpointer.save(3, model, optimizer)
    checkpointer.close()
    assert repository(store_dir, key).manifest(RUN, 3).metadata.optimizer_step == 3


def test_optimizer_step_count_rule() -> None:
    used, unused = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    adam = torch.optim.Adam([*used.parameters(), *unused.parameters()])
    assert optimizer_step_count(adam) is None  # never stepped: nothing to check
    for i in range(3):
        adam.zero_grad()
        (used if i else unused)(torch.ones(1, 2)).sum().backward()
        adam.step()
    assert optimizer_step_count(adam) == 2  # the largest count; `unused` lags at 1
    sgd = torch.optim.SGD(used.parameters(), lr=0.1, momentum=0.9)
    used(torch.ones(1, 2)).sum().backward()
    sgd.step()
    assert optimizer_step_count(sgd) is None  # SGD records no step


def test_metadata_and_parent_chain(store_dir: Path, key: bytes) -> None:
    env = {"SLURM_CLUSTER_NAME": "rented", "SLURM_JOB_ID": "4711"}
    clock = lambda: datetime(2026, 11, 29, 15, 2, 11, 500, tzinfo=UTC)  # noqa: E731
    checkpointer = Checkpointer(repository(store_dir, key), RUN, clock=clock, env=env)
    model, optimizer = small_model()
    take_steps(model, optimizer, 2)
    checkpointer.save(2, model, optimizer, epoch=1, loss=torch.tensor(0.5, requires_grad=True))
    take_steps(model, optimizer, 2)
    checkpointer.save(4, model, optimizer, epoch=1, loss=float("nan"))
    checkpointer.save(4, model, optimizer, epoch=1, loss=0.25)  # a re-save keeps its parent
    checkpointer.close()
    repo = repository(store_dir, key)
    first, second = repo.manifest(RUN, 2), repo.manifest(RUN, 4)
    assert first.metadata.created_at == "2026-11-29T15:02:11.000Z"  # at its commit, to the ms
    assert (first.metadata.cluster, first.metadata.job_id) == ("rented", "4711")
    assert (first.metadata.epoch, first.metadata.loss, first.parent_step) == (1, 0.5, None)
    assert (second.metadata.loss, second.parent_step) == (0.25, 2)


def test_sgd_without_a_step_count_saves_and_resumes_data_position_and_extra(
    store_dir: Path, key: bytes
) -> None:
    model = torch.nn.Linear(3, 3)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.5)
    sgd.step()
    scheduler.step()
    with Checkpointer(repository(store_dir, key), RUN) as checkpointer:
        checkpointer.save(17, model, sgd, scheduler, data_position={"shard": 3, "offset": 10},
                          epoch=2, extra={"tokens_seen": 10**12, "ema": torch.zeros(3)})
    fresh = torch.nn.Linear(3, 3)
    fresh_sgd = torch.optim.SGD(fresh.parameters(), lr=0.1)
    fresh_scheduler = torch.optim.lr_scheduler.StepLR(fresh_sgd, step_size=1, gamma=0.5)
    resumed = Checkpointer(repository(store_dir, key), RUN).resume(fresh, fresh_sgd,
                                                                    fresh_scheduler)
    assert resumed is not None
    assert (resumed.step, resumed.epoch, resumed.data_position) == (
        17, 2, {"shard": 3, "offset": 10})
    assert_same(resumed.extra, {"tokens_seen": 10**12, "ema": torch.zeros(3)})
    assert_same(fresh_scheduler.state_dict(), scheduler.state_dict())
    assert fresh_sgd.param_groups[0]["lr"] == sgd.param_groups[0]["lr"] == 0.05


def test_resume_at_a_step_restores_that_one_and_never_a_newer_one(
    store_dir: Path, key: bytes
) -> None:
    expected = save_steps_2_and_4(store_dir, key)
    fresh_model, fresh_optimizer = small_model()
    resumed = Checkpointer(repository(store_dir, key), RUN).resume(
        fresh_model, fresh_optimizer, at_step=2)
    assert resumed is not None and resumed.step == 2
    assert_same((fresh_model.state_dict(), fresh_optimizer.state_dict()), expected)


def test_resume_at_a_damaged_step_falls_back_to_the_older_one_never_a_wrong_tensor(
    store_dir: Path, key: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """The daemon chose step 4 from its verification record and a presence check (issue
    32: nothing read back); a provider's store has rotted a pack of it, and its scrub
    reported all fine. The job's own load is the last check: it refuses 4 and takes 2."""
    expected = save_steps_2_and_4(store_dir, key)
    flip_a_bit_of_step_4s_own_pack(store_dir, key)
    fresh_model, fresh_optimizer = small_model()
    with caplog.at_level(logging.WARNING):
        resumed = Checkpointer(repository(store_dir, key), RUN).resume(
            fresh_model, fresh_optimizer, at_step=4)
    assert resumed is not None and resumed.step == 2
    assert_same((fresh_model.state_dict(), fresh_optimizer.state_dict()), expected)
    assert "skipping checkpoint at step 4" in caplog.text
    with pytest.raises(NoValidCheckpoint, match="step 1"):  # nothing older than 1: refused
        Checkpointer(repository(store_dir, key), RUN).resume(*small_model(), at_step=1)


def test_a_refusing_commit_guard_commits_nothing(store_dir: Path, key: bytes) -> None:
    class Refused(Exception):
        pass

    def refuse() -> None:
        raise Refused("the lease is gone")

    model, optimizer = small_model()
    checkpointer = Checkpointer(repository(store_dir, key), RUN, before_commit=refuse)
    checkpointer.save(1, model, optimizer)
    with pytest.raises(Refused):
        checkpointer.wait()
    checkpointer.close()
    assert repository(store_dir, key).steps(RUN) == []
