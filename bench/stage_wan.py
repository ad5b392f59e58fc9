"""Staging a job's inputs over the sandbox's WAN (issue 31): a token dataset staged at
home, its snapshot copied to the rented site's S3 server by `stage.replicate.copy_snapshot`
(what checkpoint-sync runs for a job's world) from inside the home site, beside boto3's own
multipart upload (`upload_file`, its default TransferConfig) of the same pack bytes from
the home site, over the same shaped link, in one run. Target: staging at >= 80 % of the
link's rate at 200 and 50 Mbit/s.

Bytes on the wire are the kernel's: the home end of the home-remote veth, its transmit
counter before and after each copy (slurm_geo.sandbox.wire), never our accounting. The
rate of a copy is the payload (the snapshot's pack, key and manifest bytes) over its wall
time; its wire bytes over the payload is the overhead (TCP/IP, HTTP, S3 signing).

The copy uses as many streams as checkpoint-sync would for the link
(ckpt.transfer_plan.plan_transfers of the rate and the site's wan_rtt_ms). Staging itself
(walk, cuts, encryption into the home store) happens before, untimed: it is measured by
bench/stage_trees.py. Afterwards the tree is deleted from both stores.

Needs the sandbox (`slurm-geo sandbox up`). Run as root:
    python bench/stage_wan.py [--mbit 200 50] [--mb 256] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from stage_trees import dataset  # noqa: E402
from sync_wan import BOTO3_UPLOAD  # noqa: E402

from slurm_geo.ckpt.format.keys import load_master_key  # noqa: E402
from slurm_geo.ckpt.stores.store import LocalDirStore  # noqa: E402
from slurm_geo.ckpt.stores.transfer_plan import plan_transfers  # noqa: E402
from slurm_geo.config import load_config  # noqa: E402
from slurm_geo.sandbox import Sandbox, netns, root_from_env, wire  # noqa: E402
from slurm_geo.sandbox.layout import S3_BUCKET  # noqa: E402
from slurm_geo.sandbox.sites import Site, WanLink  # noqa: E402
from slurm_geo.stage.keys import MasterTreeKeys  # noqa: E402
from slurm_geo.stage.names import (  # noqa: E402
    snapshot_name,
    tree_id,
    tree_key_name,
    tree_latest_name,
    tree_naming_key,
    tree_pack_name,
)
from slurm_geo.stage.trees import Trees  # noqa: E402
from slurm_geo.stage.walk import LocalOpener  # noqa: E402

# Run in the home site: copy the snapshot to the off-site store, print the report.
COPY = """
import json, sys, time
from slurm_geo.ckpt.format.keys import load_master_key
from slurm_geo.ckpt.stores.open_store import open_store
from slurm_geo.ckpt.stores.store import LocalDirStore
from slurm_geo.ckpt.stores.transfer_plan import TransferPlan
from slurm_geo.stage.keys import MasterTreeKeys
from slurm_geo.stage.replicate import copy_snapshot
from slurm_geo.stage.trees import Trees
a = json.loads(sys.argv[1])
master = load_master_key(a["key"])
home = LocalDirStore(a["pfs"])
plan = TransferPlan(a["streams"], a["part"])
there = open_store(a["url"], a["endpoint"], plan=plan)
began = time.monotonic()
report = copy_snapshot(Trees(home, MasterTreeKeys(home, master)), home, there,
                       MasterTreeKeys(there, master), a["tree"], a["snapshot"],
                       streams=a["streams"])
print(json.dumps({"seconds": time.monotonic() - began, "bytes": report.bytes_copied,
                  "packs": report.packs_copied}))
