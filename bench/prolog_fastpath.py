"""How long the node Prolog/Epilog take (target: a job without directives under 150 ms).

Run: python bench/prolog_fastpath.py [RUNS] [WRAPPER_DIR]. Runs each hook script as slurmd
runs it (a fresh process with the job's environment and nothing else) and prints medians:
a non-geo job (the fast path every job on the node pays), a geo job's first incarnation
(directory and marker) and its epilog. With WRAPPER_DIR (e.g. the sandbox's
onprem/etc), the installed wrappers `geo-prolog`/`geo-epilog` are timed as well.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from slurm_geo.site import HOOKS

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 0.150


def job_env(ckpt_dir: Path | None) -> dict[str, str]:
    env = {"SLURM_JOB_ID": "4711", "SLURM_CLUSTER_NAME": "bench", "SLURMD_NODENAME": "n1",
           "SLURM_JOB_RESTART_COUNT": "0", "SLURM_JOB_UID": str(os.getuid()),
           "SLURM_JOB_GID": str(os.getgid()), "SLURM_JOB_USER": "bench",
           "SLURM_SCRIPT_CONTEXT": "prolog_slurmd", "SLURM_GEO_CONFIG": "/nonexistent.toml",
           "SLURM_GEO_HOOK_LOG": os.devnull}
    if ckpt_dir is not None:
        env["SPANK_GEO_CKPT_DIR"] = str(ckpt_dir)
    return env


def median_seconds(argv: list[str], env: dict[str, str], runs: int) -> float:
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        subprocess.run(argv, env=env, check=True, capture_output=True)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 21
    wrappers = Path(sys.argv[2]) if len(sys.argv) > 2 else None
    hooks = HOOKS
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        rows = [
            ("python -c pass", [sys.executable, "-c", "pass"], job_env(None)),
            ("prolog, job without directives", [sys.executable, str(hooks / "prolog.py")],
             job_env(None)),
            ("epilog, job without directives", [sys.executable, str(hooks / "epilog.py")],
             job_env(None)),
            ("prolog, geo job (first incarnation)", [sys.executable, str(hooks / "prolog.py")],
             job_env(ckpt)),
            ("epilog, geo job", [sys.executable, str(hooks / "epilog.py")], job_env(ckpt)),
        ]
        if wrappers is not None:
            rows.insert(3, ("installed wrapper geo-prolog, job without directives",
                            [str(wrappers / "geo-prolog")], job_env(None)))
        results = [(name, median_seconds(argv, env, runs)) for name, argv, env in rows]
    width = max(len(name) for name, _ in results)
    for name, seconds in results:
        print(f"{name:<{width}}  {seconds * 1000:7.1f} ms")
    fast = max(s for name, s in results if "without directives" in name)
    print(f"target {TARGET_S * 1000:.0f} ms for jobs without directives: "
          f"{'met' if fast < TARGET_S else 'MISSED'} ({runs} runs each, medians)")


if __name__ == "__main__":
    main()
