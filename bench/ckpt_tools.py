"""Helpers for bench/ckpt_vs_restic.py: restic, sizes, torch-to-ckpt tensors, stage speeds."""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from slurm_geo.ckpt import LocalDirStore, Tensor
from slurm_geo.ckpt.format.codec import Compressors, encode_parts, encode_plane, split_planes
from slurm_geo.ckpt.format.keys import RunKeys, chunk_id
from slurm_geo.ckpt.format.manifest import FORMAT_VERSION
from slurm_geo.ckpt.format.pack import PackWriter, pack_id_of

MB = 1e6


def tree_bytes(root: Path) -> int:
    """Bytes in the files under `root` (what a store holds), temporary files included."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def timed(action: Callable[[], object]) -> float:
    began = time.perf_counter()
    action()
    return time.perf_counter() - began


@dataclass(frozen=True)
class Cost:
    """Wall-clock seconds and CPU seconds (user + system, all threads) of one action."""

    wall: float
    cpu: float


def cost_here(action: Callable[[], object]) -> Cost:
    """The cost of `action` run in this process (nothing else runs here meanwhile)."""
    cpu, began = time.process_time(), time.perf_counter()
    action()
    return Cost(time.perf_counter() - began, time.process_time() - cpu)


def cost_of_child(argv: list[str], env: dict[str, str]) -> Cost:
    """The cost of a command, its CPU time from the kernel's accounting of children."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    subprocess.run(argv, env=env, check=True, capture_output=True)
    wall = time.perf_counter() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Cost(wall, cpu)


def cheapest(costs: list[Cost]) -> Cost:
    return min(costs, key=lambda c: c.wall)


class Stopwatch:
    """`with Stopwatch() as watch: ...`, then `watch.seconds`."""

    seconds = 0.0

    def __enter__(self) -> Stopwatch:
        self._began = time.perf_counter()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.seconds = time.perf_counter() - self._began


def ckpt_tensors(state: dict) -> list[Tensor]:
    """Views of CPU tensors' bytes as checkpoint tensors (no copies)."""
    import torch

    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
             torch.int64: "int64", torch.float64: "float64"}
    out = []
    for path, tensor in state.items():
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        out.append(Tensor(path, names[tensor.dtype], tuple(tensor.shape), flat.numpy().data))
    return out


class Restic:
    """One restic repository in a local directory; every command timed as a whole."""

    def __init__(self, repo: Path, cache: Path):
        self.repo = repo
        self.env = {**os.environ, "RESTIC_PASSWORD": "bench", "RESTIC_REPOSITORY": str(repo),
                    "RESTIC_CACHE_DIR": str(cache)}
        self._run("init")

    def backup(self, path: Path) -> Cost:
        return self._run("backup", str(path))

    def restore_verified(self, target: Path, snapshot: str = "latest") -> Cost:
        """`restic restore --verify`: restore, then re-read and check every restored blob."""
        return self._run("restore", snapshot, "--target", str(target), "--verify")

    def snapshot_ids(self) -> list[str]:
        """Ids of the repository's snapshots, oldest first."""
        out = subprocess.run(["restic", "--quiet", "snapshots", "--json"], env=self.env,
                             check=True, capture_output=True, text=True)
        return [snap["id"] for snap in sorted(json.loads(out.stdout), key=lambda x: x["time"])]

    def _run(self, *argv: str) -> Cost:
        return cost_of_child(["restic", "--quiet", *argv], self.env)


def restic_version() -> str:
    out = subprocess.run(["restic", "version"], capture_output=True, text=True, check=True)
    return out.stdout.split(" compiled")[0]


@dataclass(frozen=True)
class StageSpeeds:
    """Single-threaded MB/s of each stage, per MB of chunk plaintext."""

    keyed_hash: float
    plane_split: float
    zstd: float
    aes_gcm: float
    pack_hash: float
    store_put: float

    BRIEF = ("keyed_hash", "plane_split", "zstd", "aes_gcm")  # the four the issue names
    LABELS = {"keyed_hash": "keyed hash (BLAKE3)", "plane_split": "byte-plane split",
              "zstd": "zstd (planes, incl. sampling)", "aes_gcm": "AES-256-GCM into the pack",
              "pack_hash": "pack hash (BLAKE3, its name)",
              "store_put": "store put: write + fsync of 16 MiB packs"}

    def named(self) -> dict[str, float]:
        return {label: getattr(self, key) for key, label in self.LABELS.items()}

    def serial(self, keys: tuple[str, ...]) -> float:
        """One core doing these stages in turn: the harmonic combination."""
        return 1 / sum(1 / getattr(self, key) for key in keys)


def stage_speeds(chunks: list[memoryview], element_size: int, scratch: Path,
                 repeats: int = 3) -> StageSpeeds:
    """Each stage over the same chunks, one thread, median of `repeats` passes."""
    keys = RunKeys(bytes(32))
    compressors = Compressors()
    planes = [split_planes(bytes(c), element_size) for c in chunks]
    blobs = [b"".join(encode_parts(c, element_size=element_size, compressors=compressors))
             for c in chunks]
    total = sum(len(c) for c in chunks)

    def speed(work: Callable[[], object]) -> float:
        return total / MB / statistics.median(timed(work) for _ in range(repeats))

    def compress_planes() -> None:
        for chunk_planes in planes:
            for plane in chunk_planes:
                encode_plane(plane, compressors)  # sample probe, then zstd or raw

    buffer = bytearray()

    def seal() -> None:  # into a reused pack buffer, as the writer does
        pack = PackWriter(bytes(32), bytes(16), buffer)
        for i, blob in enumerate(blobs):
            pack.add(i.to_bytes(32, "big"), blob)
        pack.release().release()

    packs = []
    for first in range(0, len(blobs), 4):
        pack = PackWriter(bytes(32), bytes(16))
        for i, blob in enumerate(blobs[first:first + 4], first):
            pack.add(i.to_bytes(32, "big"), blob)
        packs.append(pack.finish()[1])

    def put() -> None:
        store_dir = Path(tempfile.mkdtemp(dir=scratch))
        store = LocalDirStore(store_dir)
        for i, pack in enumerate(packs):
            store.put(f"packs/{i:02x}/{i:064x}", pack)
        shutil.rmtree(store_dir)

    copies = [bytes(c) for c in chunks]
    return StageSpeeds(
        keyed_hash=speed(lambda: [chunk_id(keys.id_key, c, FORMAT_VERSION) for c in chunks]),
        plane_split=speed(lambda: [split_planes(c, element_size) for c in copies]),
        zstd=speed(compress_planes),
        aes_gcm=speed(seal),
        pack_hash=speed(lambda: [pack_id_of(p) for p in packs]),
        store_put=speed(put),
    )
