"""torch.save files read and written without torch: what a pushed file pulls back as, and
the pickles that are refused before anything in them runs."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from slurm_geo.ckpt import LocalDirStore, Metadata, Repository
from slurm_geo.ckpt.files.pushpull import pull_tensor_file, push_tensor_file
from slurm_geo.ckpt.files.skeleton import TensorFileError
from slurm_geo.ckpt.files.torchfile import read_torch_file
from slurm_geo.ckpt.ops.usage import pack_sizes

REPO = Path(__file__).resolve().parent.parent


def metadata(step: int) -> Metadata:
    return Metadata(step, step, 0, None, "2026-12-04T12:00:00Z", "onprem", "7")


@pytest.fixture
def repository(tmp_path) -> Repository:
    (tmp_path / "store").mkdir()
    return Repository(LocalDirStore(tmp_path / "store"), os.urandom(32))


def trained_state() -> dict:
    """What a training script saves: a module's state dict (an OrderedDict carrying
    `_metadata`), AdamW's state (int keys, tuples, floats, bools, None) and odd tensors."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.LayerNorm(8),
                                torch.nn.BatchNorm1d(8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randn(4, 16)).sum().backward()
    optimizer.step()
    base = torch.arange(24.0).reshape(4, 6)
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "transposed": base.t(),  # not contiguous
        "row": base[2],  # a view into the middle of another tensor's storage
        "bf16": torch.randn(5, dtype=torch.bfloat16),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 3, dtype=torch.int32),
        "mask": torch.tensor([True, False, True]),
        "parameter": torch.nn.Parameter(torch.ones(2, 2)),
        "size": torch.Size([3, 4]),
        "dtype": torch.float16,
        "device": torch.device("cpu"),
        "step": 12, "lr": 1e-3, "inf": float("inf"), "name": "it's", "blob": b"\x00\xff",
        "nothing": None, "pair": (1, "a"), "list": [1.5, [2, 3]],
    }


def assert_same(back, state, where="state"):
    if isinstance(state, torch.Tensor):
        assert isinstance(back, torch.Tensor), where
        assert back.dtype == state.dtype and back.shape == state.shape, where
        assert torch.equal(back, state.detach()), where
    elif isinstance(state, dict):
        assert type(back) is type(state) and list(back) == list(state), where
        assert getattr(back, "_metadata", None) == getattr(state, "_metadata", None), where
        for key in state:
            assert_same(back[key], state[key], f"{where}.{key}")
    elif isinstance(state, list | tuple):
        assert type(back) is type(state) and len(back) == len(state), where
        for i, (b, s) in enumerate(zip(back, state, strict=True)):
            assert_same(b, s, f"{where}.{i}")
    else:
        assert type(back) is type(state) and back == state, where


def test_a_pushed_training_state_pulls_back_equal_and_loads_with_weights_only(
        tmp_path, repository):
    state = trained_state()
    torch.save(state, tmp_path / "in.pt")

    push_tensor_file(repository, tmp_path / "in.pt", "ft", metadata(1))
    pull_tensor_file(repository, "ft", 1, tmp_path / "out.pt")

    assert_same(torch.load(tmp_path / "out.pt", weights_only=True), state)
    assert_same(torch.load(tmp_path / "out.pt", weights_only=True, mmap=True), state)
    assert not (tmp_path / "out.pt.partial").exists()


def test_a_file_pushed_and_one_saved_in_process_share_paths(tmp_path):
    from slurm_geo.torch.state import flatten_state

    state = trained_state()
    torch.save(state, tmp_path / "in.pt")
    read = read_torch_file(tmp_path / "in.pt")
    tensors, skeleton = flatten_state(state)
    assert [t.path for t in read.tensors] == [t.path for t in tensors]
    assert read.extra_state == skeleton


def test_the_next_step_of_a_run_takes_the_previous_as_parent_and_stores_only_changes(
        tmp_path, repository):
    frozen = {"base": torch.randn(256, 1024), "head": torch.zeros(16)}
    torch.save(frozen, tmp_path / "1.pt")
    push_tensor_file(repository, tmp_path / "1.pt", "ft", metadata(1))
    frozen["head"] += 1
    torch.save(frozen, tmp_path / "2.pt")
    stored_before = stored_bytes(repository)

    manifest, nbytes = push_tensor_file(repository, tmp_path / "2.pt", "ft", metadata(2))

    assert manifest.parent_step == 1 and nbytes == (256 * 1024 + 16) * 4
    assert stored_bytes(repository) - stored_before < 16 * 1024  # the head and the skeleton


def stored_bytes(repository: Repository) -> int:
    return sum(pack_sizes(repository.store).values())


def hostile_file(path: Path, pickled: bytes) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", pickled)
        archive.writestr("archive/byteorder", b"little")
        archive.writestr("archive/version", b"3\n")
    return path


class RunsACommand:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class CallsEval:
    def __reduce__(self):
        return (eval, ("__import__('os').system('false')",))


