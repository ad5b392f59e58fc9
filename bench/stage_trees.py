"""Staged trees (issue 31; docs/format.md §11): stored bytes and throughput.

(a) A synthetic token dataset (random uint16 arrays in a few .bin shards, 1 GB by
    default): staged once; then again after 1 % of its tokens were rewritten in place, as
    one region of one shard (bytes stored: about that region plus a chunk either side);
    then once more unchanged (nothing read, nothing stored). Verified and materialised.
(b) Two virtualenvs that share most files: the site's venv (/var/lib/slurm-geo/site-python,
    torch included) and a copy of it (hard links, so the copy costs no disk) in which a
    package was added and a few files rewritten. Both staged in one key domain (a user's
    environments, §11.2), the second after the first: what it stores is its difference.
    Staged as its own domain instead (the default: a tree per root), it would store its
    whole size again, the first venv's figure: chunks are never shared across keys.

The store is a local directory; the sources were just written or read, so they come from
the page cache: the figures are the staging pipeline's (walk, cuts, BLAKE3, zstd,
AES-GCM, the store's writes), not a disk's. Prints Markdown; --json for the figures.

    python bench/stage_trees.py [--dataset-mb 1024] [--shards 8] [--venv PATH] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from slurm_geo.ckpt.format.keys import KeyFile
from slurm_geo.ckpt.stores.store import Bytes, LocalDirStore
from slurm_geo.stage.keys import MasterTreeKeys
from slurm_geo.stage.names import tree_id, tree_naming_key
from slurm_geo.stage.trees import Staged, Trees
from slurm_geo.stage.walk import LocalOpener

MB = 1e6
SITE_VENV = Path("/var/lib/slurm-geo/site-python")


class CountingStore(LocalDirStore):
    def __init__(self, root: Path):
        super().__init__(root)
        self.put_bytes = self.manifest_bytes = 0

    def put(self, name: str, data: Bytes) -> None:
        super().put(name, data)
        self.put_bytes += len(data)
        if name.startswith("trees/"):
            self.manifest_bytes += len(data)


def timed(action: Callable[[], object]) -> tuple[object, float, float]:
    cpu, began = time.process_time(), time.perf_counter()
    result = action()
    return result, time.perf_counter() - began, time.process_time() - cpu


def row(case: str, logical: int, staged: Staged | None, stored: int, wall: float,
        cpu: float, files: int) -> dict[str, Any]:
    """`mb_per_s`: the tree's bytes over the wall time; `read_mb_per_s`: the bytes read
    and cut (a staging's pipeline rate; unchanged files are not read)."""
    read = logical if staged is None else staged.bytes_read
    return {"case": case, "logical_bytes": logical, "files": files, "stored_bytes": stored,
            "stored_fraction": stored / logical if logical else 0.0,
            "files_read": None if staged is None else staged.files_read,
            "bytes_read": read, "wall_s": wall, "cpu_s": cpu,
            "mb_per_s": logical / MB / wall if wall else 0.0,
            "read_mb_per_s": read / MB / wall if wall else 0.0}


def stage_row(case: str, trees: Trees, store: CountingStore, tree: str, root: Path,
              domain: str | None = None, shares_with: tuple[str, ...] = ()
              ) -> dict[str, Any]:
    before, manifests = store.put_bytes, store.manifest_bytes
    staged, wall, cpu = timed(lambda: trees.stage(tree, LocalOpener(root), f"home:{root}",
                                                  domain, shares_with))
    assert isinstance(staged, Staged)
    manifest = staged.manifest
    files = sum(1 for _ in manifest.files())
    result = row(case, manifest.total_bytes, staged, store.put_bytes - before, wall, cpu, files)
    result["manifest_bytes"] = store.manifest_bytes - manifests
    return result


def dataset(root: Path, total_mb: int, shards: int, seed: int = 31) -> None:
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True)
    per_shard = total_mb * 1_000_000 // shards // 2  # tokens
    for i in range(shards):
        rng.integers(0, 50_257, per_shard, dtype=np.uint16).tofile(root / f"train-{i:03d}.bin")


