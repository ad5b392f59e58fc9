"""What `slurm-geo ckpt ls` and `ckpt stats` print about sizes, stored bytes, dedup and
off-site replicas (the arithmetic: slurm_geo.ckpt.ops.usage; off-site: slurm_geo.sync.offsite)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import click

from slurm_geo.ckpt.format.manifest import Manifest
from slurm_geo.ckpt.ops.usage import RunUsage, checkpoint_usage, run_usage, store_usage
from slurm_geo.cli.progress import human_bytes
from slurm_geo.errors import SlurmGeoError

LS_COLUMNS = ["run", "step", "epoch", "loss", "created_at", "cluster", "job_id", "latest",
              "promoted", "size", "added", "dedup", "off-site"]
STATS_COLUMNS = ["run", "checkpoints", "size", "stored", "packs", "dedup"]
STORE_ROW = "(store)"  # no run id has parentheses

Offsite = Mapping[tuple[str, int], Any] | None  # (run, step) -> Status; None: not known


def human_ratio(ratio: float | None) -> str | None:
    return None if ratio is None else f"{ratio:.1f}x"


def manifests_of(repository: Any, runs: Sequence[str]) -> list[Manifest]:
    """Every checkpoint's manifest of `runs`, by run and step."""
    return [repository.manifest(run, step) for run in runs for step in repository.steps(run)]


def listing_rows(manifests: Sequence[Manifest], latest: Mapping[str, int | None],
                 promoted: Callable[[Manifest], bool], offsite: Offsite) -> list[dict[str, Any]]:
    """`ckpt ls --json`: one row per manifest, by run and step, exact integers."""
    from slurm_geo.sync.offsite import UNSEEN

    by_key = {(m.run, m.step): m for m in manifests}
    rows = []
    for usage in checkpoint_usage(manifests):
        manifest = by_key[(usage.run, usage.step)]
        meta = manifest.metadata
        status = None if offsite is None else offsite.get((usage.run, usage.step), UNSEEN)
        rows.append({"run": usage.run, "step": usage.step, "epoch": meta.epoch,
                     "loss": meta.loss, "created_at": meta.created_at, "cluster": meta.cluster,
                     "job_id": meta.job_id, "latest": usage.step == latest.get(usage.run),
                     "promoted": promoted(manifest), "logical_bytes": usage.logical_bytes,
                     "referenced_bytes": usage.referenced_bytes,
                     "added_bytes": usage.added_bytes, "dedup_ratio": usage.dedup_ratio,
                     "offsite": None if status is None else status.value})
    return rows


def human_listing(row: dict[str, Any]) -> dict[str, Any]:
    return {**row, "size": human_bytes(row["logical_bytes"]),
            "added": human_bytes(row["added_bytes"]),
            "dedup": human_ratio(row["dedup_ratio"]), "off-site": row["offsite"]}


def offsite_of(store_spec: str, sync_state: Path | None, config: Path | None) -> Offsite:
    """The off-site status of the store's checkpoints: from `sync_state` (its errors
    raised), else from the config's [sync] state (None, with a warning, when it cannot
    be read); None when neither names one or the state does not replicate this store."""
    from slurm_geo.config.model import config_path_from_env, load_config
    from slurm_geo.sync.offsite import place, read_offsite

    names = [store_spec]
    try:
        path = config or config_path_from_env()
        site = load_config(path) if path.exists() else None
        for name, store in site.stores.items() if site is not None else ():
            if store_spec == name or place(store_spec) == place(store.url):
                names += [name, store.url]  # the state may name a root either way
        if sync_state is not None:
            return read_offsite(sync_state, names)
        return None if site is None or site.sync is None else read_offsite(site.sync.state,
                                                                            names)
    except SlurmGeoError as exc:
        if sync_state is not None:
            raise
        click.echo(f"slurm-geo: warning: OFF-SITE not shown: {exc}", err=True)
        return None


def stats_document(store: str, manifests: Sequence[Manifest], pack_sizes: Mapping[str, int],
                   whole_store: bool) -> dict[str, Any]:
    """`ckpt stats --json`: per run, and the store's total when every run is in."""
    if not whole_store:
        return {"store": store, "runs": [_run_json(r) for r in run_usage(manifests, pack_sizes)],
                "total": None}
    usage = store_usage(manifests, pack_sizes)
    return {"store": store, "runs": [_run_json(r) for r in usage.runs], "total": {
        "runs": len(usage.runs), "checkpoints": usage.checkpoints,
        "logical_bytes": usage.logical_bytes, "stored_bytes": usage.stored_bytes,
        "pack_bytes": usage.pack_bytes, "unreferenced_pack_bytes":
            usage.unreferenced_pack_bytes, "dedup_ratio": usage.dedup_ratio}}


def stats_lines(document: dict[str, Any]) -> tuple[list[dict[str, Any]], str | None]:
    """The table rows of `ckpt stats` (the store's last) and a note on unreferenced packs."""
    total = document["total"]
    rows = [_human_stats(r) for r in document["runs"]]
    if total is None:
        return rows, None
    rows.append(_human_stats({**total, "run": STORE_ROW}))
    unreferenced = total["unreferenced_pack_bytes"]
    note = (f"{human_bytes(unreferenced)} of packs no checkpoint references "
            "(`slurm-geo ckpt gc` deletes them)") if unreferenced else None
    return rows, note


def _run_json(usage: RunUsage) -> dict[str, Any]:
    return {"run": usage.run, "checkpoints": usage.checkpoints,
            "logical_bytes": usage.logical_bytes, "stored_bytes": usage.stored_bytes,
            "pack_bytes": usage.pack_bytes, "dedup_ratio": usage.dedup_ratio}


def _human_stats(row: dict[str, Any]) -> dict[str, Any]:
    return {"run": row["run"], "checkpoints": row["checkpoints"],
            "size": human_bytes(row["logical_bytes"]),
            "stored": human_bytes(row["stored_bytes"]), "packs": human_bytes(row["pack_bytes"]),
            "dedup": human_ratio(row["dedup_ratio"])}