@pytest.mark.parametrize("payload, named", [
    (lambda marker: {"w": RunsACommand(marker)}, "refused to unpickle"),
    (lambda marker: [CallsEval()], r"unpickle (__builtin__|builtins)\.eval"),
    (lambda marker: {"when": __import__("datetime").date(2026, 12, 4)}, "datetime.date"),
])
def test_a_hostile_pickle_is_refused_without_running_anything(tmp_path, repository, payload,
                                                              named):
    marker = tmp_path / "ran"
    path = hostile_file(tmp_path / "evil.pt", pickle.dumps(payload(marker), protocol=2))

    with pytest.raises(TensorFileError, match=named) as refused:
        push_tensor_file(repository, path, "ft", metadata(1))

    assert not marker.exists() and "evil.pt" in str(refused.value)
    assert repository.runs() == []


@pytest.mark.parametrize("pickled, says", [
    # a tensor whose storage is not one of the archive's
    (b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n(X\x01\x00\x00\x00xK\x00K\x01\x85K\x01\x85"
     b"\x89ctorch\nFloatStorage\ntR.", "a tensor rebuilt from"),
    # torch.Size of a string
    (b"\x80\x02ctorch\nSize\nX\x03\x00\x00\x00abc\x85R.", "torch.Size"),
    # _codecs.encode asked for another codec than the one pickles of bytes use
    (b"\x80\x02c_codecs\nencode\nX\x01\x00\x00\x00aX\x05\x00\x00\x00rot13\x86R.",
     "_codecs.encode"),
    (b"\x80\x02not a pickle at all", "does not load as a state dict"),
])
def test_a_pickle_misusing_what_is_allowed_is_one_clear_error(tmp_path, pickled, says):
    path = hostile_file(tmp_path / "odd.pt", pickled)
    with pytest.raises(TensorFileError, match=says) as refused:
        read_torch_file(path)
    assert "\n" not in str(refused.value) and len(str(refused.value)) < 400


def test_a_tensor_reaching_past_its_storage_is_refused(tmp_path):
    buffer = io.BytesIO()
    torch.save({"w": torch.zeros(4)}, buffer)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as original:
        entries = {name: original.read(name) for name in original.namelist()}
    with zipfile.ZipFile(tmp_path / "short.pt", "w", zipfile.ZIP_STORED) as archive:
        for name, data in entries.items():
            archive.writestr(name, data[:8] if "/data/" in name else data)
    with pytest.raises(TensorFileError, match="missing or short"):
        read_torch_file(tmp_path / "short.pt")


def test_a_file_that_is_not_a_torch_save_archive_names_itself(tmp_path):
    (tmp_path / "notes.pt").write_text("just text")
    with zipfile.ZipFile(tmp_path / "other.pt", "w") as archive:
        archive.writestr("readme.txt", "a zip, not a checkpoint")
    for name in ("notes.pt", "other.pt"):
        with pytest.raises(TensorFileError, match=name):
            read_torch_file(tmp_path / name)


def test_push_and_pull_never_import_torch(tmp_path):
    torch.save(trained_state(), tmp_path / "in.pt")
    script = f"""
import os
import sys
from pathlib import Path
from slurm_geo.ckpt import LocalDirStore, Metadata, Repository
from slurm_geo.ckpt.files.pushpull import pull_tensor_file, push_tensor_file
root = Path({str(tmp_path)!r})
(root / "store").mkdir()
repository = Repository(LocalDirStore(root / "store"), os.urandom(32))
push_tensor_file(repository, root / "in.pt", "ft", Metadata(1, 1, 0, None, "", "", ""))
pull_tensor_file(repository, "ft", 1, root / "out.pt")
assert "torch" not in sys.modules, "torch was imported"
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert done.returncode == 0, done.stderr
    assert_same(torch.load(tmp_path / "out.pt", weights_only=True), trained_state())


def test_a_contiguous_tensor_reaches_the_writer_a_chunk_at_a_time(tmp_path):
    """Each chunk its own map, let go of once written: a 4 GB tensor is never resident."""
    from slurm_geo.ckpt.repo.repository import StreamedTensor

    weights = torch.randn(3000)
    torch.save({"w": weights, "t": torch.zeros(3, 2).t()}, tmp_path / "in.pt")
    streamed, gathered = read_torch_file(tmp_path / "in.pt").tensors

    assert isinstance(streamed, StreamedTensor) and len(streamed.data) == 12_000
    chunks = list(streamed.data.chunks(4096))
    assert [len(c) for c in chunks] == [4096, 4096, 3808]
    assert b"".join(chunks) == weights.numpy().tobytes()
    assert bytes(gathered.data) == bytes(24)  # a transposed view, gathered into a copy


def test_a_pull_never_writes_through_a_symlink_planted_at_its_partial_name(tmp_path,
                                                                            repository):
    torch.save({"w": torch.ones(3)}, tmp_path / "in.pt")
    push_tensor_file(repository, tmp_path / "in.pt", "ft", metadata(1))
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (tmp_path / "out.pt.partial").symlink_to(victim)

    pull_tensor_file(repository, "ft", 1, tmp_path / "out.pt")

    assert victim.read_text() == "keep me"
    assert torch.equal(torch.load(tmp_path / "out.pt", weights_only=True)["w"], torch.ones(3))
