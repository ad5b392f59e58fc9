"""`slurm-geo sync ...`: what checkpoint-sync has replicated, and requeueing what failed."""

from __future__ import annotations

import json
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from slurm_geo.cells import table

if TYPE_CHECKING:
    from slurm_geo.sync.follow import Followed

state_option = click.option(
    "--state", "state_path", type=click.Path(path_type=Path), default=None,
    help="The state database (default: [sync] state of the slurm-geo config).")
json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
config_option = click.option(
    "--config", type=click.Path(path_type=Path), default=None,
    help="Site config (default: $SLURM_GEO_CONFIG or /etc/slurm-geo/config.toml).")

_COLUMNS = ["run", "destination", "newest", "verified", "pending", "uploading", "replicated",
            "failed", "corrupted", "skipped", "lag_s", "jobs", "error"]
_SOURCE_COLUMNS = ["source", "kind", "status", "jobs", "detail"]


@click.group()
def sync() -> None:
    """Checkpoint replication state kept by the checkpoint-sync daemon."""


@sync.command()
@state_option
@config_option
@json_option
def status(state_path: Path | None, config: Path | None, as_json: bool) -> None:
    """Per run and destination: newest checkpoint, newest verified, counts, lag; and each
    registered job's checkpoint directory, with what checkpoint-sync sees there."""
    from slurm_geo.sync.state import StateDB
    from slurm_geo.sync.truth import failing_runs
    from slurm_geo.sync.worldstate import read_worlds

    path = _state_path(state_path, config)
    state = StateDB(path, readonly=True)
    try:
        replicas, sources = state.replicas(), state.sources()
    finally:
        state.close()
    rows = status_rows(replicas, sources, time.time())
    worlds = world_summaries(read_worlds(path), time.time())
    for row in rows:
        row["world"] = worlds.get((row["run"], row["destination"]))
    for source in sources:
        if source.status.is_problem:  # on stderr too: never lost in a long table
            click.echo(f"slurm-geo: warning: {_named(source)}: {source.detail}", err=True)
    for failing in failing_runs(replicas):  # a run whose checkpoints go nowhere, said so
        click.echo(f"slurm-geo: warning: {failing.line()}", err=True)
    for line in _store_warnings(config) if config or not state_path else ():
        click.echo(f"slurm-geo: warning: {line}", err=True)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    runs = [r for r in rows if r["run"] is not None]
    shown = [s for s in sources if _listed(s)]
    click.echo(_table(runs, _COLUMNS) if runs else "no checkpoints seen yet")
    from slurm_geo.cli.progress import human_bytes, human_seconds

    staged = [{"run": r["run"], "destination": r["destination"], **r["world"],
               "staged": human_bytes(r["world"]["staged_bytes"]),
               "pending": human_bytes(r["world"]["pending_bytes"]),
               "lag": human_seconds(r["world"]["lag_s"])}
              for r in runs if r["world"] is not None]
    if staged:
        click.echo("\n" + _table(staged, _WORLD_COLUMNS, wrap=False))
    if shown:
        click.echo("\n" + _table([_source_row(s) for s in shown], _SOURCE_COLUMNS, wrap=False))


@sync.command()
@click.argument("run")
@click.option("--destination", default=None, help="Only replicas at this destination.")
@click.option("--wait", is_flag=True,
              help="Follow the requeued replicas until checkpoint-sync has verified them "
                   "(or they fail again: exit 1), showing the bytes it sends.")
