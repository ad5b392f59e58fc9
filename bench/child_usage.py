"""Run a command and print its own cost as one JSON line (for bench/cli_vs_restic.py).

Run: python bench/child_usage.py [--sample] ARGV... -> {"wall", "cpu", "max_rss",
"anon_peak", "returncode"}; the command's output goes to this one's stderr.

Why a process of its own: Linux carries the peak RSS of the process that spawns a command
into the command's ru_maxrss (exec records the old memory's high-water mark, and a vfork
child's old memory is its parent's), so a command started by a benchmark holding torch and
a checkpoint would report the benchmark's size. Started from this small process it reports
its own. Only the standard library is imported here, to stay small.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path


class AnonSampler:
    """The peak of a process's RssAnon (its own memory, mapped file pages left out)."""

    def __init__(self, pid: int):
        self._status, self._done, self.peak = Path(f"/proc/{pid}/status"), False, 0
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._done:
            try:
                lines = self._status.read_text().splitlines()
            except OSError:
                return
            for line in lines:
                if line.startswith("RssAnon:"):
                    self.peak = max(self.peak, int(line.split()[1]) * 1024)
            time.sleep(0.02)

    def stop(self) -> int:
        self._done = True
        self._thread.join()
        return self.peak


def main() -> None:
    sample = sys.argv[1] == "--sample"
    argv = sys.argv[2:] if sample else sys.argv[1:]
    began = time.perf_counter()
    process = subprocess.Popen(argv, stdout=sys.stderr, stderr=sys.stderr)
    anon = AnonSampler(process.pid) if sample else None
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - began
    print(json.dumps({"wall": wall, "cpu": usage.ru_utime + usage.ru_stime,
                      "max_rss": usage.ru_maxrss * 1024, "anon_peak": anon.stop() if anon else 0,
                      "returncode": os.waitstatus_to_exitcode(status)}))


if __name__ == "__main__":
    main()
