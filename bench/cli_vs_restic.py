"""The commands a user types, next to restic's, process start included, in one run.

Run: python bench/cli_vs_restic.py [--size-mb 300] [--rss-gb 4] [--steps 3] [--json]
[--work DIR]. Two series of torch checkpoints nobody has seen before (the models are built
from a seed taken from the clock, printed): (dense) an fp32 MLP trained with AdamW, whose
parameters and two moments make --size-mb, one optimizer step between saves so every
value changes; (frozen) a frozen fp32 base of --size-mb (requires_grad False, not in the
optimizer) under a small trained head, so later steps change little. Each step is
torch.save'd to a file (not timed), then, each as its own process and timed wall clock
from start to exit:

  restic backup FILE                     python -m slurm_geo ckpt push FILE --run R --step N
  restic restore SNAPSHOT --target DIR   python -m slurm_geo ckpt pull R@N --to FILE.pt
  restic check --read-data               python -m slurm_geo ckpt check --read-data

into one restic repository and one slurm-geo store, both local directories on the same
filesystem as the files. Page cache: both tools read a file just written (still cached);
os.sync() before every command so neither pays for the other's writeback; neither's
restored files are synced inside its timing; the two take turns going first
(`in_turn`). Last, with --rss-gb: push and pull of a checkpoint that large, peak RSS of
each process (ru_maxrss from wait4) and its peak anonymous memory (RssAnon, sampled).
Prints markdown (or JSON with --json), also written to bench/results/cli_vs_restic.{md,json}.
"""

from __future__ import annotations

import argparse
import compileall
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import torch
from ckpt_tools import MB, Restic, restic_version, tree_bytes
from torch import nn

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent  # the checkout whose slurm_geo the commands run
DENSE_LAYERS, FROZEN_LAYERS, HEAD_WIDTH, BATCH = 6, 18, 64, 32
TARGETS = {"push_dense": 3.0, "push_frozen_later": 10.0, "pull": 2.0, "check": 2.0}
RSS_TARGET = 300 * MB


@dataclass(frozen=True)
class Child:
    """One command: wall seconds start to exit, CPU seconds, peak RSS and anonymous bytes."""

    wall: float
    cpu: float
    max_rss: int
    anon_peak: int  # sampled every 20 ms; 0 when not sampled


def run_child(argv: list[str], env: dict[str, str], sample: bool = False) -> Child:
    """Run `argv` to completion through bench/child_usage.py, for its own peak RSS."""
    launcher = [sys.executable, str(HERE / "child_usage.py"), *(["--sample"] if sample else [])]
    with tempfile.TemporaryFile() as output:
        done = subprocess.run([*launcher, *argv], env=env, stdout=subprocess.PIPE,
                              stderr=output, text=True, check=True)
        usage = json.loads(done.stdout)
        if usage.pop("returncode") != 0:
            output.seek(0)
            tail = output.read().decode(errors="replace")[-3000:]
            raise SystemExit(f"{' '.join(argv)}: failed\n{tail}")
    return Child(**usage)


class SlurmGeo:
    """The slurm-geo CLI of this checkout, with one master key."""

    def __init__(self, work: Path):
        # Bytecode as an installed package has it (pip compiles at install): where
        # PYTHONDONTWRITEBYTECODE is set, as on the development VMs, each command of a
        # checkout would otherwise compile every module it imports, 40 ms and more.
        compileall.compile_dir(ROOT / "slurm_geo", quiet=1)
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        self.env = {**os.environ, "PYTHONPATH": path}
        self.key = work / "master.key"
        self._run("keys", "init", str(self.key))

    def push(self, path: Path, store: str, run: str, step: int, sample: bool = False) -> Child:
        return self._run("ckpt", "push", str(path), "--to", store, "--run", run, "--step",
                         str(step), "--key-file", str(self.key), sample=sample)

    def pull(self, store: str, run: str, step: int, to: Path, sample: bool = False) -> Child:
        return self._run("ckpt", "pull", f"{run}@{step}", "--from", store, "--to", str(to),
                         "--key-file", str(self.key), sample=sample)

    def check(self, store: str) -> Child:
        return self._run("ckpt", "check", "--store", store, "--read-data", "--key-file",
                         str(self.key))

    def _run(self, *argv: str, sample: bool = False) -> Child:
        return run_child([sys.executable, "-m", "slurm_geo", *argv], self.env, sample)


class TimedRestic(Restic):
    """ckpt_tools.Restic, each command as a Child."""

    def _run(self, *argv: str) -> Child:  # type: ignore[override]
        return run_child(["restic", "--quiet", *argv], self.env)

    def restore(self, snapshot: str, target: Path) -> Child:
        return self._run("restore", snapshot, "--target", str(target))

    def check_read_data(self) -> Child:
        return self._run("check", "--read-data")


