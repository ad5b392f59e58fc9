"""`slurm-geo sync ...`: what checkpoint-sync has replicated, and requeueing what failed."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import click

state_option = click.option(
    "--state", "state_path", type=click.Path(path_type=Path), default=None,
    help="The state database (default: [sync] state of the slurm-geo config).")
json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")

_COLUMNS = ["run", "destination", "newest", "verified", "pending", "uploading", "replicated",
            "failed", "corrupted", "skipped", "lag_s", "error"]


@click.group()
def sync() -> None:
    """Checkpoint replication state kept by the checkpoint-sync daemon."""


@sync.command()
@state_option
@json_option
def status(state_path: Path | None, as_json: bool) -> None:
    """Per run and destination: newest checkpoint, newest verified, counts, lag."""
    from slurm_geo.sync.state import StateDB

    state = StateDB(_state_path(state_path), readonly=True)
    try:
        rows = run_summaries(state.replicas(), time.time())
    finally:
        state.close()
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    elif not rows:
        click.echo("no checkpoints seen yet")
    else:
        click.echo(_table(rows))


@sync.command()
@click.argument("run")
@click.option("--destination", default=None, help="Only replicas at this destination.")
@state_option
def retry(run: str, destination: str | None, state_path: Path | None) -> None:
    """Requeue RUN's failed and corrupted replicas with a fresh budget of attempts."""
    from slurm_geo.sync.state import StateDB, SyncError

    state = StateDB(_state_path(state_path))
    try:
        if not state.replicas("run = ?", [run]):
            raise SyncError(f"run '{run}' has no replicas in {state.path}; see "
                            "`slurm-geo sync status`")
        requeued = state.requeue(run, destination, time.time())
    finally:
        state.close()
    if not requeued:
        click.echo(f"{run}: nothing failed or corrupted to requeue")
        return
    steps = ", ".join(f"{r.step} ({r.status.value})" for r in requeued)
    click.echo(f"{run}: requeued {len(requeued)} replica(s): {steps}; checkpoint-sync picks "
               "them up at its next scan")


def run_summaries(replicas: list[Any], now: float) -> list[dict[str, Any]]:
    """One row per (run, destination): newest step seen, newest verified, counts by status,
    and the lag: how long the newest unverified checkpoint (newer than the newest verified)
    has waited; 0 when the newest is verified."""
    groups: dict[tuple[str, str], list[Any]] = defaultdict(list)
    for replica in replicas:
        groups[(replica.run, replica.destination)].append(replica)
    return [_summary(run, destination, rows, now)
            for (run, destination), rows in sorted(groups.items())]


def _summary(run: str, destination: str, rows: list[Any], now: float) -> dict[str, Any]:
    counts: dict[str, int] = defaultdict(int)
    for r in rows:
        counts[r.status.value] += 1
    verified = [r.step for r in rows if r.status.value == "verified"]
    newest_verified = max(verified, default=None)
    waiting = [r for r in rows if r.status.value not in ("verified", "skipped")
               and (newest_verified is None or r.step > newest_verified)]
    since = min((r.created_at or r.discovered_at for r in waiting), default=None)
    errors = [r for r in sorted(rows, key=lambda r: -r.step) if r.last_error
              and r.status.value in ("failed", "corrupted", "pending", "replicated")]
    return {
        "run": run, "destination": destination, "newest": max(r.step for r in rows),
        "verified": newest_verified,
        **{s: counts[s] for s in ("pending", "uploading", "replicated", "failed",
                                  "corrupted", "skipped")},
        "verified_count": counts["verified"],
        "lag_s": 0.0 if since is None else round(max(0.0, now - since), 1),
        "error": errors[0].last_error if errors else None,
    }


def _state_path(explicit: Path | None) -> Path:
    if explicit is not None:
        return explicit
    from slurm_geo.config.model import load_config
    from slurm_geo.errors import ConfigError

    site = load_config()
    if site.sync is None:
        raise ConfigError(f"{site.source} has no [sync] table; give --state PATH")
    return site.sync.state


def _table(rows: list[dict[str, Any]]) -> str:
    def cell(row: dict[str, Any], column: str) -> str:
        value = row[column]
        if value is None:
            return "-"
        text = str(value)
        return text if len(text) <= 60 else text[:57] + "..."

    cells = [[c.upper() for c in _COLUMNS]] + [[cell(r, c) for c in _COLUMNS] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(_COLUMNS))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip()
                     for r in cells)
