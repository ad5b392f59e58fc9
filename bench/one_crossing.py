"""One crossing (issue 32): a checkpoint's WAN bytes and time, before and after.

Before and after verified-as-written, side by side in one run, on the same checkpoint, over
the same shaped link, by the link's own counters.

- before (two crossings): `copy_checkpoint` to a fresh prefix of the rented site's S3
  server, then `Repository.verify` of the replica (the read-back checkpoint-sync used to
  verify it with), then, as the mover did before resubmitting a moved job, the run's
  steps listed and the replica verified again (a full read).
- after (one crossing): `copy_checkpoint` to another fresh prefix (its puts checked as
  they are written: the destination's digest, a HEAD), the verification record written
  next to the replica as checkpoint-sync does (ckpt.verified.write_record), then the
  mover's decision as federation.resumepoint makes it: the run's steps listed, the record
  read, and `absent` (one listing per directory, a HEAD of the manifest: nothing read).
- the physical limit: the checkpoint's stored bytes (its run key, packs and manifest) sent
  once at the link's rate. Each figure is also given as a ratio to it: WAN bytes over the
  stored bytes (target for "after": <= 1.05), seconds over one transfer.

Bytes on the wire are the kernel's: both ends of the home-remote veth (sandbox.wire), read
by the process doing the work in the home site, before and after each step, never our
accounting; both directions are counted (the read-back crosses remote -> home). The
moves' decisions open their store afresh (another daemon: its TLS handshake counts).
Copies use checkpoint-sync's own transfer plan (sync.runtime.link_plan).

The checkpoint is a torch-sized training state of `--state-mb` MiB: fp32 gaussian weights
and AdamW's two moments (a third each), written (untimed, before any measurement: the
machine has 2 cores) with ckpt.Repository.write_checkpoint into a fresh home store directory
under /var/tmp, sealed with the sandbox's master key: not the sandbox's pfs, so the
sandbox's checkpoint-sync never copies it. Afterwards both prefixes and the home store are
deleted, and the link's rate is put back.

Needs a sandbox that is up (`slurm-geo sandbox up`; SLURM_GEO_SANDBOX_DIR picks it). As root:
    python bench/one_crossing.py [--mbit 200 50] [--state-mb 512] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from slurm_geo.ckpt import LocalDirStore, Metadata, Repository, Tensor  # noqa: E402
from slurm_geo.ckpt.format.keys import load_master_key  # noqa: E402
from slurm_geo.ckpt.ops.replicate import copy_checkpoint, needed_objects, sizes_of  # noqa: E402
from slurm_geo.ckpt.ops.verified import absent, read_record, record_of, write_record  # noqa: E402
from slurm_geo.ckpt.stores.open_store import open_store  # noqa: E402
from slurm_geo.ckpt.stores.store import Store  # noqa: E402
from slurm_geo.ckpt.stores.transfer_plan import TransferPlan  # noqa: E402
from slurm_geo.config import load_config  # noqa: E402
from slurm_geo.sandbox import Sandbox, netns, root_from_env, wire  # noqa: E402
from slurm_geo.sandbox.sites import Site, WanLink  # noqa: E402
from slurm_geo.sync.runtime import link_plan  # noqa: E402

MIB = 2**20
TENSOR_MIB = 64  # the largest tensor generated at once
T = TypeVar("T")


# --- the checkpoint (untimed) --------------------------------------------------------------

def training_state(state_mb: float) -> list[Tensor]:
    """`state_mb` MiB of fp32: weights, AdamW's exp_avg and exp_avg_sq, a third each."""
    rng = np.random.default_rng(0)
    per_kind = state_mb * MIB / 3
    count = max(1, round(per_kind / (TENSOR_MIB * MIB)))
    elements = max(1, int(per_kind / count) // 4)
    kinds: list[tuple[str, Callable[[], Any]]] = [
        ("weight", lambda: rng.standard_normal(elements) * 0.02),
        ("exp_avg", lambda: rng.standard_normal(elements) * 1e-3),
        ("exp_avg_sq", lambda: np.square(rng.standard_normal(elements) * 1e-3)),
    ]
    tensors = []
    for kind, draw in kinds:
        for i in range(count):
            values = draw().astype(np.float32)
            path = f"model.layer{i}.weight" if kind == "weight" else \
                f"optim.state.{i}.{kind}"
            tensors.append(Tensor(path, "float32", values.shape,
                                  memoryview(values).cast("B")))
    return tensors


def write_state(home: Repository, run: str, state_mb: float) -> int:
    metadata = Metadata(1, 1, 0, None, time.strftime("%Y-%m-%dT%H:%M:%SZ"), "onprem", "bench")
    home.create_run_key(run)
    return home.write_checkpoint(run, training_state(state_mb), b"", metadata).step


# --- in the home site: one side, each step between two readings of the link -----------------

def side(args: dict[str, Any]) -> dict[str, Any]:
    """Run one side (`args["side"]`: "before" or "after") and say what each step took."""
    topo = Sandbox(Path(args["sandbox"])).layout.topology
    master = load_master_key(Path(args["key"]))
    home_store = LocalDirStore(Path(args["home"]))
    home = Repository(home_store, master)
    run, step = args["run"], args["step"]
    plan = TransferPlan(args["streams"], args["part"])

    def remote() -> Store:
        return open_store(args["url"], args["endpoint"] or None, plan=plan,
                          ca_file=Path(args["ca"]) if args["ca"] else None)

    steps: list[dict[str, Any]] = []

    def timed(name: str, work: Callable[[], T]) -> T:
        before = wire.link_bytes(topo, WanLink.HOME_REMOTE)
        began = time.monotonic()
        out = work()
        seconds = time.monotonic() - began
        crossed = wire.crossing(before, wire.link_bytes(topo, WanLink.HOME_REMOTE))
        steps.append({"step": name, "seconds": seconds,
                      "to_remote": crossed.from_site(Site.HOME),
                      "from_remote": crossed.from_site(Site.REMOTE),
                      "wan_bytes": crossed.total})
        return out

    there = remote()
    report = timed("copy", lambda: copy_checkpoint(home, home_store, there, run, step,
                                                   streams=plan.streams))
    replica = Repository(there, master)
    faults: list[Any]
    if args["side"] == "before":
        faults = timed("read-back", lambda: replica.verify(run, step))
        if faults:
            raise SystemExit(f"the replica does not verify: {faults[0]}")

        def full_read() -> list[Any]:
            mover = Repository(remote(), master)
            if step not in mover.steps(run):
                return [f"{run}@{step} is not listed"]
            return [str(f) for f in mover.verify(run, step)]
        faults = timed("move decision", full_read)
    else:
        timed("record", lambda: write_record(replica, record_of(report, time.time(),
                                                                "checkpoint-sync")))

        def from_record() -> list[str]:
            mover = Repository(remote(), master)
            if step not in mover.steps(run):
                return [f"{run}@{step} is not listed"]
            record = read_record(mover, run, step)
            return ["no verification record"] if record is None else absent(mover, record)
        faults = timed("move decision", from_record)
    if faults:
        raise SystemExit(f"the move would not resume {run}@{step}: {faults[0]}")
    return {"side": args["side"], "stored_bytes": sum(report.objects.values()),
            "bytes_copied": report.bytes_copied, "bytes_read_back": report.bytes_read_back,
            "steps": steps}


# --- at the login host: the link, the sides, the figures ----------------------------------

def in_home(sandbox: Sandbox, args: dict[str, Any]) -> dict[str, Any]:
    env = {**sandbox.s3_env(), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, str(Path(__file__).resolve()), "--in-home", json.dumps(args)]
    try:
        done = netns.exec_in(sandbox.layout.topology, Site.HOME, argv, env=env, timeout=3600)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"the {args['side']} side took over an hour") from None
    if done.returncode != 0:
        raise SystemExit(f"in the home site ({args['side']}): "
                         f"{done.stderr.strip()[-2000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def empty_prefix(store: Store) -> None:
    for name in store.list(""):
        try:
            store.delete(name)
        except Exception:  # noqa: BLE001 - best effort: a bench's throw-away objects
            pass


def ratios(result: dict[str, Any], mbit: int, stored: int) -> dict[str, Any]:
    one_s = stored * 8 / (mbit * 1e6)
    steps = result["steps"]
    replication = [s for s in steps if s["step"] != "move decision"]
    decision = next(s for s in steps if s["step"] == "move decision")
    repl_s = sum(s["seconds"] for s in replication)
    repl_bytes = sum(s["wan_bytes"] for s in replication)
    return {**result, "replication_s": repl_s, "replication_wan_bytes": repl_bytes,
            "replication_wan_over_stored": repl_bytes / stored,
            "replication_over_one_transfer": repl_s / one_s,
            "decision_s": decision["seconds"], "decision_wan_bytes": decision["wan_bytes"],
            "decision_wan_over_stored": decision["wan_bytes"] / stored,
            "decision_over_one_transfer": decision["seconds"] / one_s}


def measure(sandbox: Sandbox, mbit: int, common: dict[str, Any], prefix_of: Callable[[str], str],
            stored: int) -> dict[str, Any]:
    topo = sandbox.layout.topology
    netns.remember_link_rate(sandbox.layout, WanLink.HOME_REMOTE, mbit)
    netns.set_wan_rate(topo, mbit)
    row: dict[str, Any] = {"mbit": mbit, "stored_bytes": stored,
                           "one_transfer_s": stored * 8 / (mbit * 1e6)}
    for which in ("before", "after"):
        url = prefix_of(f"{mbit}-{which}")
        for _attempt in range(3):
            result = in_home(sandbox, {**common, "side": which, "url": url})
            if netns.wan_state(topo).a.mbit == mbit:
                break
            print(f"the link's rate changed from {mbit} Mbit/s during the {which} side; "
                  "measuring again", file=sys.stderr)
            empty_prefix(open_store(url, common["endpoint"] or None))
        else:
            raise SystemExit(f"the link would not hold {mbit} Mbit/s: something re-shapes it")
        row[which] = ratios(result, mbit, stored)
    return row


def idle_bytes_per_s(topo: Any, seconds: float = 3.0) -> float:
    """What crosses the link meanwhile, unasked (the sandbox's daemons): a noise floor."""
    before = wire.link_bytes(topo, WanLink.HOME_REMOTE)
    time.sleep(seconds)
    return wire.crossing(before, wire.link_bytes(topo, WanLink.HOME_REMOTE)).total / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mbit", type=int, nargs="+", default=[200, 50],
                        help="link rates to measure at, Mbit/s (default: 200 50)")
    parser.add_argument("--state-mb", type=float, default=512.0,
                        help="training state (weights and AdamW moments), MiB (default 512)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--in-home", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.in_home:
        print(json.dumps(side(json.loads(args.in_home))))
        return
    if os.geteuid() != 0:
        sys.exit("slurm-geo: error: bench/one_crossing.py shapes the sandbox's link: run it "
                 "as root")
    sandbox = Sandbox(root_from_env(None))
    layout = sandbox.layout
    if not layout.s3_daemon_credentials.exists():
        sys.exit(f"slurm-geo: error: the sandbox at {layout.root} is not up: "
                 "run `slurm-geo sandbox up` first")
    site = load_config(layout.site_config)
    assert site.sync is not None
    offsite = site.stores[site.sync.destination]
    parsed = urlparse(offsite.url)
    if parsed.scheme != "s3":
        sys.exit(f"slurm-geo: error: the sandbox's off-site store is {offsite.url}, not S3")
    bench_prefix = f"bench-one-crossing-{uuid.uuid4().hex[:8]}"

    def prefix_of(name: str) -> str:
        return f"s3://{parsed.netloc}/{bench_prefix}/{name}"

    os.environ.update(sandbox.s3_env())  # the daemons' key: to empty the prefixes after
    plan = link_plan(site.sync)
    remembered = netns.remembered_wan_mbit(layout)
    started = time.time()
    run = f"bench-one-crossing-{uuid.uuid4().hex[:8]}"
    rows: list[dict[str, Any]] = []
    home_dir = Path(tempfile.mkdtemp(prefix="one-crossing-", dir="/var/tmp"))
    try:
        home_store = LocalDirStore(home_dir)
        home = Repository(home_store, load_master_key(layout.master_key))
        began = time.monotonic()
        step = write_state(home, run, args.state_mb)
        written_s = time.monotonic() - began
        stored = sum(sizes_of(home_store, needed_objects(home.manifest(run, step))).values())
        idle = idle_bytes_per_s(layout.topology)
        common = {"sandbox": str(layout.root), "key": str(layout.master_key),
                  "home": str(home_dir), "run": run, "step": step,
                  "endpoint": offsite.endpoint_url,
                  "ca": str(offsite.ca_file) if offsite.ca_file else "",
                  "streams": plan.streams, "part": plan.part_size}
        for mbit in args.mbit:
            rows.append(measure(sandbox, mbit, common, prefix_of, stored))
    finally:
        for mbit in args.mbit:
            for which in ("before", "after"):
                try:
                    empty_prefix(open_store(prefix_of(f"{mbit}-{which}"),
                                            offsite.endpoint_url or None,
                                            ca_file=offsite.ca_file))
                except Exception as exc:  # noqa: BLE001 - say it, clean the rest
                    print(f"could not empty {prefix_of(f'{mbit}-{which}')}: {exc}",
                          file=sys.stderr)
        shutil.rmtree(home_dir, ignore_errors=True)
        netns.remember_link_rate(layout, WanLink.HOME_REMOTE, remembered)
        netns.set_wan_rate(layout.topology, remembered)
    report = {"started": started, "state_mb": args.state_mb, "stored_bytes": stored,
              "written_s": written_s, "streams": plan.streams, "part_size": plan.part_size,
              "idle_wan_bytes_per_s": idle, "rows": rows}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print_table(report, time.time() - started)


def print_table(report: dict[str, Any], took_s: float) -> None:
    stored = report["stored_bytes"]
    print(f"one crossing: a {report['state_mb']:g} MiB training state "
          f"({stored / 1e6:.1f} MB stored), {report['streams']} streams, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(report['started']))}, "
          f"{took_s:.0f} s; the link carried {report['idle_wan_bytes_per_s'] / 1e3:.1f} KB/s "
          "idle\n")
    print("| WAN | one transfer | protocol | step | time | WAN bytes (to / from remote) | "
          "WAN / stored | time / one transfer |")
    print("|---|--:|---|---|--:|--:|--:|--:|")
    for row in report["rows"]:
        one_s = row["one_transfer_s"]
        for which in ("before", "after"):
            side_ = row[which]
            for s in side_["steps"]:
                print(f"| {row['mbit']} Mbit/s | {one_s:.1f} s | {which} | {s['step']} | "
                      f"{s['seconds']:.2f} s | {size(s['wan_bytes'])} "
                      f"({size(s['to_remote'])} / {size(s['from_remote'])}) | "
                      f"{s['wan_bytes'] / stored:.3f} | {s['seconds'] / one_s:.3f} |")
            print(f"| {row['mbit']} Mbit/s | {one_s:.1f} s | {which} | **replication** | "
                  f"{side_['replication_s']:.2f} s | {size(side_['replication_wan_bytes'])} | "
                  f"**{side_['replication_wan_over_stored']:.3f}** | "
                  f"**{side_['replication_over_one_transfer']:.3f}** |")
    print("\n| WAN | stored | protocol | replication (time, WAN bytes) | WAN / stored | "
          "replication / one transfer | move decision (time, WAN bytes) | "
          "decision / one transfer |")
    print("|---|---|---|---|--:|--:|---|--:|")
    for row in report["rows"]:
        for which in ("before", "after"):
            side_ = row[which]
            print(f"| {row['mbit']} Mbit/s | {size(stored)} | {which} | "
                  f"{side_['replication_s']:.1f} s, {size(side_['replication_wan_bytes'])} | "
                  f"{side_['replication_wan_over_stored']:.3f} | "
                  f"{side_['replication_over_one_transfer']:.3f} | "
                  f"{side_['decision_s']:.2f} s, {size(side_['decision_wan_bytes'])} | "
                  f"{side_['decision_over_one_transfer']:.3f} |")


def size(count: float) -> str:
    if count >= 1e6:
        return f"{count / 1e6:.1f} MB"
    return f"{count / 1e3:.1f} KB"


if __name__ == "__main__":
    main()
