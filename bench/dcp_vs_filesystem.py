"""slurm-geo's DCP StorageWriter/StorageReader next to DCP's own FileSystemWriter/Reader
(issue 15), side by side in one run, on the same state of the same ranks.

Run: python bench/dcp_vs_filesystem.py [--gb 1.0] [--quick] [--ranks 4] [--json PATH]
[--work DIR]. Four ranks (torch.multiprocessing.spawn, gloo) train fp32 models sharded
with FSDP2 `fully_shard` on CPU (bench/dcp_bench_ranks.py): (dense) residual GELU layers
of 2048 x 2048, AdamW on all of them, `--gb` GB of weights, exp_avg and exp_avg_sq;
(frozen) a frozen base of such layers holding `--gb` GB of weights and a small trainable
head with its AdamW state. Weights start gaussian (std 0.02) and take real AdamW steps
between saves. Every checkpoint is saved with `dcp.async_save` by both writers in turn
(the order alternating), FileSystemWriter with its defaults (sync_files=True,
thread_count=1) into a new directory per checkpoint, slurm-geo's into one store per
series (zstd byte planes, AES-GCM, deduplicated against the previous checkpoint); then
the last checkpoint is loaded by both readers in turn, from disk (its files evicted from
the page cache; best of 2) and from the page cache (best of 3). Prints Markdown for
docs/benchmarks.md (also written to bench/results/dcp_vs_filesystem.md) and exits 1 when a
target is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import dcp_bench_ranks
import torch
import torch.multiprocessing as mp
from dcp_bench_ranks import FS, OURS, Plan

from slurm_geo.ckpt.format.keys import create_master_key_file
from slurm_geo.ckpt.repo.writer import DEFAULT_OPTIONS

HERE = Path(__file__).resolve().parent
MB = 1e6
# The targets.
BLOCK_AT_MOST = 1.2  # our async_save block over FileSystemWriter's
DURABLE_SPEED_AT_LEAST = 1.0  # FileSystemWriter's time to durable over ours
STORED_AT_MOST = {"dense": 0.85, "frozen": 0.3}  # our bytes over FileSystemWriter's
LOAD_SPEED_AT_LEAST = 1.0  # FileSystemReader's load time over ours
RSS_EXTRA_BELOW = 512 * MB  # per rank, during our save
SERIES_TITLES = {"dense": "dense fp32 + AdamW", "frozen": "frozen base + head"}


@dataclass(frozen=True)
class Save:
    """One checkpoint saved by one writer, over all ranks."""

    series: str
    step: int
    writer: str
    block_s: float  # the slowest rank's: training goes on when every rank may
    durable_s: float
    cpu_s: float  # all ranks' processes together, from the call to durable
    rss_extra: int  # the largest rank's
    stored: int  # what the save added to the writer's directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0,
                        help="state of each series in GB (1e9 bytes; default 1.0)")
    parser.add_argument("--quick", action="store_true",
                        help="a small run (0.05 GB, 2 and 3 saves) to try the benchmark")
    parser.add_argument("--ranks", type=int, default=4,
                        help="processes (the issue's figures: 4, the default)")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    parser.add_argument("--work", type=Path, default=Path("/var/tmp"),
                        help="scratch directory, on a disk (not tmpfs); default /var/tmp")
    args = parser.parse_args()
    gb = 0.05 if args.quick else args.gb
    work = Path(tempfile.mkdtemp(prefix="dcp-bench-", dir=args.work))
    plan = Plan(work, work / "master.key", _free_port(), args.ranks, gb,
                dense_saves=2 if args.quick else 5, frozen_saves=3 if args.quick else 5,
                steps_between=1 if args.quick else 2)
    began, load_before = time.perf_counter(), os.getloadavg()
    try:
        create_master_key_file(plan.key_file)
        for series in ("dense", "frozen"):
            plan.store_dir(series).mkdir()
        mp.spawn(dcp_bench_ranks.rank_main, args=(plan,), nprocs=plan.ranks)
        ranks = [json.loads((work / f"rank-{r}.json").read_text())
                 for r in range(plan.ranks)]
        filesystem = _filesystem(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    saves, loads = combine_saves(ranks), combine_loads(ranks)
    checks = targets(saves, loads, gb * 1e9 / plan.ranks)
    text = render(plan, saves, loads, checks, time.perf_counter() - began, load_before,
                  filesystem)
    print(text)
    results = HERE / "results"
    results.mkdir(exist_ok=True)
    (results / "dcp_vs_filesystem.md").write_text(text)
    if args.json:
        args.json.write_text(json.dumps(
            {"commit": _commit(), "gb": gb, "ranks": ranks, "targets": checks}, indent=2))
    sys.exit(0 if all(c["met"] for c in checks) else 1)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _filesystem(path: Path) -> str:
    out = subprocess.run(["df", "--output=source,fstype,target", str(path)],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    return " ".join(out[-1].split())


def combine_saves(ranks: list[dict[str, Any]]) -> list[Save]:
    grouped = defaultdict(list)
    for rank in ranks:
        for record in rank["saves"]:
            grouped[record["series"], record["step"], record["writer"]].append(record)
    saves = []
    previous: dict[tuple[str, str], int] = defaultdict(int)
    for (series, step, writer), records in grouped.items():
        stored = max(r["stored"] for r in records)  # rank 0 measured it
        saves.append(Save(series, step, writer, max(r["block_s"] for r in records),
                          max(r["durable_s"] for r in records),
                          sum(r["cpu_s"] for r in records),
                          max(r["rss_extra"] for r in records),
                          stored - previous[series, writer]))
        previous[series, writer] = stored
    return saves


def combine_loads(ranks: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
    """(series, reader, cache) -> the try whose slowest rank was fastest: its time, all
    ranks' CPU seconds, and whether every rank restored every tensor exactly in every try."""
    tries: dict[tuple[str, str, str, int], list[dict[str, Any]]] = defaultdict(list)
    for rank in ranks:
        seen: dict[tuple[str, str, str], int] = defaultdict(int)
        for record in rank["loads"]:
            key = record["series"], record["reader"], record["cache"]
            tries[(*key, seen[key])].append(record)
            seen[key] += 1
    loads: dict[tuple[str, str, str], dict[str, Any]] = {}
    for (series, reader, cache, _attempt), records in tries.items():
        this = {"seconds": max(r["seconds"] for r in records),
                "cpu_s": sum(r["cpu_s"] for r in records),
                "restored": all(r["restored"] for r in records)}
        best = loads.get((series, reader, cache))
        if best is not None:
            this["restored"] = this["restored"] and best["restored"]
            if best["seconds"] <= this["seconds"]:
                this = {**best, "restored": this["restored"]}
        loads[series, reader, cache] = this
    return loads


