"""checkpoint-sync over the sandbox's WAN (issue 16): a 1 GB checkpoint committed at home,
replicated by the sandbox's own checkpoint-sync (running in the home site) to the remote
site's S3 server, beside boto3's own multipart upload (`upload_file`, its default
TransferConfig: 8 MiB parts, 10 threads) of the same bytes from the home site, over the
same shaped link, in one run. Targets: checkpoint-sync's copy at >= 80 % of the link's
rate; its ratio to boto3's.

The checkpoint is fp32 gaussian tensors (what training state looks like to the codec:
stored at about 0.85 of its size) written straight into the sandbox's pfs under a fresh
run; checkpoint-sync's state database says when its copy started and ended (verification
reads left out). boto3 uploads one object made of the checkpoint's packs, concatenated.
Afterwards the run is deleted from both stores.

Needs the sandbox (`slurm-geo sandbox up`). Run: python bench/sync_wan.py [--mbit 200 ...]
[--gb 1.0]; prints Markdown for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from slurm_geo.ckpt import LocalDirStore, Metadata, Repository, Tensor  # noqa: E402
from slurm_geo.ckpt.format.keys import load_master_key  # noqa: E402
from slurm_geo.ckpt.format.manifest import with_bases  # noqa: E402
from slurm_geo.ckpt.format.names import key_name, latest_name, pack_name  # noqa: E402
from slurm_geo.ckpt.stores.open_store import open_store  # noqa: E402
from slurm_geo.config import load_config  # noqa: E402
from slurm_geo.sandbox import Sandbox, netns, root_from_env  # noqa: E402
from slurm_geo.sandbox.layout import S3_BUCKET  # noqa: E402
from slurm_geo.sandbox.sites import Site  # noqa: E402
from slurm_geo.sync.reader import SyncStateReader  # noqa: E402

TENSOR_MB = 64
BOTO3_UPLOAD = """
import json, sys, time, boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
client = boto3.client("s3", endpoint_url=sys.argv[1],
                      config=Config(s3={"addressing_style": "path"}))
started = time.monotonic()
client.upload_file(sys.argv[2], sys.argv[3], sys.argv[4], Config=TransferConfig())
print(json.dumps({"seconds": time.monotonic() - started}))
client.delete_object(Bucket=sys.argv[3], Key=sys.argv[4])
"""


def write_checkpoint(repository: Repository, run: str, gb: float) -> int:
    rng = np.random.default_rng(0)
    tensors = []
    for i in range(max(1, round(gb * 1024 / TENSOR_MB))):
        values = (rng.standard_normal(TENSOR_MB * 2**20 // 4) * 0.02).astype(np.float32)
        tensors.append(Tensor(f"layer{i}.weight", "float32", values.shape,
                              memoryview(values).cast("B")))
    metadata = Metadata(1, 1, 0, None, time.strftime("%Y-%m-%dT%H:%M:%SZ"), "onprem", "bench")
    repository.create_run_key(run)
    repository.write_checkpoint(run, tensors, b"", metadata)
    return 1


def wait_verified(state: Path, run: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if SyncStateReader(state, missing_ok=True).verified_steps(run):
            return
        time.sleep(1)
    raise SystemExit(f"checkpoint-sync did not verify {run} within {timeout_s:.0f} s")


def delete_run(store, key: bytes, run: str, step: int, packs: list[str]) -> None:
    """The bench's run out of `store`: its packs (no other run shares them: chunk ids are
    keyed by the run's key), its manifest, pointer and key."""
    Repository(store, key).delete_checkpoint(run, step)
    for name in [*(pack_name(pack, run) for pack in packs), latest_name(run), key_name(run)]:
        store.delete(name)


def boto3_seconds(sandbox: Sandbox, packs: list[Path], scratch: Path) -> float:
    joined = scratch / "packs.bin"
    with open(joined, "wb") as out:
        for pack in packs:
            out.write(pack.read_bytes())
    joined.chmod(0o644)
    argv = [sys.executable, "-c", BOTO3_UPLOAD, sandbox.layout.s3_endpoint, str(joined),
            S3_BUCKET, f"bench/{uuid.uuid4().hex}"]
    done = netns.exec_in(sandbox.layout.topology, Site.HOME, argv, check=True,
                         env={**sandbox.s3_env(), "PATH": "/usr/bin:/bin"}, timeout=3600)
    return float(json.loads(done.stdout)["seconds"])


def measure(sandbox: Sandbox, mbit: int, gb: float) -> dict:
    layout = sandbox.layout
    site = load_config(layout.site_config)
    assert site.sync is not None
    netns.set_wan_rate(layout.topology, mbit)
    key = load_master_key(layout.master_key)
    pfs = LocalDirStore(layout.pfs_dir)
    home = Repository(pfs, key)
    run = f"bench-wan-{uuid.uuid4().hex[:8]}"
    step = write_checkpoint(home, run, gb)
    link_s = gb * 2**30 * 8 / (mbit * 1e6)
    wait_verified(site.sync.state, run, 300 + 4 * link_s)
    copy = SyncStateReader(site.sync.state).copied(run, step)
    assert copy.started_at is not None and copy.finished_at is not None
    sync_s = copy.finished_at - copy.started_at
    pack_ids = sorted({r.pack for r in with_bases(home.manifest(run, step).refs())})
    packs = [layout.pfs_dir / pack_name(pack, run) for pack in pack_ids]
    with tempfile.TemporaryDirectory(dir="/var/tmp") as scratch:
        boto_s = boto3_seconds(sandbox, packs, Path(scratch))
    offsite = site.stores[site.sync.destination]
    for store in (pfs, open_store(offsite.url, offsite.endpoint_url or None)):
        delete_run(store, key, run, step, pack_ids)
    return {"mbit": mbit, "bytes": copy.bytes, "sync_s": sync_s,
            "boto3_s": boto_s, "sync_mbit": copy.bytes * 8 / sync_s / 1e6,
            "boto3_mbit": copy.bytes * 8 / boto_s / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mbit", type=int, nargs="+", default=[200])
    parser.add_argument("--gb", type=float, default=1.0, help="checkpoint size (GiB)")
    args = parser.parse_args()
    sandbox = Sandbox(root_from_env(None))
    sandbox.up(progress=lambda _m: None)
    os.environ.update(sandbox.s3_env())  # the daemons' key, to delete the run off-site
    started = time.time()
    rows = [measure(sandbox, mbit, args.gb) for mbit in args.mbit]
    netns.set_wan_rate(sandbox.layout.topology, netns.remembered_wan_mbit(sandbox.layout))
    print(f"checkpoint-sync over the WAN, {args.gb:g} GiB of state, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, "
          f"{time.time() - started:.0f} s\n")
    print("| WAN | bytes copied | checkpoint-sync | of the link | boto3 upload_file | "
          "ours / boto3 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mbit']} Mbit/s | {r['bytes'] / 1e6:.0f} MB | {r['sync_s']:.1f} s, "
              f"{r['sync_mbit']:.1f} Mbit/s | {r['sync_mbit'] / r['mbit']:.3f} | "
              f"{r['boto3_s']:.1f} s, {r['boto3_mbit']:.1f} Mbit/s | "
              f"{r['boto3_s'] / r['sync_s']:.3f} |")


if __name__ == "__main__":
    main()
