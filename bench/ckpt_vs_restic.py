"""slurm-geo checkpoints next to restic, side by side in one run, both into local directories.

Run: python bench/ckpt_vs_restic.py [--scale S] [--big-gib G] [--steps N] [--dense-delta].
Generates three series of real torch checkpoints (bench/ckpt_series.py), ten steps each;
every step is saved with torch.save and backed up by restic (`restic backup` of the file,
successive versions of one path), and pushed with Repository.write_checkpoint with the
previous step as parent (delta mode for the bf16 series; with --dense-delta the dense
series is also pushed in delta mode, into a second store; frozen tensors passed as
`unchanged`, found by torch version counters). Then the last step of each is pulled, and
the step with the longest delta chain if that is another: restic restore --verify of
that snapshot, against iter_tensors (every chunk verified, nothing written to disk).
Also: a streaming push of a large checkpoint from disk in a child process (peak memory),
the training stall of Checkpointer.save, and each pipeline stage's own speed. Prints
markdown, also written to bench/results/ckpt_vs_restic.md. Sizes default to 300-340 MB
per checkpoint (--scale 0.8).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import ckpt_series
import torch
from ckpt_tools import (
    MB,
    Cost,
    Restic,
    Stopwatch,
    cheapest,
    ckpt_tensors,
    cost_here,
    restic_version,
    stage_speeds,
    timed,
    tree_bytes,
)

from slurm_geo.ckpt import LocalDirStore, Metadata, Repository
from slurm_geo.ckpt.format.chunking import DEFAULT_CHUNK_SIZE, fixed_chunks
from slurm_geo.ckpt.repo.writer import DEFAULT_OPTIONS

HERE = Path(__file__).resolve().parent
RUN = "bench"


@dataclass
class StepResult:
    step: int
    logical: int  # bytes of tensors pushed by us
    file: int  # bytes of the torch.save file restic backs up
    ours: Cost
    restic: Cost
    ours_stored: int  # bytes the step added to the store
    restic_stored: int
    depth: int  # the longest delta chain among the step's chunks


@dataclass(frozen=True)
class Pull:
    """One checkpoint restored by both tools (best of two each)."""

    step: int
    depth: int
    ours: Cost
    restic: Cost


@dataclass
class SeriesResult:
    key: str
    title: str
    steps: list[StepResult] = field(default_factory=list)
    pulls: list[Pull] = field(default_factory=list)  # the last step, then the deepest one
    pulled: int = 0

    @property
    def ours_pull(self) -> Cost:
        return self.pulls[0].ours

    @property
    def restic_pull(self) -> Cost:
        return self.pulls[0].restic

    def total(self, attribute: str, first: int = 0) -> float:
        return sum(_get(s, attribute) for s in self.steps[first:])


def _get(step: StepResult, attribute: str) -> float:
    """`ours.wall` style paths into a step."""
    value: object = step
    for name in attribute.split("."):
        value = getattr(value, name)
    assert isinstance(value, int | float)
    return value


def metadata(step: int) -> Metadata:
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return Metadata(step, step, 0, None, now, "bench", "0")


def run_series(key: str, describe: Callable[[ckpt_series.Step], str],
               steps: Iterator[ckpt_series.Step], work: Path,
               modes: dict[str, bool]) -> list[SeriesResult]:
    """One restic backup per step and one push per mode (name: delta) into its own store;
    a result per mode, sharing restic's figures."""
    root = work / key
    restic_dir, source = root / "restic", root / "source"
    source.mkdir(parents=True)
    repos = {name: Repository(LocalDirStore(_fresh(root / f"ours-{name}")), os.urandom(32))
             for name in modes}
    restic = Restic(restic_dir, root / "restic-cache")
    results = {name: SeriesResult(name, "") for name in modes}
    for s in steps:
        torch.save(s.saved, source / "checkpoint.pt")
        os.sync()
        restic_before = tree_bytes(restic_dir)
        restic_cost = restic.backup(source)
        restic_stored = tree_bytes(restic_dir) - restic_before
        tensors = ckpt_tensors(s.state)
        for name, delta in modes.items():
            os.sync()  # each tool starts with no one's writes pending on the disk
            result, store = results[name], root / f"ours-{name}"
            result.title = result.title or describe(s) + _mode_note(name, key)
            ours_before = tree_bytes(store)
            cpu, began = time.process_time(), time.perf_counter()
            manifest = repos[name].write_checkpoint(
                RUN, tensors, b"", metadata(s.step), parent=s.step - 1 if s.step > 1 else None,
                delta=delta, unchanged=s.unchanged)
            ours_cost = Cost(time.perf_counter() - began, time.process_time() - cpu)
            result.steps.append(StepResult(
                s.step, s.nbytes, (source / "checkpoint.pt").stat().st_size, ours_cost,
                restic_cost, tree_bytes(store) - ours_before, restic_stored,
                max((c.depth for c in manifest.refs()), default=0)))
    s = tensors = None  # type: ignore[assignment]  # free the state before pulling
    snapshots = restic.snapshot_ids()
    for name, result in results.items():
        last = result.steps[-1]
        deepest = max(result.steps, key=lambda r: (r.depth, r.step))
        for pulled in [last] + ([deepest] if deepest.depth > last.depth else []):
            result.pulls.append(pull_both(repos[name], restic, pulled,
                                          snapshots[pulled.step - 1], root))
        result.pulled = last.logical
    shutil.rmtree(root)  # keep the page cache and the disk for the next series
    return list(results.values())