@state_option
@config_option
@json_option
def retry(run: str, destination: str | None, wait: bool, state_path: Path | None,
          config: Path | None, as_json: bool) -> None:
    """Requeue RUN's failed and corrupted replicas with a fresh budget of attempts."""
    from slurm_geo.cli.ckpt_targets import NoSuchCheckpoint
    from slurm_geo.cli.progress import progress
    from slurm_geo.sync.follow import Followed, follow
    from slurm_geo.sync.state import StateDB

    started = time.monotonic()
    state = StateDB(_state_path(state_path, config))
    try:
        if not state.replicas("run = ?", [run]):
            raise NoSuchCheckpoint(run, f"run '{run}' has no replicas in {state.path}; "
                                        "see `slurm-geo sync status`")
        requeued = state.requeue(run, destination, time.time())
        followed = Followed({}, 0)
        if wait and requeued:
            with progress(f"retry {run}", as_json) as bar:
                followed = follow(state, [r.id for r in requeued], bar)
    finally:
        state.close()
    rows = [{"step": r.step, "destination": r.destination, "was": r.status.value,
             "now": followed.statuses[r.id].value if wait else "pending"} for r in requeued]
    if as_json:
        click.echo(json.dumps({"run": run, "destination": destination, "requeued": rows,
                               "waited": wait, "ok": followed.ok, "bytes": followed.bytes,
                               "seconds": round(time.monotonic() - started, 3)}, indent=2))
    elif not requeued:
        click.echo(f"{run}: nothing failed or corrupted to requeue")
    else:
        steps = ", ".join(f"{r.step} ({r.status.value})" for r in requeued)
        click.echo(f"{run}: requeued {len(requeued)} replica(s): {steps}" + (
            "" if wait else "; checkpoint-sync picks them up at its next scan"))
    if wait and requeued:
        _say_followed(run, rows, followed, time.monotonic() - started, as_json)


def _say_followed(run: str, rows: list[dict[str, Any]], followed: Followed, seconds: float,
                  as_json: bool) -> None:
    """After --wait: a summary, or the replicas that failed again (exit 1)."""
    from slurm_geo.cli.progress import human_bytes

    again = [row for row in rows if row["now"] not in ("verified", "skipped")]
    for row in again if not as_json else []:
        click.echo(f"slurm-geo: error: {run}@{row['step']} at {row['destination']}: "
                   f"{row['now']} again; see `slurm-geo sync status`", err=True)
    if not as_json and not again:
        ends = ", ".join(f"{count} {now}" for now, count in
                         sorted(Counter(row["now"] for row in rows).items()))
        click.echo(f"{run}: {ends}; checkpoint-sync sent {human_bytes(followed.bytes)} in "
                   f"{seconds:.1f} s")
    if again:
        raise SystemExit(1)


_WORLD_COLUMNS = ["run", "destination", "world", "trees", "staged", "pending", "lag",
                  "error"]


def world_summaries(rows: list[Any], now: float = 0.0) -> dict[tuple[str, str],
                                                               dict[str, Any]]:
    """(run, destination) -> what checkpoint-sync copied of the run's world there
    (docs/checkpoint-sync.md, "A run's world"): complete or not, pinned trees, pack bytes
    there and still to copy, or refused (a root's data class may not reside in the
    destination's region; the reason in `error`), and the staging lag at `now` (seconds
    the home record it last read has waited to be whole there); runs that staged no world
    are left out."""
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:
        if row.record_sha256 is None:
            continue
        found[(row.run, row.destination)] = {
            "world": "complete" if row.complete else "copying" if row.refused is None
            else "refused", "trees": row.trees,
            "staged_bytes": row.bytes_there, "pending_bytes": row.pending_bytes,
            "lag_s": round(row.lag_s(now), 1), "error": row.last_error or row.refused}
    return found


def run_summaries(replicas: list[Any], now: float) -> list[dict[str, Any]]:
    """One row per (run, destination): newest step seen, newest verified, counts by status,
    and the lag: how long the newest unverified checkpoint (newer than the newest verified)
    has waited; 0 when the newest is verified."""
    groups: dict[tuple[str, str], list[Any]] = defaultdict(list)
    for replica in replicas:
        groups[(replica.run, replica.destination)].append(replica)
    return [_summary(run, destination, rows, now)
            for (run, destination), rows in sorted(groups.items())]


