"""Replication lag, and how much checkpoint-sync slows a training loop (target: < 5 %).

A CPU training loop (torch, an MLP with AdamW) checkpoints through slurm_geo.torch's
Checkpointer into a local root, while checkpoint-sync, run as its systemd unit runs it
(default nice and I/O class), replicates each checkpoint to the sandbox's S3 endpoint and
verifies it. First the lag: each checkpoint's creation to its verified replica, from the
daemon's state database. Then the slowdown: phases alternate (ABBA) between the daemon
stopped with SIGSTOP ("off") and running ("on"); each pair compares the wall time of the
same number of steps. Last, the daemon's CPU use while it has nothing to do.

Needs the sandbox's S3 endpoint (`slurm-geo sandbox up`). Run: python bench/sync_lag.py
[--pairs 10] [--steps 200] [--ckpt-every 100] [--threads 1]; prints Markdown for
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from slurm_geo.ckpt import LocalDirStore, Repository, create_master_key_file  # noqa: E402
from slurm_geo.sandbox import Sandbox, root_from_env  # noqa: E402
from slurm_geo.sandbox.layout import S3_BUCKET, SandboxLayout  # noqa: E402
from slurm_geo.sandbox.processes import port_is_open  # noqa: E402
from slurm_geo.sandbox.sites import Site  # noqa: E402
from slurm_geo.sync.reader import SyncStateReader  # noqa: E402
from slurm_geo.sync.state import Replica, Status  # noqa: E402
from slurm_geo.torch import Checkpointer  # noqa: E402

HIDDEN, LAYERS, BATCH = 512, 4, 256


def model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(HIDDEN, HIDDEN), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(HIDDEN, 10))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_phase(checkpointer: Checkpointer, model: nn.Module, optimizer: torch.optim.Optimizer,
                first_step: int, steps: int, ckpt_every: int) -> list[float]:
    """Step times (s) of `steps` training steps, checkpointing every `ckpt_every`."""
    inputs, targets = torch.randn(BATCH, HIDDEN), torch.randint(0, 10, (BATCH,))
    times = []
    for step in range(first_step + 1, first_step + steps + 1):
        began = time.perf_counter()
        loss = nn.functional.cross_entropy(model(inputs), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % ckpt_every == 0:
            checkpointer.save(step, model, optimizer, loss=loss)
        times.append(time.perf_counter() - began)
    checkpointer.wait()
    return times


def write_config(work: Path, layout: SandboxLayout, prefix: str, key: Path,
                 extra: str) -> Path:
    config = work / "site.toml"
    config.write_text(f"""
[stores.pfs]
url = {json.dumps(f"file://{work / 'root'}")}
region = "home"

[stores.offsite]
url = {json.dumps(f"s3://{S3_BUCKET}/{prefix}")}
region = "remote"
endpoint_url = {json.dumps(layout.s3_endpoint)}