def totals(saves: list[Save], series: str, writer: str, field: str) -> float:
    return sum(getattr(s, field) for s in saves if (s.series, s.writer) == (series, writer))


def targets(saves: list[Save], loads: dict[tuple[str, str, str], dict[str, Any]],
            per_rank: float) -> list[dict[str, Any]]:
    checks = []

    def check(name: str, value: float, met: bool, note: str = "") -> None:
        checks.append({"target": name, "value": value, "met": bool(met), "note": note})

    for series, title in SERIES_TITLES.items():
        block = (totals(saves, series, OURS, "block_s")
                 / totals(saves, series, FS, "block_s"))
        check(f"(a) {title}: async_save block ≤ {BLOCK_AT_MOST}× FileSystemWriter's", block,
              block <= BLOCK_AT_MOST, "ours / theirs, summed over the series")
        durable = (totals(saves, series, FS, "durable_s")
                   / totals(saves, series, OURS, "durable_s"))
        check(f"(b) {title}: time to durable, speed ≥ {DURABLE_SPEED_AT_LEAST}× "
              "FileSystemWriter's", durable, durable >= DURABLE_SPEED_AT_LEAST,
              "their time / ours, summed over the series")
        stored = totals(saves, series, OURS, "stored") / totals(saves, series, FS, "stored")
        count = sum(1 for s in saves if (s.series, s.writer) == (series, OURS))
        check(f"(c) {title}: bytes stored ≤ {STORED_AT_MOST[series]}× FileSystemWriter's",
              stored, stored <= STORED_AT_MOST[series], f"all {count} checkpoints")
        for cache in ("cold", "warm"):
            ours, theirs = loads[series, OURS, cache], loads[series, FS, cache]
            speed = theirs["seconds"] / ours["seconds"]
            check(f"(d) {title}: load ({cache} page cache) ≥ {LOAD_SPEED_AT_LEAST}× "
                  "FileSystemReader's speed", speed,
                  speed >= LOAD_SPEED_AT_LEAST and ours["restored"] and theirs["restored"],
                  "their time / ours; every tensor restored exactly: "
                  f"{'yes' if ours['restored'] and theirs['restored'] else '**no**'}")
    peak = max(s.rss_extra for s in saves if s.writer == OURS)
    theirs = max(s.rss_extra for s in saves if s.writer == FS)
    check(f"(e) peak extra RSS per rank during our save < {RSS_EXTRA_BELOW / MB:.0f} MB",
          peak / MB, peak < RSS_EXTRA_BELOW,
          f"MB, largest rank and save; includes DCP's staged copy of the rank's state (up to "
          f"{per_rank / MB:.0f} MB); FileSystemWriter's: {theirs / MB:.0f} MB")
    return checks