def status_rows(replicas: list[Any], sources: list[Any], now: float) -> list[dict[str, Any]]:
    """`run_summaries`, each with the roots its checkpoints come from, the registered jobs
    of those roots and what checkpoint-sync saw there (`source`, `source_detail`: the
    worst of them); then a row with run None for each job directory with no checkpoint
    seen, and for each root or registry that cannot be read."""
    by_root = {s.root: s for s in sources}
    roots: dict[tuple[str, str], set[str]] = defaultdict(set)
    for replica in replicas:
        roots[(replica.run, replica.destination)].add(replica.root)
    rows = []
    for summary in run_summaries(replicas, now):
        named = sorted(roots[(summary["run"], summary["destination"])])
        rows.append({**summary, "roots": named,
                     **_about([by_root[r] for r in named if r in by_root])})
    used = {root for named in roots.values() for root in named}
    for source in sources:
        if source.root in used or not _listed(source):
            continue
        rows.append({"run": None, "destination": None, "newest": None, "verified": None,
                     **{k: 0 for k in ("pending", "uploading", "replicated", "failed",
                                       "corrupted", "skipped", "verified_count")},
                     "lag_s": None, "error": source.detail, "roots": [source.root],
                     **_about([source])})
    return rows


def _listed(source: Any) -> bool:
    """Shown on its own: a job directory still of interest, or a source that is broken."""
    return source.status.is_problem or (source.kind == "job"
                                        and source.status.value != "released")


def _about(sources: list[Any]) -> dict[str, Any]:
    worst = next((s for s in sources if s.status.is_problem), sources[0] if sources else None)
    return {"jobs": list(dict.fromkeys(job for s in sources for job in s.jobs)),
            "source": worst.status.value if worst else None,
            "source_detail": worst.detail if worst else None}


def _named(source: Any) -> str:
    if source.kind == "job":
        return f"job {', '.join(source.jobs)}" if source.jobs else source.path
    return "the job registry" if source.kind == "registry" else f"root {source.root}"


def _source_row(source: Any) -> dict[str, Any]:
    return {"source": source.path, "kind": source.kind, "status": source.status.value,
            "jobs": ",".join(source.jobs) or None, "detail": source.detail}


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


def _store_warnings(config: Path | None) -> list[str]:
    """The home cluster's store, where a FederatedRun saves, when checkpoint-sync does
    not replicate it (slurm_geo.lease.places); nothing without a readable config."""
    from slurm_geo.config.model import load_config
    from slurm_geo.errors import ConfigError
    from slurm_geo.lease.places import SyncFacts, unreplicated_stores

    try:
        site = load_config(config)
    except ConfigError:
        return []
    if site.sync is None:
        return []
    stores = {name: (cluster.store, site.stores[cluster.store].url)
              for name, cluster in site.clusters.items() if cluster.store in site.stores}
    return unreplicated_stores(stores, SyncFacts(site.sync.roots, site.sync.destination,
                                                 site.home_cluster))


def _state_path(explicit: Path | None, config: Path | None) -> Path:
    if explicit is not None:
        return explicit
    from slurm_geo.config.model import load_config
    from slurm_geo.errors import ConfigError

    site = load_config(config)
    if site.sync is None:
        raise ConfigError(f"{site.source} has no [sync] table; give --state PATH")
    return site.sync.state


def _table(rows: list[dict[str, Any]], columns: list[str], wrap: bool = True) -> str:
    """Aligned columns; long cells are cut unless `wrap` is off (the last column whole)."""
    def cell(row: dict[str, Any], column: str) -> str:
        value = ",".join(value) if isinstance(value := row.get(column), list) else value
        if value in (None, ""):
            return "-"
        text = str(value)
        return text if len(text) <= 60 or not wrap else text[:57] + "..."

    return table([[c.upper() for c in columns]] + [[cell(r, c) for c in columns] for r in rows])


from slurm_geo.cli.sync_scrub import scrub_here  # noqa: E402  (its own module: it holds no key)

sync.add_command(scrub_here)