def _width(params: float, layers: int) -> int:
    """Square layers of a width (a multiple of 64) that hold `params` parameters in all."""
    return max(64, round(math.sqrt(params / layers) / 64) * 64)


def dense_series(nbytes: float, steps: int, seed: int) -> Iterator[dict]:
    """fp32 weights and AdamW's exp_avg and exp_avg_sq: 12 bytes a parameter."""
    torch.manual_seed(seed)
    width = _width(nbytes / 12, DENSE_LAYERS)
    model = nn.Sequential(*[m for _ in range(DENSE_LAYERS)
                            for m in (nn.Linear(width, width), nn.Tanh())])
    yield from _train(model, torch.optim.AdamW(model.parameters(), lr=1e-3), steps, width)


def frozen_series(nbytes: float, steps: int, seed: int) -> Iterator[dict]:
    """A frozen fp32 base (4 bytes a parameter) and a trained bottleneck head."""
    torch.manual_seed(seed + 1)
    width = _width(nbytes / 4, FROZEN_LAYERS)
    base = [nn.Linear(width, width) for _ in range(FROZEN_LAYERS)]
    for layer in base:
        nn.init.normal_(layer.weight, std=0.02)  # like a pretrained model's
        layer.requires_grad_(False)
    head = nn.Sequential(nn.Linear(width, HEAD_WIDTH), nn.Linear(HEAD_WIDTH, width))
    model = nn.Sequential(*base, head)
    yield from _train(model, torch.optim.AdamW(head.parameters(), lr=1e-3), steps, width)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int,
           width: int) -> Iterator[dict]:
    for step in range(1, steps + 1):
        model(torch.randn(BATCH, width)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        yield {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}


def tensors_of(state: object) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for value in state.values() for t in tensors_of(value)]
    if isinstance(state, list | tuple):
        return [t for value in state for t in tensors_of(value)]
    return []


def changed_fraction(before: list[torch.Tensor], after: list[torch.Tensor]) -> float:
    """Of the state's bytes, the share in values that differ from the previous step's."""
    total = sum(t.numel() * t.element_size() for t in after)
    changed = sum(int((a != b).sum()) * a.element_size()
                  for a, b in zip(before, after, strict=True))
    return changed / total


def in_turn(turn: int, ours: Callable[[], Child], theirs: Callable[[], Child]
            ) -> tuple[Child, Child]:
    """Both commands, each after os.sync(), restic's first on odd turns and ours on even
    ones. The second of two commands paid for the first on the 2-core VM: a pull run right
    after a restore took a median 0.80 s, run first 0.54 s (restic's restore: 1.43 s
    second, 1.38 s first; four of each), so a fixed order would favour one tool."""
    results: dict[str, Child] = {}
    for name, command in ([("theirs", theirs), ("ours", ours)] if turn % 2 else
                          [("ours", ours), ("theirs", theirs)]):
        os.sync()
        results[name] = command()
    return results["ours"], results["theirs"]


def stored_by(repo: Path, name: str, stored: dict[str, int], command: Callable[[], Child]
              ) -> Child:
    """Run `command`, recording in `stored[name]` the bytes it added to `repo`."""
    before = tree_bytes(repo)
    done = command()
    stored[name] = tree_bytes(repo) - before
    return done


def push_series(name: str, series: Iterator[dict], work: Path, geo: SlurmGeo, store: Path,
                restic: TimedRestic) -> list[dict]:
    source = work / name
    source.mkdir()
    path = source / "checkpoint.pt"
    rows: list[dict] = []
    previous: list[torch.Tensor] = []
    for state in series:
        tensors = tensors_of(state)
        changed = changed_fraction(previous, tensors) if previous else 1.0
        previous = [t.clone() for t in tensors]
        torch.save(state, path)
        stored: dict[str, int] = {}
        ours, theirs = in_turn(
            state["step"],
            partial(stored_by, store, "ours", stored,
                    partial(geo.push, path, f"file://{store}", name, state["step"])),
            partial(stored_by, restic.repo, "restic", stored, partial(restic.backup, path)))
        rows.append({"series": name, "step": state["step"], "file": path.stat().st_size,
                     "changed": changed, "ours": asdict(ours), "restic": asdict(theirs),
                     "ours_stored": stored["ours"], "restic_stored": stored["restic"]})
    path.unlink()
    return rows