def _fresh(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


def _mode_note(name: str, key: str) -> str:
    return ", delta mode" if name != key else ""


def pull_both(repo: Repository, restic: Restic, step: StepResult, snapshot: str,
              root: Path) -> Pull:
    """Restore `step` with both tools, best of two each (this machine is shared, noisy)."""
    restic_pulls, our_pulls = [], []
    for attempt in range(2):
        target = root / f"restored-{attempt}"
        restic_pulls.append(restic.restore_verified(target, snapshot))
        shutil.rmtree(target)
        our_pulls.append(cost_here(lambda: pull(repo, step.step)))
    return Pull(step.step, step.depth, cheapest(our_pulls), cheapest(restic_pulls))


def pull(repo: Repository, step: int) -> None:
    for _tensor in repo.iter_tensors(RUN, step):
        pass  # each chunk was verified; a trainer would copy it into its model here


def stream_push(work: Path, gib: float, tensors: int = 32) -> dict:
    """A checkpoint of `gib` GiB written to disk, then pushed by a child process."""
    import numpy

    path, store = work / "big.bin", work / "big-store"
    store.mkdir()
    per_tensor = int(gib * 2**30) // tensors // 4
    base = numpy.random.default_rng(7).standard_normal(per_tensor, dtype=numpy.float32) * 0.02
    with open(path, "wb") as handle:
        for i in range(tensors):  # distinct tensors (no dedup), each gaussian
            numpy.roll(base, 4099 * i + 1).tofile(handle)
    del base
    os.sync()
    out = subprocess.run([sys.executable, str(HERE / "ckpt_stream_push.py"), str(path),
                          str(store), str(tensors)], check=True, capture_output=True, text=True)
    report = json.loads(out.stdout)
    report["stored"] = tree_bytes(store)
    path.unlink()
    shutil.rmtree(store)
    return report


def training_stall(work: Path, params: float, saves: int = 3, steps: int = 4) -> dict:
    """Checkpointer.save's blocking time next to copying the state dict to CPU memory; and
    training steps while the background write runs, next to steps without one."""
    from slurm_geo.torch import Checkpointer

    model, optimizer = _dense_model_for_stall(params)
    store = work / "stall"
    store.mkdir()
    repo = Repository(LocalDirStore(store), os.urandom(32))
    copies: list[float] = []
    stalls: list[float] = []
    writes: list[float] = []
    busy: list[float] = []
    idle: list[float] = []
    step = 0
    with Checkpointer(repo, RUN) as checkpointer:
        for _save in range(saves):
            ckpt_series.train_step(model, optimizer)
            step += 1
            copies.append(timed(lambda: _copy_state(model, optimizer)))
            with Stopwatch() as save:
                checkpointer.save(step, model, optimizer)
            stalls.append(save.seconds)
            saved = time.perf_counter()
            for times in (busy, idle):  # first while the write runs, then after it
                for _ in range(steps):
                    times.append(timed(lambda: ckpt_series.train_step(model, optimizer)))
                    step += 1
                if times is busy:
                    checkpointer.wait()
                    writes.append(time.perf_counter() - saved)
    shutil.rmtree(store)
    return {"copy_s": statistics.median(copies), "save_s": statistics.median(stalls),
            "write_s": statistics.median(writes), "busy_step_s": statistics.median(busy),
            "idle_step_s": statistics.median(idle),
            "bytes": sum(t.numel() * t.element_size()
                         for t in ckpt_series.flat_state(model, optimizer).values())}


def _dense_model_for_stall(params: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(4)
    width = ckpt_series.WIDTH
    layers = max(1, round(params / (width * width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _copy_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list:
    """What any asynchronous save must do before training may go on: copy every tensor."""
    return [t.detach().clone() for t in ckpt_series.flat_state(model, optimizer).values()]


def stages(work: Path, params: float) -> tuple:
    """Stage speeds on chunks of a dense fp32 model with AdamW state, and our push of them."""
    state = next(ckpt_series.dense_adamw(params, steps=1)).state
    tensors = ckpt_tensors(state)
    chunks = [c for t in tensors if t.dtype == "float32"
              for c in fixed_chunks(memoryview(t.data).cast("B"), DEFAULT_CHUNK_SIZE)]
    return stage_speeds(chunks, element_size=4, scratch=work), tensors


def pipeline_speed(work: Path, tensors: list) -> float:
    """MB/s of one push of `tensors` into a fresh store (best of two)."""
    best = float("inf")
    for attempt in range(2):
        store = work / f"pipeline-{attempt}"
        store.mkdir()
        repo = Repository(LocalDirStore(store), os.urandom(32))
        with Stopwatch() as push:
            repo.write_checkpoint(RUN, tensors, b"", metadata(1))
        best = min(best, push.seconds)
        shutil.rmtree(store)
    return sum(len(memoryview(t.data).cast("B")) for t in tensors) / MB / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=0.8, help="size of every series")
    parser.add_argument("--big-gib", type=float, default=4.0, help="streaming push size")
    parser.add_argument("--steps", type=int, default=10, help="checkpoints in every series")
    parser.add_argument("--dense-delta", action="store_true",
                        help="also push the dense series in delta mode (slow: ~3 min more)")
    parser.add_argument("--work", type=Path, default=None, help="scratch directory")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.work))
    began, load_before = time.perf_counter(), os.getloadavg()
    try:
        sections = measure(work, args.scale, args.big_gib, args.steps, args.dense_delta)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = render(sections, time.perf_counter() - began, load_before, os.getloadavg())
    print(text)
    results = HERE / "results"
    results.mkdir(exist_ok=True)
    (results / "ckpt_vs_restic.md").write_text(text)


def measure(work: Path, scale: float, big_gib: float, steps: int, dense_delta: bool) -> dict:
    m = 1e6 * scale
    def params(step: ckpt_series.Step, part: str = "model.") -> str:
        count = sum(t.numel() for path, t in step.state.items() if path.startswith(part))
        return f"{count / 1e6:.1f}M" if count >= 1e6 else f"{count / 1e3:.0f}K"

    series = [
        *run_series("a", lambda s: f"(a) dense fp32 MLP + AdamW, {params(s)} params",
                    ckpt_series.dense_adamw(32 * m, steps), work,
                    {"a": False, **({"a+delta": True} if dense_delta else {})}),
        *run_series("b", lambda s: f"(b) LoRA ({params(s, 'model.0.lora')} params a layer) on "
                    f"a frozen fp32 base, {params(s)} params in all",
                    ckpt_series.lora_finetune(100 * m, steps), work, {"b": False}),
        *run_series("c", lambda s: f"(c) bf16, {params(s)} params, ~1 % changed per step",
                    ckpt_series.bf16_sparse_updates(200 * m, steps), work, {"c": True}),
    ]
    speeds, tensors = stages(work, 32 * m)
    pipeline = pipeline_speed(work, tensors)
    del tensors
    return {"series": series, "speeds": speeds, "pipeline": pipeline,
            "stall": training_stall(work, 32 * m), "big": stream_push(work, big_gib)}


Row = list[str]


def table(header: Row, rows: list[Row]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def mbps(nbytes: float, seconds: float) -> str:
    return f"{nbytes / MB / seconds:.0f} MB/s"


def ratio(x: float, y: float) -> str:
    return f"{x / y:.2f}×" if y else "n/a"


def render(sections: dict, seconds: float, load_before: tuple, load_after: tuple) -> str:
    series: list[SeriesResult] = sections["series"]
    out = [environment(seconds, load_before, load_after), "", "### Push and stored bytes", ""]
    out.append(table(
        ["series", "step", "logical", "push ours", "push restic", "push ×", "CPU s ours / restic",
         "stored ours", "stored restic", "stored ratio", "delta depth"],
        [[r.title if s.step == 1 else "", str(s.step), f"{s.logical / MB:.0f} MB",
          f"{s.ours.wall:.2f} s ({mbps(s.logical, s.ours.wall)})",
          f"{s.restic.wall:.2f} s ({mbps(s.file, s.restic.wall)})",
          ratio(s.logical / s.ours.wall, s.file / s.restic.wall),
          f"{s.ours.cpu:.1f} / {s.restic.cpu:.1f}",
          f"{s.ours_stored / MB:.1f} MB", f"{s.restic_stored / MB:.1f} MB",
          ratio(s.ours_stored, s.restic_stored), str(s.depth)]
         for r in series for s in r.steps]))
    later = f"steps 2-{len(series[0].steps)}"
    out += ["", "### Per series (× = our throughput over restic's; CPU × = restic's CPU seconds "
            "over ours)", "", table(
        ["series", "push × all steps", f"push × {later}", "push CPU ×", "stored ratio all",
         f"stored ratio {later}"],
        [[r.title, f"{push_ratio(r):.2f}×", f"{push_ratio(r, 1):.2f}×",
          ratio(r.total("restic.cpu"), r.total("ours.cpu")),
          ratio(r.total("ours_stored"), r.total("restic_stored")),
          ratio(r.total("ours_stored", 1), r.total("restic_stored", 1))] for r in series])]
    out += ["", "### Pull: restore + verify of the last step, and of the step with the longest "
            "delta chain where that is another", "", table(
        ["series", "step", "delta depth", "pull ours", "pull restic", "pull ×", "pull CPU ×"],
        [[r.title if p is r.pulls[0] else "", str(p.step), str(p.depth),
          f"{p.ours.wall:.2f} s ({mbps(r.pulled, p.ours.wall)})",
          f"{p.restic.wall:.2f} s ({mbps(r.pulled, p.restic.wall)})",
          ratio(p.restic.wall, p.ours.wall), ratio(p.restic.cpu, p.ours.cpu)]
         for r in series for p in r.pulls])]
    out += ["", stages_section(sections), "", big_and_stall(sections), "",
            targets(sections)]
    return "\n".join(out) + "\n"


def push_ratio(r: SeriesResult, first: int = 0) -> float:
    return (r.total("logical", first) / r.total("ours.wall", first)) / (
        r.total("file", first) / r.total("restic.wall", first))


def targets(sections: dict) -> str:
    a, *extra, b, c = sections["series"]
    big, stall = sections["big"], sections["stall"]

    push = push_ratio

    def cpu(r: SeriesResult, first: int = 0) -> float:
        return r.total("restic.cpu", first) / r.total("ours.cpu", first)

    def stored(r: SeriesResult, first: int = 0) -> float:
        return r.total("ours_stored", first) / r.total("restic_stored", first)

    later = f"steps 2-{len(a.steps)}"

    def first(measure: Callable[[SeriesResult, int], float], r: SeriesResult) -> float:
        return measure(SeriesResult(r.key, r.title, r.steps[:1]), 0)

    def split(measure: Callable[[SeriesResult, int], float], r: SeriesResult, digits: int) -> str:
        return (f"first save {first(measure, r):.{digits}f}×, {later} "
                f"{measure(r, 1):.{digits}f}×")

    def pull_ratio(p: Pull) -> float:
        return p.restic.wall / p.ours.wall

    def pulls(r: SeriesResult) -> str:
        return "; ".join(f"step {p.step} (depth {p.depth}): {pull_ratio(p):.2f}×, CPU "
                         f"{p.restic.cpu / p.ours.cpu:.2f}×" for p in r.pulls)

    checks = [
        ("push (a) ≥ 4× restic", push(a), push(a) >= 4,
         f"{split(push, a, 2)}; CPU: {cpu(a):.2f}×"),
        ("push (b) ≥ 10× restic", push(b), push(b) >= 10,
         f"{split(push, b, 1)}; CPU: {cpu(b):.2f}×"),
        ("stored (a) ≤ 0.85× restic", stored(a), stored(a) <= 0.85, split(stored, a, 3)),
        ("stored (b) ≤ 0.5× restic", stored(b), stored(b) <= 0.5, split(stored, b, 3)),
        ("stored (c) ≤ 0.1× restic", stored(c), stored(c) <= 0.1, split(stored, c, 3)),
    ] + [(f"pull {r.key} ≥ 2× restic restore --verify (worst pull)",
          min(map(pull_ratio, r.pulls)), min(map(pull_ratio, r.pulls)) >= 2, pulls(r))
         for r in (a, b, c)] + [
        (f"push of {big['bytes'] / 2**30:.0f} GiB under 1 GiB RSS (GiB, VmHWM)",
         big["vm_hwm_kib"] / 2**20, big["vm_hwm_kib"] < 2**20,
         f"anonymous peak {big['rss_anon_peak_kib'] / 2**20:.2f} GiB"),
        ("stall ≤ 2× state-dict copy", stall["save_s"] / stall["copy_s"],
         stall["save_s"] <= 2 * stall["copy_s"], ""),
    ]
    rows = [[name, f"{value:.3g}", "met" if ok else "**not met**", note]
            for name, value, ok, note in checks]
    trades = "".join(
        f"\n\nNot a target, the trade delta mode makes on (a): stored {stored(r):.3f}× restic "
        f"({split(stored, r, 3)}), push {push(r):.2f}×, pull {pulls(r)}." for r in extra)
    return "### Targets (all steps of each series unless noted)\n\n" + table(
        ["target", "measured", "", "note"], rows) + trades


def environment(seconds: float, before: tuple, after: tuple) -> str:
    import cryptography
    import zstandard

    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return (f"Measured {datetime.now(UTC):%Y-%m-%d %H:%M} UTC in {seconds:.0f} s on "
            f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, "
            f"torch {torch.__version__}, zstandard {zstandard.__version__}, cryptography "
            f"{cryptography.__version__}, {restic_version()}; writers use "
            f"{DEFAULT_OPTIONS.threads} threads. Load average before/after: "
            f"{before[0]:.2f}/{after[0]:.2f}.")


def stages_section(sections: dict) -> str:
    speeds, pipeline = sections["speeds"], sections["pipeline"]
    cores = os.cpu_count() or 1
    brief = speeds.serial(speeds.BRIEF)
    every = speeds.serial(tuple(speeds.LABELS))
    rows = [[name, f"{value:.0f} MB/s"] for name, value in speeds.named().items()]
    rows += [
        ["hash + split + zstd + AES in turn, one core", f"{brief:.0f} MB/s"],
        [f"... what those four allow on {cores} cores", f"{brief * cores:.0f} MB/s"],
        ["all six stages in turn, one core", f"{every:.0f} MB/s"],
        [f"... what all six allow on {cores} cores", f"{every * cores:.0f} MB/s"],
        ["our push of the same data, fresh store (best of 2)",
         f"{pipeline:.0f} MB/s = {pipeline / (brief * cores):.0%} of the four-stage bound, "
         f"{pipeline / (every * cores):.0%} of the six-stage bound"],
    ]
    return "### Pipeline stages (one thread, 4 MiB chunks of (a)'s fp32 state)\n\n" + table(
        ["stage", "speed"], rows)


def big_and_stall(sections: dict) -> str:
    big, stall = sections["big"], sections["stall"]
    lines = ["### Streaming push and training stall", "", table(
        ["measure", "value"],
        [[f"push of {big['bytes'] / 2**30:.1f} GiB from a file (child process)",
          f"{big['seconds']:.1f} s ({mbps(big['bytes'], big['seconds'])}), "
          f"stored {big['stored'] / 2**30:.2f} GiB"],
         ["peak RSS (VmHWM, mapped file pages included)",
          f"{big['vm_hwm_kib'] / 1024:.0f} MiB"],
         ["peak anonymous memory (RssAnon, sampled)", f"{big['rss_anon_peak_kib'] / 1024:.0f} MiB"],
         [f"state dict copy to CPU ({stall['bytes'] / MB:.0f} MB)", f"{stall['copy_s']:.3f} s"],
         ["Checkpointer.save, blocking part (median of 3)",
          f"{stall['save_s']:.3f} s = {stall['save_s'] / stall['copy_s']:.2f}× the copy"],
         ["its background write, done after (median of 3, training meanwhile)",
          f"{stall['write_s']:.2f} s"],
         ["a training step while the write runs / without (medians)",
          f"{stall['busy_step_s']:.3f} s / {stall['idle_step_s']:.3f} s"]])]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