"""



def in_home(sandbox: Sandbox, argv: list[str]) -> dict[str, Any]:
    env = {**sandbox.s3_env(), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    done = netns.exec_in(sandbox.layout.topology, Site.HOME, argv, check=False, env=env,
                         timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"in the home site: {done.stderr.strip()[-2000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def timed_on_wire(sandbox: Sandbox, argv: list[str], mbit: int,
                  reset: Callable[[], None] = lambda: None) -> tuple[dict[str, Any], int]:
    """`argv`'s report and the bytes the home end sent meanwhile. Measured again when the
    link's rate was not `mbit` at the end (another `sandbox up` on this sandbox re-applies
    the rate it remembers: the bench remembers its own meanwhile, but one may have read
    the old one): a figure is only kept from a run the link held its rate through."""
    topo = sandbox.layout.topology
    for _attempt in range(3):
        reset()  # what a copy cut short left there
        netns.set_wan_rate(topo, mbit)
        before = wire.link_bytes(topo, WanLink.HOME_REMOTE)
        result = in_home(sandbox, argv)
        after = wire.link_bytes(topo, WanLink.HOME_REMOTE)
        if netns.wan_state(topo).a.mbit == mbit:
            return result, wire.crossing(before, after).from_site(Site.HOME)
        print(f"the link's rate changed from {mbit} Mbit/s during a copy; measuring again",
              file=sys.stderr)
    raise SystemExit(f"the link would not hold {mbit} Mbit/s: something re-shapes it")


def measure(sandbox: Sandbox, mbit: int, tree: str, snapshot: int, pfs: LocalDirStore,
            names: list[str], payload: int, scratch: Path, there: Any,
            streams: int | None = None) -> dict[str, Any]:
    layout = sandbox.layout
    site = load_config(layout.site_config)
    assert site.sync is not None
    offsite = site.stores[site.sync.destination]
    plan = plan_transfers(mbit * 1e6 / 8, site.sync.wan_rtt_ms / 1e3)
    if streams is not None:
        plan = replace(plan, streams=streams)
    netns.remember_link_rate(layout, WanLink.HOME_REMOTE, mbit)
    args = {"key": str(layout.master_key), "pfs": str(layout.pfs_dir), "url": offsite.url,
            "endpoint": offsite.endpoint_url or None, "streams": plan.streams,
            "part": plan.part_size, "tree": tree, "snapshot": snapshot}
    ours, ours_wire = timed_on_wire(sandbox, [sys.executable, "-c", COPY, json.dumps(args)],
                                    mbit, lambda: delete_tree(there, names, tree))
    joined = scratch / "snapshot.bin"
    with open(joined, "wb") as out:
        for name in names:
            out.write(pfs.get(name))
    joined.chmod(0o644)
    boto, boto_wire = timed_on_wire(sandbox, [
        sys.executable, "-c", BOTO3_UPLOAD, layout.s3_endpoint, str(joined), S3_BUCKET,
        f"bench/{uuid.uuid4().hex}"], mbit)
    ours_mbit = payload * 8 / ours["seconds"] / 1e6
    boto_mbit = payload * 8 / boto["seconds"] / 1e6
    return {"mbit": mbit, "streams": plan.streams, "payload_bytes": payload,
            "ours_s": ours["seconds"], "ours_mbit": ours_mbit, "ours_of_link": ours_mbit / mbit,
            "ours_wire_bytes": ours_wire, "ours_wire_over_payload": ours_wire / payload,
            "boto3_s": boto["seconds"], "boto3_mbit": boto_mbit,
            "boto3_wire_bytes": boto_wire, "ours_over_boto3": ours_mbit / boto_mbit}


def delete_tree(store: Any, names: list[str], tree: str) -> None:
    for name in [*names, tree_latest_name(tree)]:
        try:
            store.delete(name)
        except Exception:  # noqa: BLE001 - best effort: a bench's throw-away objects
            pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mbit", type=int, nargs="+", default=[200, 50])
    parser.add_argument("--mb", type=int, default=256, help="dataset size (MB)")
    parser.add_argument("--streams", type=int, nargs="+", default=None,
                        help="copy with these stream counts too (default: the plan's only)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sandbox = Sandbox(root_from_env(None))
    sandbox.up(progress=lambda _m: None)
    layout = sandbox.layout
    master = load_master_key(layout.master_key)
    pfs = LocalDirStore(layout.pfs_dir)
    trees = Trees(pfs, MasterTreeKeys(pfs, master))
    started = time.time()
    remembered = netns.remembered_wan_mbit(layout)
    rows = []
    with tempfile.TemporaryDirectory(dir="/var/tmp") as scratch:
        data = Path(scratch) / "tokens"
        dataset(data, args.mb, 8)
        tree = tree_id(tree_naming_key(os.urandom(32)), f"bench:{uuid.uuid4().hex}")
        staged = trees.stage(tree, LocalOpener(data), str(data))
        manifest = staged.manifest
        packs = sorted({tree_pack_name(manifest.domain, ref.pack) for ref in manifest.refs()})
        names = [tree_key_name(manifest.domain), *packs,
                 snapshot_name(tree, manifest.snapshot)]
        payload = sum(len(pfs.get(name)) for name in names)
        site = load_config(layout.site_config)
        assert site.sync is not None
        offsite = site.stores[site.sync.destination]
        from slurm_geo.ckpt.stores.open_store import open_store
        os.environ.update(sandbox.s3_env())
        there = open_store(offsite.url, offsite.endpoint_url or None)
        try:
            for mbit in args.mbit:
                for streams in args.streams or [None]:
                    rows.append(measure(sandbox, mbit, tree, manifest.snapshot, pfs, names,
                                        payload, Path(scratch), there, streams))
        finally:
            delete_tree(there, names, tree)
            delete_tree(pfs, names, tree)
            netns.remember_link_rate(layout, WanLink.HOME_REMOTE, remembered)
            netns.set_wan_rate(layout.topology, remembered)
    if args.json:
        print(json.dumps({"started": started, "mb": args.mb, "rows": rows}, indent=2))
        return
    print(f"staging over the WAN, a {args.mb} MB token dataset "
          f"({payload / 1e6:.1f} MB staged), "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, "
          f"{time.time() - started:.0f} s\n")
    print("| WAN | streams | staged copy | of the link | wire / payload | "
          "boto3 upload_file | ours / boto3 |")
    print("|---|--:|---|--:|--:|---|--:|")
    for r in rows:
        print(f"| {r['mbit']} Mbit/s | {r['streams']} | {r['ours_s']:.1f} s, "
              f"{r['ours_mbit']:.1f} Mbit/s | {r['ours_of_link']:.3f} | "
              f"{r['ours_wire_over_payload']:.3f} | {r['boto3_s']:.1f} s, "
              f"{r['boto3_mbit']:.1f} Mbit/s | {r['ours_over_boto3']:.3f} |")


if __name__ == "__main__":
    main()