def pull_all(pushes: list[dict], work: Path, geo: SlurmGeo, store: Path,
             restic: TimedRestic) -> list[dict]:
    """Every step back by both tools; the last of each series compared tensor by tensor."""
    snapshots = restic.snapshot_ids()  # oldest first: the pushes' order
    last = {r["series"]: r["step"] for r in pushes}
    rows = []
    for push, snapshot in zip(pushes, snapshots, strict=True):
        target, pulled = work / "restored", work / "pulled.pt"
        ours, theirs = in_turn(
            len(rows), partial(geo.pull, f"file://{store}", push["series"], push["step"], pulled),
            partial(restic.restore, snapshot, target))
        restored = next(target.rglob("checkpoint.pt"))
        compared = last[push["series"]] == push["step"]
        if compared:
            _assert_same(restored, pulled)
        rows.append({"series": push["series"], "step": push["step"], "ours": asdict(ours),
                     "restic": asdict(theirs), "compared": compared})
        shutil.rmtree(target)
        pulled.unlink()
    return rows


def _assert_same(expected: Path, pulled: Path) -> None:
    mine = tensors_of(torch.load(pulled, weights_only=True))
    theirs = tensors_of(torch.load(expected, weights_only=True))
    if len(mine) != len(theirs) or not all(
            a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(mine, theirs, strict=True)):
        raise SystemExit(f"{pulled} differs from restic's restore of the same step")


def rss(work: Path, geo: SlurmGeo, gb: float, seed: int, tensors: int = 32) -> dict:
    """Push then pull a checkpoint of `gb` GiB of fp32 tensors, each command sampled."""
    path, store, back = work / "big.pt", work / "big-store", work / "big-back.pt"
    store.mkdir()
    generator = torch.Generator().manual_seed(seed + 2)
    count = int(gb * 2**30) // tensors // 4
    torch.save({"model": {f"layers.{i}.weight": torch.randn(count, generator=generator)
                          for i in range(tensors)}, "step": 1}, path)
    os.sync()
    push = geo.push(path, f"file://{store}", "big", 1, sample=True)
    os.sync()
    pull = geo.pull(f"file://{store}", "big", 1, back, sample=True)
    result = {"file": path.stat().st_size, "stored": tree_bytes(store), "push": asdict(push),
              "pull": asdict(pull), "pulled_file": back.stat().st_size}
    for done in (path, back):
        done.unlink()
    shutil.rmtree(store)
    return result


def measure(work: Path, size_mb: float, steps: int, rss_gb: float, seed: int) -> dict:
    geo = SlurmGeo(work)
    store = work / "store"
    store.mkdir()
    restic = TimedRestic(work / "restic", work / "restic-cache")
    nbytes = size_mb * MB
    pushes = [*push_series("dense", dense_series(nbytes, steps, seed), work, geo, store, restic),
              *push_series("frozen", frozen_series(nbytes, steps, seed), work, geo, store,
                           restic)]
    pulls = pull_all(pushes, work, geo, store, restic)
    os.sync()
    check = {"ours": asdict(geo.check(f"file://{store}")),
             "restic": asdict(restic.check_read_data()),
             "ours_store": tree_bytes(store), "restic_repo": tree_bytes(restic.repo)}
    shutil.rmtree(store)
    shutil.rmtree(restic.repo)
    return {"pushes": pushes, "pulls": pulls, "check": check,
            "rss": rss(work, geo, rss_gb, seed) if rss_gb > 0 else None}


def speedup(rows: list[dict]) -> float:
    """restic's seconds over ours, summed over `rows`."""
    return sum(r["restic"]["wall"] for r in rows) / sum(r["ours"]["wall"] for r in rows)