Row = list[str]


def table(header: Row, rows: list[Row]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def render(plan: Plan, saves: list[Save], loads: dict[tuple[str, str, str], dict[str, Any]],
           checks: list[dict[str, Any]], seconds: float, load_before: tuple[float, ...],
           filesystem: str) -> str:
    out = [environment(plan, seconds, load_before, filesystem), "", "### Saves", ""]
    by_step = {(s.series, s.step, s.writer): s for s in saves}
    rows = []
    for series, title in SERIES_TITLES.items():
        steps = sorted({s.step for s in saves if s.series == series})
        for step in steps:
            ours, theirs = by_step[series, step, OURS], by_step[series, step, FS]
            rows.append([
                title if step == steps[0] else "", str(step),
                f"{ours.block_s:.3f} / {theirs.block_s:.3f} s",
                f"{ours.durable_s:.2f} / {theirs.durable_s:.2f} s",
                f"{theirs.durable_s / ours.durable_s:.2f}×",
                f"{ours.cpu_s:.1f} / {theirs.cpu_s:.1f}",
                f"{ours.stored / MB:.0f} / {theirs.stored / MB:.0f} MB",
                f"{ours.stored / theirs.stored:.3f}×",
                f"{ours.rss_extra / MB:.0f} / {theirs.rss_extra / MB:.0f} MB"])
    out.append(table(["series", "step", "block ours / FS", "durable ours / FS",
                      "durable speed ×", "CPU-s ours / FS", "stored ours / FS", "stored ×",
                      "peak extra RSS ours / FS"], rows))
    out += ["", "### Loads of the last checkpoint (slowest rank)", "", table(
        ["series", "page cache", "load ours", "load FS", "speed ×", "CPU-s ours / FS",
         "restored exactly"],
        [[SERIES_TITLES[series], cache, f"{ours['seconds']:.2f} s", f"{theirs['seconds']:.2f} s",
          f"{theirs['seconds'] / ours['seconds']:.2f}×",
          f"{ours['cpu_s']:.1f} / {theirs['cpu_s']:.1f}",
          "yes" if ours["restored"] and theirs["restored"] else "**no**"]
         for series in SERIES_TITLES for cache in ("cold", "warm")
         for ours, theirs in [(loads[series, OURS, cache], loads[series, FS, cache])]])]
    out += ["", "### Targets", "", table(
        ["target", "measured", "", "note"],
        [[c["target"], f"{c['value']:.3g}", "met" if c["met"] else "**not met**", c["note"]]
         for c in checks])]
    return "\n".join(out) + "\n"


def environment(plan: Plan, seconds: float, load_before: tuple[float, ...],
                filesystem: str) -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return (f"Measured at commit {_commit()}, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, in "
            f"{seconds:.0f} s on {os.cpu_count()} cores ({cpu}), Python "
            f"{platform.python_version()}, torch {torch.__version__}; {plan.ranks} ranks "
            f"(gloo, FSDP2 on CPU), {plan.gb:g} GB of state per series, "
            f"{plan.steps_between} AdamW steps before each save; stores on {filesystem}; "
            "CPU-s: user + system seconds of all ranks' processes; "
            f"our writers use {DEFAULT_OPTIONS.threads} threads a rank. Load average "
            f"before/after: {load_before[0]:.2f}/{os.getloadavg()[0]:.2f}.")


def _commit() -> str:
    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], cwd=HERE, capture_output=True, text=True,
                              check=True).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + (
        " (uncommitted changes)" if git("status", "--porcelain", "--", "..") else "")


if __name__ == "__main__":
    main()
