"""slurm_geo.torch.distributed without a process group: what its writer and reader take
and refuse, and that they pickle (DCP's process-based async save sends the writer to its
checkpoint process) without their open store or a live lease client."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from slurm_geo.ckpt import create_master_key_file
from slurm_geo.torch.distributed import StorageReader, StorageWriter


@pytest.fixture
def store(tmp_path: Path) -> tuple[str, Path]:
    (tmp_path / "store").mkdir()
    create_master_key_file(tmp_path / "key")
    return f"file://{tmp_path / 'store'}", tmp_path / "key"


def test_writer_and_reader_pickle_without_their_open_store(store):
    url, key = store
    writer = StorageWriter(url, run="r", step=3, key_file=key)
    assert writer._stored.repository.steps("r") == []  # opened here
    copy = pickle.loads(pickle.dumps(writer))
    assert copy._stored._repository is None and (copy.run, copy.step) == ("r", 3)
    assert copy._stored.repository.steps("r") == []  # and opened again where it lands
    reader = pickle.loads(pickle.dumps(StorageReader(url, run="r", key_file=key)))
    assert reader.run == "r" and reader.step is None


def test_a_writer_holding_a_lease_check_refuses_to_leave_its_process(store):
    url, key = store
    writer = StorageWriter(url, run="r", step=3, key_file=key, before_commit=lambda: None)
    with pytest.raises(TypeError, match="thread checkpointer"):
        pickle.dumps(writer)


@pytest.mark.parametrize("keys", [{}, {"key_file": "k", "run_key": bytes(32)}])
def test_exactly_one_key_source_is_taken(store, keys):
    with pytest.raises(ValueError, match="exactly one of key_file"):
        StorageWriter(store[0], run="r", step=1, **keys)


@pytest.mark.parametrize("checkpoint_id, valid", [
    (7, True), ("12", True), (0, True), (-1, False), ("latest", False), (True, False),
    ("/some/dir", False)])
def test_a_checkpoint_id_is_a_step(store, checkpoint_id, valid):
    url, key = store
    assert StorageWriter.validate_checkpoint_id(checkpoint_id) is valid
    assert StorageReader.validate_checkpoint_id(checkpoint_id) is valid
    writer = StorageWriter(url, run="r", key_file=key)
    if valid:
        writer.reset(checkpoint_id)
        assert writer.step == int(checkpoint_id)
    else:
        with pytest.raises(ValueError, match="is not a step"):
            writer.reset(checkpoint_id)


def test_a_save_without_a_step_or_without_collectives_is_refused(store):
    url, key = store
    with pytest.raises(ValueError, match="needs the step it saves"):
        StorageWriter(url, run="r", key_file=key).set_up_storage_writer(True)
    with pytest.raises(ValueError, match="commits one manifest for all ranks"):
        StorageWriter(url, run="r", step=1, key_file=key).set_up_storage_writer(
            True, rank=0, use_collectives=False)
