"""Push a large checkpoint from a file on disk and report peak memory (a child process).

Run: python bench/ckpt_stream_push.py FILE STORE_DIR TENSORS. FILE holds TENSORS equal
float32 tensors back to back. Each tensor is a numpy memmap made when the writer reaches
it and unmapped once its chunks are through the pipeline, the way a push of a saved
checkpoint streams: nothing but the tensor being read, a few chunks in flight and a few
16 MiB packs is ever in memory. Prints one JSON line: seconds, bytes, and peak memory from
/proc/self/status (VmHWM: peak resident set, file pages of the mapped tensors included;
peak RssAnon, sampled every 20 ms: the process's own memory).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import overload

import numpy

from slurm_geo.ckpt import LocalDirStore, Metadata, Repository, Tensor


class MappedTensors(Sequence[Tensor]):
    """Tensors of a file, each mapped only while someone holds it."""

    def __init__(self, path: Path, count: int):
        self.path, self.tensors = path, count
        self.nbytes = path.stat().st_size // count

    def __len__(self) -> int:
        return self.tensors

    @overload
    def __getitem__(self, index: int) -> Tensor: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Tensor]: ...

    def __getitem__(self, index: int | slice) -> Tensor | Sequence[Tensor]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.tensors))]
        if not 0 <= index < self.tensors:
            raise IndexError(index)
        mapped = numpy.memmap(self.path, dtype=numpy.uint8, mode="r",
                              offset=index * self.nbytes, shape=(self.nbytes,))
        return Tensor(f"layers.{index}.weight", "float32", (self.nbytes // 4,), mapped.data)


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class AnonPeak(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak_kib = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.02):
            self.peak_kib = max(self.peak_kib, status_kib("RssAnon"))


def main() -> None:
    path, store_dir, count = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    repo = Repository(LocalDirStore(store_dir), os.urandom(32))
    tensors = MappedTensors(path, count)
    metadata = Metadata(1, 1, 0, None, datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                        "bench", "0")
    sampler = AnonPeak()
    sampler.start()
    began = time.perf_counter()
    repo.write_checkpoint("big", tensors, b"", metadata)
    seconds = time.perf_counter() - began
    sampler.stop.set()
    sampler.join()
    print(json.dumps({"seconds": seconds, "bytes": tensors.nbytes * count,
                      "vm_hwm_kib": status_kib("VmHWM"), "rss_anon_peak_kib": sampler.peak_kib}))


if __name__ == "__main__":
    main()