def change_one_percent(root: Path, seed: int = 32) -> int:
    """Rewrite 1 % of the dataset's tokens in place, one region in the middle of a shard."""
    shards = sorted(root.glob("*.bin"))
    total = sum(p.stat().st_size for p in shards)
    length = total // 100 // 2 * 2
    shard = shards[len(shards) // 2]
    start = (shard.stat().st_size - length) // 2 // 2 * 2
    tokens = np.random.default_rng(seed).integers(0, 50_257, length // 2, dtype=np.uint16)
    with open(shard, "r+b") as handle:
        handle.seek(start)
        handle.write(tokens.tobytes())
    return length


def bench_dataset(work: Path, total_mb: int, shards: int) -> list[dict[str, Any]]:
    data, store_dir = work / "tokens", work / "store-tokens"
    dataset(data, total_mb, shards)
    store_dir.mkdir()
    store = CountingStore(store_dir)
    trees = Trees(store, MasterTreeKeys(store, KeyFile(os.urandom(32))))
    tree = tree_id(tree_naming_key(os.urandom(32)), f"home:{data}")
    rows = [stage_row("tokens: first staging", trees, store, tree, data)]
    changed = change_one_percent(data)
    after = stage_row(f"tokens: again after 1 % ({changed / MB:.1f} MB) changed", trees,
                      store, tree, data)
    after["changed_bytes"] = changed
    rows.append(after)
    rows.append(stage_row("tokens: again, unchanged", trees, store, tree, data))
    latest = trees.latest(tree)
    assert latest is not None
    logical = trees.manifest(tree, latest).total_bytes
    _, wall, cpu = timed(lambda: trees.verify(tree, latest))
    rows.append(row("tokens: verify (packs hashed, chunks checked)", logical, None, 0, wall,
                    cpu, shards))
    _, wall, cpu = timed(lambda: trees.materialise(tree, latest, work / "tokens-out"))
    rows.append(row("tokens: materialise", logical, None, 0, wall, cpu, shards))
    same = subprocess.run(["diff", "-r", "-q", str(data), str(work / "tokens-out")],
                          capture_output=True, text=True)
    assert same.returncode == 0, same.stdout
    return rows


def second_venv(source: Path, copy: Path) -> None:
    """A copy by hard links, then a different environment: one more package (a copy of a
    small one under another name) and a few files rewritten (new inodes)."""
    subprocess.run(["cp", "-al", str(source), str(copy)], check=True)
    site = next(copy.glob("lib/python3*/site-packages"))
    small = next(p for p in sorted(site.iterdir())
                 if p.is_dir() and not p.is_symlink() and 50_000 < _size(p) < 2_000_000)
    shutil.copytree(small, site / f"{small.name}_extra", symlinks=True)
    for path in sorted(site.glob("*.dist-info/RECORD"))[:20]:
        text = path.read_bytes()
        path.unlink()
        path.write_bytes(text + b"# changed\n")


def _size(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def bench_venvs(work: Path, venv: Path) -> list[dict[str, Any]]:
    copy = work / "venv-b"
    second_venv(venv, copy)
    store_dir = work / "store-venvs"
    store_dir.mkdir()
    store = CountingStore(store_dir)
    master = os.urandom(32)
    trees = Trees(store, MasterTreeKeys(store, KeyFile(master)))
    naming = tree_naming_key(master)
    domain = tree_id(naming, "environments:alice")
    tree_a, tree_b = tree_id(naming, f"home:{venv}"), tree_id(naming, f"home:{copy}")
    return [
        stage_row(f"venv A ({venv})", trees, store, tree_a, venv, domain),
        stage_row("venv B: A + one package, 20 files rewritten (A's domain, sharing A)",
                  trees, store, tree_b, copy, domain, (tree_a,)),
        stage_row("venv B again, unchanged", trees, store, tree_b, copy, domain, (tree_a,)),
    ]


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return (f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, "
            f"load {os.getloadavg()[0]:.1f}")


def render(rows: list[dict[str, Any]]) -> str:
    lines = ["| case | files | tree MB | stored MB (manifest) | stored / tree | files read "
             "| MB read | wall s | CPU s | tree MB/s | read MB/s |",
             "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        read = "-" if r["files_read"] is None else str(r["files_read"])
        manifest = f" ({r['manifest_bytes'] / MB:.2f})" if r.get("manifest_bytes") else ""
        lines.append(
            f"| {r['case']} | {r['files']} | {r['logical_bytes'] / MB:.1f} "
            f"| {r['stored_bytes'] / MB:.2f}{manifest} | {r['stored_fraction']:.2%} | {read} "
            f"| {r['bytes_read'] / MB:.1f} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} "
            f"| {r['mb_per_s']:.0f} | {r['read_mb_per_s']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset-mb", type=int, default=1024, help="dataset size (MB)")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--venv", type=Path, default=SITE_VENV,
                        help="the first virtualenv (default: the site's, with torch)")
    parser.add_argument("--skip-venv", action="store_true")
    parser.add_argument("--workdir", type=Path, default=Path("/var/tmp"),
                        help="where the dataset, the copies and the stores go")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    began = time.perf_counter()
    header = machine()
    with tempfile.TemporaryDirectory(prefix="stage-bench-", dir=args.workdir) as tmp:
        rows = bench_dataset(Path(tmp), args.dataset_mb, args.shards)
        if not args.skip_venv:
            rows += bench_venvs(Path(tmp), args.venv)
    if args.json:
        json.dump({"machine": header, "rows": rows}, sys.stdout, indent=1)
        print()
        return
    print(f"Machine: {header}; {time.perf_counter() - began:.0f} s in all\n")
    print(render(rows))


if __name__ == "__main__":
    main()
