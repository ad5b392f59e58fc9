"""How long `slurm-geo --help` takes, next to a bare Python start (target: under 0.3 s).

Run: python bench/cli_startup.py [RUNS]. Prints medians and their ratio.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time


def median_seconds(argv: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 21
    bare = median_seconds([sys.executable, "-c", "pass"], runs)
    cli = median_seconds([sys.executable, "-m", "slurm_geo", "--help"], runs)
    sub = median_seconds([sys.executable, "-m", "slurm_geo", "sandbox", "--help"], runs)
    print(f"python -c pass            {bare * 1000:7.1f} ms")
    print(f"slurm-geo --help          {cli * 1000:7.1f} ms  ({cli / bare:.1f}x bare python)")
    print(f"slurm-geo sandbox --help  {sub * 1000:7.1f} ms  ({sub / bare:.1f}x bare python)")
    print(f"target 300 ms: {'met' if max(cli, sub) < 0.3 else 'MISSED'}")


if __name__ == "__main__":
    main()