[sync]
roots = ["pfs"]
destination = "offsite"
state = {json.dumps(str(work / "state.db"))}
key_file = {json.dumps(str(key))}
metrics_port = 0
poll_interval_s = 2
{extra}
""")
    return config


def start_daemon(config: Path, log: Path, s3_env: dict[str, str]) -> subprocess.Popen:
    program = Path(sys.executable).parent / "slurm-geo-checkpoint-sync"
    argv = [str(program)] if program.exists() else [
        sys.executable, "-m", "slurm_geo.sync.entry"]
    with open(log, "ab") as out:
        proc = subprocess.Popen([*argv, "--config", str(config)], stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, **s3_env})
    deadline = time.monotonic() + 30
    while "event=started" not in log.read_text():
        if time.monotonic() > deadline or proc.poll() is not None:
            raise SystemExit(f"checkpoint-sync did not start: {log.read_text()[-400:]}")
        time.sleep(0.1)
    return proc


def replicas(state: Path) -> list[Replica]:
    """Every replica; none before the daemon created its state."""
    return SyncStateReader(state, missing_ok=True).replicas()


def wait_all_verified(state: Path, expected: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = replicas(state)
        if len(rows) >= expected and all(r.status is Status.VERIFIED for r in rows):
            return
        time.sleep(0.2)
    raise SystemExit(f"not all {expected} checkpoints verified within {timeout_s} s")


def idle_cpu_percent(proc: subprocess.Popen, seconds: float) -> float:
    process = psutil.Process(proc.pid)
    before = sum(process.cpu_times()[:2])
    time.sleep(seconds)
    return 100 * (sum(process.cpu_times()[:2]) - before) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=200, help="steps per phase")
    parser.add_argument("--ckpt-every", type=int, default=100)
    parser.add_argument("--lag-steps", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--idle-s", type=float, default=60)
    parser.add_argument("--nice", type=int, default=None, help="[sync] nice (default 10)")
    parser.add_argument("--cpu-policy", choices=["idle", "batch", "normal"], default=None,
                        help="[sync] cpu_policy (default idle)")
    parser.add_argument("--aa", action="store_true",
                        help="A/A run: the daemon stays stopped in both phases (noise floor)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    layout = SandboxLayout(root_from_env(None))
    # The S3 server answers at the remote site's address (layout.s3_endpoint), not loopback.
    if not port_is_open(layout.s3_port, layout.address(Site.REMOTE)):
        raise SystemExit("the sandbox's S3 endpoint is down: run `slurm-geo sandbox up`")
    with tempfile.TemporaryDirectory(prefix="sync-bench-") as tmp:
        report = run(Path(tmp), layout, args)
    print_report(report, args)


class Training:
    """The loop's model, optimizer and step, saving into the watched root ("on") or a root
    the daemon does not watch ("off")."""

    def __init__(self, work: Path, key: bytes, ckpt_every: int):
        self.checkpointers = {}
        for phase, root in (("on", work / "root"), ("off", work / "unwatched")):
            root.mkdir()
            self.checkpointers[phase] = Checkpointer(Repository(LocalDirStore(root), key),
                                                     "bench")
        self.model, self.optimizer = model_and_optimizer()
        self.ckpt_every = ckpt_every
        self.step = 0
        self.replicated = 0  # checkpoints saved into the watched root

    def phase(self, where: str, steps: int, ckpt_every: int | None = None) -> list[float]:
        times = train_phase(self.checkpointers[where], self.model, self.optimizer, self.step,
                            steps, ckpt_every or self.ckpt_every)
        self.step += steps
        if where == "on":
            self.replicated += steps // (ckpt_every or self.ckpt_every)
        return times

    def close(self) -> None:
        for checkpointer in self.checkpointers.values():
            checkpointer.close()


def run(work: Path, layout: SandboxLayout, args: argparse.Namespace) -> dict:
    key = work / "master.key"
    create_master_key_file(key)
    extra = "\n".join([*([] if args.nice is None else [f"nice = {args.nice}"]),
                       *([] if args.cpu_policy is None else
                         [f"cpu_policy = {json.dumps(args.cpu_policy)}"])])
    config = write_config(work, layout, f"bench/{uuid.uuid4().hex}", key, extra)
    training = Training(work, key.read_bytes(), args.ckpt_every)
    state = work / "state.db"
    training.phase("off", 50, 10**9)  # warm-up, no checkpoint
    daemon = start_daemon(config, work / "daemon.log", Sandbox(layout.root).s3_env())
    try:
        training.phase("on", args.lag_steps)  # lag: the daemon runs throughout, as on a site
        wait_all_verified(state, training.replicated)
        lag_rows = replicas(state)
        pairs, daemon_cpu, on_seconds = slowdown_pairs(training, daemon, args)
        daemon.send_signal(signal.SIGCONT)
        training.close()
        wait_all_verified(state, training.replicated)
        time.sleep(5)
        idle = idle_cpu_percent(daemon, args.idle_s)
    finally:
        daemon.send_signal(signal.SIGCONT)
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)
    size = sum(p.stat().st_size for p in (work / "root").rglob("*") if p.is_file())
    return {"pairs": pairs, "lag_rows": lag_rows, "rows": replicas(state), "idle": idle,
            "daemon_cpu": daemon_cpu, "on_seconds": on_seconds, "root_bytes": size,
            "checkpoints": training.replicated,
            "params": sum(p.numel() for p in training.model.parameters())}


def slowdown_pairs(training: Training, daemon: subprocess.Popen, args: argparse.Namespace,
                   ) -> tuple[list[tuple[list[float], list[float]]], float, float]:
    """Phases alternate off/on, on/off, ... Both checkpoint alike; "off" phases into a root
    the daemon does not watch, with the daemon stopped (SIGSTOP), so each "on" phase carries
    exactly the steady load: replicating its own checkpoints (the last one's tail spills
    into the next "on" phase, as one came in from the phase before)."""
    process = psutil.Process(daemon.pid)
    pairs, daemon_cpu, on_seconds = [], 0.0, 0.0
    for i in range(args.pairs):
        times = {}
        for phase in ("off", "on") if i % 2 == 0 else ("on", "off"):
            running = phase == "on" and not args.aa
            daemon.send_signal(signal.SIGCONT if running else signal.SIGSTOP)
            cpu = sum(process.cpu_times()[:2])
            times[phase] = training.phase(phase, args.steps)
            if phase == "on":
                daemon_cpu += sum(process.cpu_times()[:2]) - cpu
                on_seconds += sum(times[phase])
        pairs.append((times["off"], times["on"]))
    return pairs, daemon_cpu, on_seconds


def print_report(report: dict, args: argparse.Namespace) -> None:
    all_off = [t for off, _ in report["pairs"] for t in off]
    all_on = [t for _, on in report["pairs"] for t in on]
    off, on = statistics.median(all_off), statistics.median(all_on)
    mean_off, mean_on = statistics.fmean(all_off), statistics.fmean(all_on)
    # Each "on" phase against the "off" phase just before it: slow drifts cancel.
    paired = sorted(100 * (sum(b) / sum(a) - 1) for a, b in report["pairs"])
    lags = sorted(r.lag_s for r in report["lag_rows"] if r.lag_s is not None)
    waits = sorted(r.verified_at - r.discovered_at for r in report["lag_rows"]
                   if r.verified_at)
    uploaded = sum(r.bytes for r in report["rows"])
    slowdown = statistics.median(paired)
    on_seconds = report["on_seconds"]
    print(f"model: MLP {report['params'] / 1e6:.1f} M parameters (AdamW), batch {BATCH}, "
          f"{torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs; daemon "
          f"cpu_policy {args.cpu_policy or 'idle (default)'}, nice {args.nice or 10}"
          f"{'; A/A: daemon stopped in both phases' if args.aa else ''}")
    print(f"checkpoints: {report['checkpoints']}, every {args.ckpt_every} steps; "
          f"{uploaded / 1e6:.0f} MB uploaded; root {report['root_bytes'] / 1e6:.0f} MB\n")
    print("| measure | value |\n|---|---|")
    print(f"| median step, sync off | {off * 1000:.2f} ms (mean {mean_off * 1000:.2f}) |")
    print(f"| median step, sync on | {on * 1000:.2f} ms (mean {mean_on * 1000:.2f}) |")
    print(f"| slowdown: median of {len(paired)} paired phases (wall time) | {slowdown:+.1f} % "
          f"(target < 5 %: {'met' if slowdown < 5 else 'MISSED'}); pairs "
          f"{', '.join(f'{p:+.1f}' for p in paired)} |")
    print(f"| slowdown: median step time | {100 * (on - off) / off:+.1f} % |")
    print(f"| lag, creation to verified: median / max | {statistics.median(lags):.1f} s / "
          f"{lags[-1]:.1f} s |")
    print(f"| discovered to verified: median / max | {statistics.median(waits):.2f} s / "
          f"{waits[-1]:.2f} s |")
    print(f"| daemon CPU while training | {100 * report['daemon_cpu'] / on_seconds:.1f} % "
          "of one core |")
    print(f"| daemon CPU idle ({args.idle_s:.0f} s) | {report['idle']:.2f} % of one core "
          f"(target < 1 %: {'met' if report['idle'] < 1 else 'MISSED'}) |")


if __name__ == "__main__":
    main()