def verdicts(results: dict) -> list[dict]:
    pushes, pulls, check, big = (results[k] for k in ("pushes", "pulls", "check", "rss"))
    dense = [r for r in pushes if r["series"] == "dense"]
    later = [r for r in pushes if r["series"] == "frozen" and r["step"] > 1]
    found = [("push dense: ckpt push ≥ 3× restic backup", speedup(dense),
              TARGETS["push_dense"]),
             ("push frozen base, steps 2+: ≥ 10× restic backup", speedup(later),
              TARGETS["push_frozen_later"]),
             ("pull: ckpt pull --to FILE.pt ≥ 2× restic restore", speedup(pulls),
              TARGETS["pull"]),
             ("check --read-data ≥ 2× restic check --read-data", speedup([check]),
              TARGETS["check"])]
    out = [{"target": name, "measured": value, "needed": needed, "met": value >= needed}
           for name, value, needed in found]
    if big:
        for command in ("push", "pull"):
            peak = big[command]["max_rss"]
            out.append({"target": f"{command} of {big['file'] / 2**30:.1f} GiB: peak RSS "
                                  "< 300 MB", "measured": peak / MB, "needed": 300,
                        "met": peak < RSS_TARGET})
    return out


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def render(results: dict) -> str:
    env = results["environment"]
    out = [f"Measured {env['date']} at {env['commit']}, seed {env['seed']}, {env['cores']} "
           f"cores, Python {env['python']}, torch {env['torch']}, {env['restic']}; load "
           f"average before/after {env['load_before']:.2f}/{env['load_after']:.2f}; "
           f"{env['seconds']:.0f} s in all. × = restic's seconds over ours (> 1: we are "
           "faster).", "", "### `ckpt push FILE.pt` next to `restic backup FILE`", ""]
    out.append(table(
        ["series", "step", "file", "values changed", "slurm-geo", "restic", "×",
         "CPU s ours / restic", "stored ours", "stored restic"],
        [[r["series"], str(r["step"]), f"{r['file'] / MB:.0f} MB", f"{r['changed']:.1%}",
          f"{r['ours']['wall']:.2f} s", f"{r['restic']['wall']:.2f} s",
          f"{r['restic']['wall'] / r['ours']['wall']:.2f}×",
          f"{r['ours']['cpu']:.1f} / {r['restic']['cpu']:.1f}",
          f"{r['ours_stored'] / MB:.1f} MB", f"{r['restic_stored'] / MB:.1f} MB"]
         for r in results["pushes"]]))
    out += ["", "### `ckpt pull RUN@STEP --to FILE.pt` next to `restic restore SNAPSHOT`", ""]
    out.append(table(
        ["series", "step", "slurm-geo", "restic", "×", "CPU s ours / restic",
         "peak RSS ours / restic"],
        [[r["series"], str(r["step"]) + (" (compared)" if r["compared"] else ""),
          f"{r['ours']['wall']:.2f} s", f"{r['restic']['wall']:.2f} s",
          f"{r['restic']['wall'] / r['ours']['wall']:.2f}×",
          f"{r['ours']['cpu']:.1f} / {r['restic']['cpu']:.1f}",
          f"{r['ours']['max_rss'] / MB:.0f} / {r['restic']['max_rss'] / MB:.0f} MB"]
         for r in results["pulls"]]))
    check = results["check"]
    ours, theirs = check["ours"], check["restic"]
    out += ["", "### `ckpt check --read-data` next to `restic check --read-data` (both "
            "series in one store each)", "", table(
                ["store", "slurm-geo", "restic", "×", "CPU s ours / restic",
                 "peak RSS ours / restic"],
                [[f"{check['ours_store'] / MB:.0f} MB ours, {check['restic_repo'] / MB:.0f} MB "
                  "restic", f"{ours['wall']:.2f} s", f"{theirs['wall']:.2f} s",
                  f"{theirs['wall'] / ours['wall']:.2f}×",
                  f"{ours['cpu']:.1f} / {theirs['cpu']:.1f}",
                  f"{ours['max_rss'] / MB:.0f} / {theirs['max_rss'] / MB:.0f} MB"]])]
    big = results["rss"]
    if big:
        out += ["", f"### Peak memory: push and pull of a {big['file'] / 2**30:.1f} GiB "
                "checkpoint", "", table(
                    ["command", "wall", "peak RSS (ru_maxrss, mapped file pages included)",
                     "peak anonymous (RssAnon, sampled)"],
                    [[name, f"{big[name]['wall']:.1f} s", f"{big[name]['max_rss'] / MB:.0f} MB",
                      f"{big[name]['anon_peak'] / MB:.0f} MB"] for name in ("push", "pull")])]
    out += ["", "### Targets", "", table(
        ["target", "measured", ""],
        [[v["target"], f"{v['measured']:.0f} MB" if "RSS" in v["target"] else
          f"{v['measured']:.3f}×", "met" if v["met"] else "**not met**"]
         for v in results["verdicts"]])]
    return "\n".join(out) + "\n"


def environment(seed: int) -> dict:
    commit = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                            capture_output=True, text=True).stdout.strip() or "unknown"
    return {"date": f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC", "commit": commit, "seed": seed,
            "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "restic": restic_version(),
            "load_before": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=300,
                        help="each checkpoint's size (default 300)")
    parser.add_argument("--rss-gb", type=float, default=4,
                        help="size of the checkpoint whose push and pull peak RSS is measured "
                             "(GiB; 0 skips it)")
    parser.add_argument("--steps", type=int, default=3, help="checkpoints in each series")
    parser.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    parser.add_argument("--work", type=Path, default=None, help="scratch directory")
    args = parser.parse_args()
    seed = time.time_ns() % 2**31
    print(f"seed {seed}", file=sys.stderr)
    env = environment(seed)
    work = Path(tempfile.mkdtemp(prefix="cli-bench-", dir=args.work))
    began = time.perf_counter()
    try:
        results = measure(work, args.size_mb, args.steps, args.rss_gb, seed)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    env.update(seconds=time.perf_counter() - began, load_after=os.getloadavg()[0])
    results = {"environment": env, **results}
    results["verdicts"] = verdicts(results)
    text, data = render(results), json.dumps(results, indent=2)
    print(data if args.json else text)
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    (out / "cli_vs_restic.md").write_text(text)
    (out / "cli_vs_restic.json").write_text(data + "\n")


if __name__ == "__main__":
    main()
