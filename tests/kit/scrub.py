"""The scrub tests' site: run@10 and run@20 written into a home store and replicated and
verified offsite, with the checkpoints' tensors (test_sync_scrub.py and
test_sync_scrub_here.py)."""

from __future__ import annotations

import random
import threading
from pathlib import Path

from slurm_geo.ckpt import Metadata, Repository, Tensor
from slurm_geo.ckpt.format.manifest import with_bases
from slurm_geo.ckpt.stores.pacing import TokenBucket
from slurm_geo.sync.state import StateDB, Status
from slurm_geo.sync.worker import Attempt, Guard, Limits, Outcome, Route
from tests.kit.fence import KEY, repo

S = Status


def tensors(step: int) -> list[Tensor]:
    frozen = random.Random(7).randbytes(4 * 4096)  # shared by every step: the same packs
    moving = random.Random(step).randbytes(4096)
    return [Tensor("frozen", "uint8", (len(frozen),), frozen),
            Tensor("moving", "uint8", (len(moving),), moving)]


def save(repository: Repository, step: int, parent: int | None) -> None:
    repository.write_checkpoint("run", tensors(step), b"{}", Metadata(
        step, step, 0, None, "2026-12-04T12:00:00Z", "onprem", "1"), parent=parent)


class Site:
    """A root with run@10 and run@20 (sharing packs), both replicated and verified."""

    def __init__(self, tmp_path: Path):
        self.home_store, self.home = repo(tmp_path, "home")
        self.away_store, self.away = repo(tmp_path, "away")
        self.away_dir = tmp_path / "away"
        self.state_path = tmp_path / "sync.db"
        self.state = StateDB(self.state_path)
        save(self.home, 10, None)
        save(self.home, 20, 10)
        self.ids = self.state.add([{"root": "pfs", "run": "run", "step": step,
                                    "destination": "offsite", "sequence": i,
                                    "status": S.PENDING.value}
                                   for i, step in enumerate((10, 20))], now=0.0)
        for replica_id in self.ids:
            assert self.replicate(replica_id).outcome is Outcome.VERIFIED

    def attempt(self) -> Attempt:
        route = Route("pfs", self.home_store, "home", "offsite", self.away_store, "eu")
        return Attempt(self.state, KEY, route, Guard(threading.Event(), float("inf")),
                       TokenBucket(0), Limits(max_attempts=3), clock=lambda: 1000.0)

    def replicate(self, replica_id: int):
        """What the daemon does with a pending replica: start an attempt and run it."""
        self.state.move(replica_id, S.PENDING, S.UPLOADING, 500.0, attempts=("+", 1))
        return self.attempt().run(self.state.replica(replica_id))

    def shared_pack(self) -> str:
        manifests = [self.away.manifest("run", s) for s in (10, 20)]
        packs = [{m.pack_object(r.pack) for r in with_bases(m.refs())} for m in manifests]
        return sorted(packs[0] & packs[1])[0]

    def flip(self, name: str) -> None:
        path = self.away_dir / name
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
