"""The checkpoint layer's progress callbacks: `on_bytes(done, total)` climbs to a total
known up front and ends there, for writes, copies, verification, torch-file pulls and the
store-wide check."""

from __future__ import annotations

import random
from pathlib import Path

from slurm_geo.ckpt import LocalDirStore, Repository, Tensor
from slurm_geo.ckpt.files.pushpull import pull_tensor_file, push_tensor_file
from slurm_geo.ckpt.files.skeleton import encode_skeleton
from slurm_geo.ckpt.ops.check import READ_ALL, check_store
from slurm_geo.ckpt.ops.replicate import copy_checkpoint, pack_extents
from tests.helpers import pack_files
from tests.kit.check import OPTIONS, metadata, site_store, weights

KEY = bytes(range(32))


class Calls(list):
    def __call__(self, done: int, total: int) -> None:
        self.append((done, total))

    def climbs_to(self, total: int) -> bool:
        """Never back, never past the end, and ending at `total`."""
        dones = [done for done, _ in self]
        return dones == sorted(dones) and self[-1] == (total, total) and \
            all(done <= t for done, t in self)


def pack_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in pack_files(root))


def two_steps(root: Path) -> Repository:
    root.mkdir()
    repository = Repository(LocalDirStore(root), KEY, OPTIONS)
    for step in (1, 2):
        repository.write_checkpoint("r", weights(step, 8), b"{}", metadata(step),
                                    parent=step - 1 or None, unchanged={"frozen"})
    return repository


def test_a_write_reports_every_tensor_byte_frozen_ones_at_once(tmp_path):
    repository = two_steps(tmp_path / "store")
    calls = Calls()
    tensors = weights(3, 8)
    repository.write_checkpoint("r", tensors, b"{}", metadata(3), parent=2,
                                unchanged={"frozen"}, on_bytes=calls)
    total = sum(len(t.data) for t in tensors)
    assert calls.climbs_to(total)
    assert len(calls) == 3 + 1  # the first tensor's three chunks, then the frozen one whole


def test_a_copy_ends_at_the_bytes_it_sent_and_counts_packs_already_there(tmp_path):
    repository = two_steps(tmp_path / "store")
    (tmp_path / "offsite").mkdir()
    offsite = LocalDirStore(tmp_path / "offsite")
    first = Calls()
    report = copy_checkpoint(repository, repository.store, offsite, "r", 1, on_bytes=first)
    assert first.climbs_to(report.bytes_copied) and report.bytes_copied == pack_bytes(
        tmp_path / "offsite")
    extents = pack_extents(repository.manifest("r", 2))
    there = {name: size for name, size in extents.items() if offsite.exists(name)}
    assert there and len(there) < len(extents)  # step 2 reads some of step 1's packs
    second = Calls()
    report = copy_checkpoint(repository, repository.store, offsite, "r", 2, on_bytes=second)
    # Packs already there count as done at their extent; the others at their size.
    assert second.climbs_to(report.bytes_copied + sum(there.values()))


def test_verify_reports_the_bytes_of_every_chunk(tmp_path):
    repository = two_steps(tmp_path / "store")
    calls = Calls()
    assert repository.verify("r", 2, on_bytes=calls) == []
    assert calls.climbs_to(sum(ref.size for ref in repository.manifest("r", 2).refs()))


def test_a_torch_file_pull_and_push_report_the_tensor_bytes(tmp_path):
    (tmp_path / "store").mkdir()
    repository = Repository(LocalDirStore(tmp_path / "store"), KEY, OPTIONS)
    data = random.Random(1).randbytes(5 * 4096 + 10)
    _, skeleton = encode_skeleton({"w": data}, lambda value: value is data)
    repository.write_checkpoint("r", [Tensor("w", "uint8", (len(data),), data)], skeleton,
                                metadata(1))
    pulled = Calls()
    pull_tensor_file(repository, "r", 1, tmp_path / "w.pt", on_bytes=pulled)
    assert pulled.climbs_to(len(data)) and len(pulled) == 6
    pushed = Calls()
    _, nbytes = push_tensor_file(repository, tmp_path / "w.pt", "r", metadata(2),
                                 on_bytes=pushed)
    assert nbytes == len(data) and pushed.climbs_to(len(data))


def test_the_check_reports_manifests_then_the_bytes_of_the_packs_it_reads(tmp_path):
    store, _ = site_store(tmp_path / "site")
    manifests, read = Calls(), Calls()
    report = check_store(store, KEY, READ_ALL, on_manifests=manifests, on_bytes=read)
    assert report.ok and manifests.climbs_to(report.checkpoints)
    assert len(manifests) == 4  # run by run: three runs and the multi-rank one
    assert read.climbs_to(pack_bytes(tmp_path / "site")) and len(read) == report.packs_read
    structure = Calls()
    check_store(store, KEY, None, on_bytes=structure)
    assert structure == []  # no pack read, no bytes
