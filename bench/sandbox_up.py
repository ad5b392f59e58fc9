"""Time `slurm-geo sandbox up` on a fresh directory, then again (idempotent), then `down`,
then `up` after `down` (state kept), and check that `down` left nothing behind: no mount
under the sandbox's directory, none of its network namespaces, no process it started.

Targets: a fresh `up` (the provider's root filesystem already built) under 60 s on 2
cores; with `--fresh-image`, a fresh `up` that first builds a provider root filesystem of
its own (Debian's newest suite through mmdebstrap, into a throw-away directory named by
$SLURM_GEO_PROVIDER_IMAGE: the shared image, which other sandboxes may be running on, is
left alone) under 3 minutes, and `up` once built under 10 s (issue 30).

Run as root: python bench/sandbox_up.py [--fresh-image] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from slurm_geo.sandbox import Sandbox, rootfs
from slurm_geo.sandbox.processes import ProcessTable

ROOT = Path(f"/var/tmp/slurm-geo-bench-{os.getpid()}")
IMAGE = Path(f"/var/tmp/slurm-geo-bench-image-{os.getpid()}")
PORT_BASE = "19800"


def timed(env: dict[str, str], *args: str) -> float:
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "slurm_geo", "sandbox", *args, "--dir",
                           str(ROOT)], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"sandbox {' '.join(args)} failed: {done.stderr.strip()[-1500:]}")
    return time.perf_counter() - began


def left_behind(prefix: str) -> list[str]:
    """What of the sandbox is still there after `down`: mounts, namespaces, processes."""
    found = []
    with open("/proc/self/mountinfo") as handle:
        found += [f"mount {line.split()[4]}" for line in handle if str(ROOT) in line]
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    found += [f"namespace {line.split()[0]}" for line in names.splitlines()
              if line.startswith(prefix)]
    found += [f"process {p.pid} {p.name()}" for p in ProcessTable(ROOT).marked_processes()]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fresh-image", action="store_true",
                        help="build a provider root filesystem of its own first (minutes)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    env = dict(os.environ)
    if args.fresh_image:
        env[rootfs.IMAGE_DIR_ENV] = str(IMAGE)
    result: dict[str, object] = {"fresh_image": args.fresh_image}
    try:
        result["fresh_up_s"] = timed(env, "up", "--port-base", PORT_BASE)
        prefix = Sandbox(ROOT).layout.topology.prefix
        if args.fresh_image:
            stamp = rootfs.read_stamp(IMAGE) or {}
            result["image_build_s"] = stamp.get("build_s")
            result["image_mb"] = round(int(stamp.get("size_bytes") or 0) / 1e6)
            result["slurm_version"] = stamp.get("slurm_version")
        result["second_up_s"] = timed(env, "up")
        result["down_s"] = timed(env, "down")
        result["left_after_down"] = left_behind(prefix)
        result["up_after_down_s"] = timed(env, "up")
        timed(env, "down", "--purge")
        result["left_after_purge"] = left_behind(prefix)
    finally:
        shutil.rmtree(ROOT, ignore_errors=True)
        shutil.rmtree(IMAGE, ignore_errors=True)
    fresh_target = 180.0 if args.fresh_image else 60.0
    result["met"] = (float(result["fresh_up_s"]) < fresh_target  # type: ignore[arg-type]
                     and float(result["up_after_down_s"]) < 10  # type: ignore[arg-type]
                     and not result["left_after_down"] and not result["left_after_purge"])
    if args.json:
        print(json.dumps(result, indent=2))
        return
    what = "incl. building the provider image" if args.fresh_image else "image already built"
    print(f"fresh up ({what})              {result['fresh_up_s']:6.1f} s"
          f"   target {fresh_target:.0f} s")
    if args.fresh_image:
        print(f"  of it, the image ({result['slurm_version']}, {result['image_mb']} MB)  "
              f"{result['image_build_s']} s")
    print(f"second up (all running: no-op)             {result['second_up_s']:6.1f} s")
    print(f"down                                        {result['down_s']:6.1f} s")
    print(f"up after down (state kept)                  {result['up_after_down_s']:6.1f} s"
          "   target 10 s")
    print(f"left after down / purge: {result['left_after_down'] or 'nothing'} / "
          f"{result['left_after_purge'] or 'nothing'}")
    print(f"targets: {'met' if result['met'] else 'MISSED'}")


if __name__ == "__main__":
    main()
