"""Time `slurm-geo sandbox up` on a fresh directory, then again (idempotent), then `down`.

Target: a fresh `up` under 60 s on 2 cores once packages are installed.
Run as root: python bench/sandbox_up.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(f"/var/tmp/slurm-geo-bench-{os.getpid()}")
PORT_BASE = "19800"


def timed(*args: str) -> float:
    began = time.perf_counter()
    subprocess.run([sys.executable, "-m", "slurm_geo", "sandbox", *args, "--dir", str(ROOT)],
                   check=True, capture_output=True)
    return time.perf_counter() - began


def main() -> None:
    try:
        fresh = timed("up", "--port-base", PORT_BASE)
        again = timed("up")
        down = timed("down")
        restart = timed("up")
        timed("down")
    finally:
        shutil.rmtree(ROOT, ignore_errors=True)
    print(f"fresh up (MariaDB init, slurmdbd schema)  {fresh:6.1f} s")
    print(f"second up (all running: no-op)           {again:6.1f} s")
    print(f"down                                      {down:6.1f} s")
    print(f"up after down (state kept)                {restart:6.1f} s")
    print(f"target 60 s: {'met' if fresh < 60 else 'MISSED'}")


if __name__ == "__main__":
    main()
