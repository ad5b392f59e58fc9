"""`slurm-geo ckpt ...` and `slurm-geo keys ...`: move, inspect and verify checkpoints."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import click

from slurm_geo.cells import cell, table
from slurm_geo.cli.ckpt_files import pull_multi_rank, pull_tensor_file, push_tensor_file
from slurm_geo.cli.ckpt_targets import no_run, only_run, parse_target, require_run
from slurm_geo.cli.options import chosen_config, config_option
from slurm_geo.cli.progress import progress
from slurm_geo.config.paths import DEFAULT_KEY_FILE, KEY_FILE_ENV, master_key_path
from slurm_geo.errors import ConfigError

if TYPE_CHECKING:
    from slurm_geo.federation.state.etcd.reseal import SealedState

key_file_option = click.option(
    "--key-file", type=click.Path(path_type=Path), default=None,
    callback=lambda _ctx, _param, value: master_key_path(value, os.environ),
    help=f"The site master key (0600) [default: ${KEY_FILE_ENV}, else {DEFAULT_KEY_FILE}].")
json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


def store_option(flag: str, help_text: str):
    """The store flag, and --config for a store named in the config."""
    store = click.option(flag, "store_url", required=True, metavar="STORE",
                         help=f"{help_text}: file:///PATH, s3://BUCKET/PREFIX, or a store "
                              "name from the slurm-geo config.")
    return lambda command: store(config_option(command))


@click.group()
def keys() -> None:
    """Create and rotate the site master key that wraps every run's data key."""


@keys.command("init")
@click.argument("path", type=click.Path(path_type=Path))
@json_option
def keys_init(path: Path, as_json: bool) -> None:
    """Create a new master key file at PATH (mode 0600; refuses to overwrite)."""
    from slurm_geo.ckpt import create_master_key_file
    from slurm_geo.ckpt.format.keys import fingerprint

    if path.exists():
        raise ConfigError(f"{path} already exists; a new key would orphan every checkpoint "
                          "sealed under the old one. Choose another path.")
    key = create_master_key_file(path)
    _report({"key_file": str(path), "fingerprint": fingerprint(key).hex()}, as_json,
            "created master key {key_file} ({fingerprint}; keep it on-prem; back it up "
            "offline)")


@keys.command("rotate")
@click.option("--store", "store_specs", multiple=True, required=True, metavar="STORE",
              help="A store to re-seal: file:///PATH, s3://BUCKET/PREFIX, or a store name "
                   "from the slurm-geo config. Repeat it for every store of the site.")
@click.option("--dry-run", is_flag=True,
              help="Report what would be sealed again; write nothing, the key file included.")
@click.option("--federation-state", "federation_state", is_flag=True,
              help="Also re-seal the federation state in etcd ([federation] etcd_endpoints "
                   "of the config), named federation-state in the report.")
@click.option("--config", type=click.Path(path_type=Path), default=None,
              help="Site config (default: $SLURM_GEO_CONFIG or /etc/slurm-geo/config.toml).")
@key_file_option
@json_option
def keys_rotate(store_specs: tuple[str, ...], dry_run: bool, federation_state: bool,
                config: Path | None, key_file: Path, as_json: bool) -> None:
    """Replace the master key, in two runs (docs/runbook.md).

    The first writes a key ring (the new key and the old) into the key file and re-seals
    nothing; copy it to the control site, then run the same command again: it seals every
    run's wrapped key, fence and promotion marker again under the new key, then leaves it
    alone in the file.

    Run keys do not change: no checkpoint is rewritten and running jobs go on. Cut short,
    the key file still holds both keys, which every reader uses; run it again with the
    same stores. Exit 1 when an object was refused or the rotation did not finish.
    """
    from slurm_geo.ckpt.ops.rotate import Outcome, rotate_master_key

    stores = {spec: _open(spec, config) for spec in dict.fromkeys(store_specs)}
    also = _federation_state(config, key_file) if federation_state else {}
    try:
        report = rotate_master_key(stores, key_file, dry_run=dry_run, also=also)
    finally:
        for sealed in also.values():
            sealed.kv.close()
    if as_json:
        click.echo(json.dumps({"key_file": str(key_file), "outcome": report.outcome.value,
                               "key": report.key, "previous": report.previous,
                               "unfinished": report.unfinished,
                               "stores": [asdict(s) for s in report.stores]}, indent=2))
    else:
        _print_rotation(report, key_file)
    sys.exit(1 if report.outcome is Outcome.UNFINISHED or report.refused else 0)


def _federation_state(config: Path | None, key_file: Path) -> dict[str, SealedState]:
    """The federation state in etcd the config names, as the rotation re-seals it."""
    from slurm_geo.ckpt.format.keys import load_master_key
    from slurm_geo.config.model import load_config
    from slurm_geo.federation.state.etcd.layout import Layout
    from slurm_geo.federation.state.etcd.reseal import NAME, SealedState
    from slurm_geo.federation.state.open import federation_config, open_kv

    site = load_config(config)
    fed = federation_config(site)
    if not fed.replicated:
        raise ConfigError(f"{site.source}: [federation] has no etcd_endpoints; its SQLite "
                          "state holds nothing sealed under the master key: drop "
                          "--federation-state")
    return {NAME: SealedState(open_kv(fed, load_master_key(key_file)),
                              Layout(fed.etcd_prefix))}


def _print_rotation(report, key_file: Path) -> None:
    from slurm_geo.ckpt.ops.rotate import Outcome

    rows = [{"store": s.store, "rewrapped": len(s.rewrapped), "current": len(s.current),
             "refused": len(s.refused), "unfinished": s.unfinished or ""}
            for s in report.stores]
    columns = ["store", "rewrapped", "current", "refused"]
    if report.outcome in (Outcome.DRY_RUN, Outcome.RING_WRITTEN):
        rows = [{**row, "to_reseal": row["rewrapped"]} for row in rows]
        columns[1] = "to_reseal"
    click.echo(_table(rows, columns + (["unfinished"] if report.unfinished else [])))
    for store in report.stores:
        for name, why in store.refused.items():
            click.echo(f"slurm-geo: refused {name} in {store.store}: {why}", err=True)
    count = sum(len(s.rewrapped) for s in report.stores)
    click.echo({
        Outcome.DRY_RUN: f"dry run: would seal {count} object(s) again under "
                         f"{report.key or 'a new key'} (now {report.previous}); nothing "
                         "written",
        Outcome.RING_WRITTEN: f"{key_file} holds the new key {report.key} and the old one "
                              f"{report.previous}; nothing is sealed again yet. Copy it to "
                              "the control site (docs/runbook.md), then run this command "
                              "again",
        Outcome.COMPLETE: f"rotated the master key {report.previous} -> {report.key}: "
                          f"{count} object(s) sealed again; {key_file} holds the new key "
                          "only. Copy it to the control site (docs/runbook.md)",
        Outcome.UNFINISHED: f"slurm-geo: rotation to {report.key} not finished: "
                            f"{report.unfinished}; {key_file} holds both keys, which every "
                            "reader uses: run the same command again to finish",
    }[report.outcome], err=report.outcome is Outcome.UNFINISHED)


@click.group()
def ckpt() -> None:
    """Push, pull, list, verify, promote and garbage-collect checkpoints."""


@ckpt.command()
@click.argument("path", type=click.Path(exists=True, path_type=Path))
@store_option("--to", "Destination store")
@click.option("--run", help="Run id (required for a torch.save or safetensors file; picks "
                            "the run of a checkpoint directory holding several).")
@click.option("--step", type=click.IntRange(min=0),
              help="Step (required for a torch.save or safetensors file; default: the run's "
                   "latest).")
@key_file_option
@json_option
def push(path: Path, store_url: str, run: str | None, step: int | None, key_file: Path,
         as_json: bool) -> None:
    """Push PATH to a store: a checkpoint directory written by slurm-geo, a plain
    torch.save file of a state dict (read without torch: only tensors and plain values are
    unpickled) or a safetensors file, saved with the run's previous step as parent."""
    from slurm_geo.ckpt import LocalDirStore, Repository, load_master_key

    master_keys = load_master_key(key_file)
    destination = _open(store_url)
    started = time.monotonic()
    if path.is_dir():
        source_store = LocalDirStore(path)
        source = Repository(source_store, master_keys)
        run = run or only_run(source, path)
        run, step = parse_target(run if step is None else f"{run}@{step}", source, str(path))
        report = _copy_with_progress(source, source_store, destination, run, step, "push",
                                     as_json)
        result = {"run": run, "step": step, "packs_copied": report.packs_copied,
                  "packs_present": report.packs_present, "bytes_copied": report.bytes_copied,
                  "bytes": report.bytes_copied}
    else:
        if run is None or step is None:
            raise ConfigError(f"{path} is a torch.save or safetensors file: give --run RUN "
                              "--step N")
        result = push_tensor_file(path, Repository(destination, master_keys), run, step,
                                   as_json)
    _report({**result, "seconds": _since(started)}, as_json, "pushed {run}@{step}")


@ckpt.command()
@click.argument("target", metavar="RUN[@STEP]")
@store_option("--from", "Source store")
@click.option("--to", "path", required=True, type=click.Path(path_type=Path),
              help="A directory (gets a verified copy of the checkpoint; of a multi-rank "
                   "one, a DCP checkpoint that torch.distributed.checkpoint reads with "
                   "FileSystemReader), FILE.pt (gets a torch.save file of the state "
                   "dict; numpy arrays as tensors), or FILE.safetensors (named tensors only: "
                   "of a Checkpointer's checkpoint, its model's weights).")
@key_file_option
@json_option
def pull(target: str, store_url: str, path: Path, key_file: Path, as_json: bool) -> None:
    """Fetch RUN (its latest step) or RUN@STEP from a store, verifying every chunk.

    A multi-rank checkpoint (saved through torch.distributed.checkpoint) is assembled
    whole in this process, so it needs PyTorch and memory for the whole state dict.
    """
    from slurm_geo.ckpt import LocalDirStore, Repository, load_master_key
    from slurm_geo.cli import ckpt_owner

    source_store = _open(store_url)
    site = ckpt_owner.owner_site(key_file)  # her run's key from the daemon
    if site is None:
        master_keys = load_master_key(key_file)
        source = Repository(source_store, master_keys)
    else:
        source = ckpt_owner.run_repository(source_store, site, target.partition("@")[0])
    run, step = parse_target(target, source, store_url)
    started = time.monotonic()
    if source.manifest(run, step).sharded is not None:
        if site is not None:
            raise ConfigError(f"{run}@{step} is a multi-rank checkpoint: pulling one needs "
                              f"the master key ({key_file}); pull it to a directory as an "
                              "admin, or load it in a job with StorageReader")
        result = pull_multi_rank(store_url, key_file, run, step, path)
    elif path.suffix in (".pt", ".safetensors"):
        result = pull_tensor_file(source, run, step, path, as_json)
    else:
        path.mkdir(parents=True, exist_ok=True)
        local = LocalDirStore(path)
        report = _copy_with_progress(source, source_store, local, run, step, "pull", as_json)
        with progress(f"verify {run}@{step}", as_json) as bar:
            copy = Repository(local, master_keys) if site is None \
                else ckpt_owner.with_run_key_of(source, local, run)
            faults = copy.verify(run, step, on_bytes=bar)
        _fail_on_faults(faults, f"{run}@{step}")
        result = {"run": run, "step": step, "to": str(path), "bytes": report.bytes_copied}
    _report({**result, "seconds": _since(started)}, as_json, "pulled {run}@{step} to {to}",
            to=str(path))


@ckpt.command("ls")
@click.argument("run", required=False)
@store_option("--store", "Store to list")
@click.option("--sync-state", type=click.Path(path_type=Path), default=None,
              help="checkpoint-sync's state database, read for OFF-SITE (default: [sync] "
                   "state of the config; without one OFF-SITE is -).")
@key_file_option
@json_option
def list_checkpoints(run: str | None, store_url: str, sync_state: Path | None, key_file: Path,
                     as_json: bool) -> None:
    """List runs and their checkpoints: step, epoch, loss, when, where, promoted; size,
    bytes it added to the store, dedup ratio, and its off-site replica's status."""
    from slurm_geo.ckpt import Repository, load_master_key
    from slurm_geo.cli import ckpt_usage as shown
    from slurm_geo.cli.ckpt_owner import OwnedRuns, owned_runs, owner_site

    site = owner_site(key_file)  # her runs' keys from the daemon
    repository = Repository(_open(store_url), load_master_key(key_file)) if site is None \
        else OwnedRuns(_open(store_url), site, [run] if run else owned_runs(site))
    names = [run] if run else repository.runs()
    if run:
        require_run(repository, run, store_url)
    offsite = shown.offsite_of(store_url, sync_state, chosen_config()) \
        if site is None or sync_state is not None else None
    rows = shown.listing_rows(shown.manifests_of(repository, names),
                              {name: repository.latest(name) for name in names},
                              lambda m: _promoted(repository, m.run, m.step), offsite)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("no checkpoints")
        return
    click.echo(_table([shown.human_listing(row) for row in rows], shown.LS_COLUMNS))


@ckpt.command()
@store_option("--store", "Store to measure")
@click.option("--run", help="Only this run (then no store total).")
@key_file_option
@json_option
def stats(store_url: str, run: str | None, key_file: Path, as_json: bool) -> None:
    """Per run: checkpoints, size, bytes stored, bytes of its packs, dedup ratio; then the
    store's total, with the packs no checkpoint references (from manifests and one
    listing of the packs; nothing else is read)."""
    from slurm_geo.ckpt import Repository, load_master_key
    from slurm_geo.ckpt.ops.usage import pack_sizes
    from slurm_geo.cli import ckpt_usage as shown

    store = _open(store_url)
    repository = Repository(store, load_master_key(key_file))
    manifests = shown.manifests_of(repository, [run] if run else repository.runs())
    if run and not manifests:
        raise no_run(run, store_url)
    document = shown.stats_document(store_url, manifests, pack_sizes(store), run is None)
    if as_json:
        click.echo(json.dumps(document, indent=2))
        return
    rows, note = shown.stats_lines(document)
    click.echo(_table(rows, shown.STATS_COLUMNS))
    if note:
        click.echo(note)


@ckpt.command()
@click.argument("target", metavar="RUN[@STEP]")
@store_option("--store", "Store holding the checkpoint")
@key_file_option
@json_option
def verify(target: str, store_url: str, key_file: Path, as_json: bool) -> None:
    """Read every chunk of RUN's latest (or STEP's) checkpoint; exit 1 naming each fault."""
    from slurm_geo.ckpt import Repository, load_master_key
    from slurm_geo.cli.ckpt_owner import owner_site, run_repository

    site = owner_site(key_file)  # her run's key from the daemon
    repository = Repository(_open(store_url), load_master_key(key_file)) if site is None \
        else run_repository(_open(store_url), site, target.partition("@")[0])
    run, step = parse_target(target, repository, store_url)
    with progress(f"verify {run}@{step}", as_json) as bar:
        faults = repository.verify(run, step, on_bytes=bar)
    if as_json:
        click.echo(json.dumps({"run": run, "step": step, "ok": not faults,
                               "faults": [{"object": f.name, "error": str(f)} for f in faults],
                               "bytes": bar.done, "seconds": round(bar.seconds, 3)},
                              indent=2))
        sys.exit(1 if faults else 0)
    _fail_on_faults(faults, f"{run}@{step}")
    click.echo(f"{run}@{step}: ok, every chunk verified")


@ckpt.command()
@store_option("--store", "Store to check")
@click.option("--read-data", is_flag=True,
              help="Also read every referenced pack once and verify every chunk in it.")
@click.option("--read-data-subset", "subset", metavar="P%|n/t",
              help="Read only some packs: P% of them at random, or group n of t, chosen by "
                   "pack id (the same packs every time: 1/7 ... 7/7 cover the store).")
@key_file_option
@json_option
def check(store_url: str, read_data: bool, subset: str | None, key_file: Path,
          as_json: bool) -> None:
    """Check every run of a store: keys, manifests, and that every pack they reference is
    there, whole; with --read-data every chunk too. Exit 1 naming each damaged object and
    the checkpoints (RUN@STEP) it affects."""
    from slurm_geo.ckpt import load_master_key
    from slurm_geo.ckpt.ops.check import READ_ALL, check_store, parse_subset

    if read_data and subset:
        raise ConfigError("give --read-data or --read-data-subset, not both")
    selection = parse_subset(subset) if subset else READ_ALL if read_data else None
    with progress("check manifests", as_json, unit="manifests") as bar:
        report = check_store(_open(store_url), load_master_key(key_file), selection,
                             on_manifests=bar, on_bytes=bar.then("check packs"))
    if as_json:
        click.echo(json.dumps({"store": store_url, "ok": report.ok, "bytes": report.bytes_read,
                               **{k: v for k, v in asdict(report).items() if k != "damage"},
                               "damaged": [asdict(d) for d in report.damage],
                               "affected_checkpoints": report.affected}, indent=2))
        sys.exit(0 if report.ok else 1)
    for damage in report.damage:
        affects = ", ".join(damage.checkpoints) or "no checkpoint's data"
        click.echo(f"slurm-geo: damaged: {damage.object}: {damage.error}; affects {affects}",
                   err=True)
    summary = (f"{report.runs} run(s), {report.checkpoints} checkpoint(s), {report.packs} "
               f"pack(s); read {report.packs_read} pack(s), {report.bytes_read} bytes in "
               f"{report.seconds:.1f} s")
    if not report.ok:
        click.echo(f"slurm-geo: error: {store_url}: {len(report.damage)} damaged object(s), "
                   f"{len(report.affected)} checkpoint(s) affected ({summary})", err=True)
        sys.exit(1)
    click.echo(f"{store_url}: ok, {summary}")


@ckpt.command()
@click.argument("target", metavar="RUN@STEP")
@store_option("--store", "Store holding the checkpoint")
@key_file_option
@json_option
def promote(target: str, store_url: str, key_file: Path, as_json: bool) -> None:
    """Make a checkpoint immutable (retention tier 3): never overwritten or collected."""
    from slurm_geo.ckpt import Repository, load_master_key

    repository = Repository(_open(store_url), load_master_key(key_file))
    run, step = parse_target(target, repository, store_url)
    repository.promote(run, step)
    _report({"run": run, "step": step, "promoted": True}, as_json, "{run}@{step}: promoted")


@ckpt.command()
@store_option("--store", "Store whose promotion markers to re-seal")
@click.option("--dry-run", is_flag=True, help="Report what would be re-sealed; write nothing.")
@key_file_option
@json_option
def reseal(store_url: str, dry_run: bool, key_file: Path, as_json: bool) -> None:
    """Once, when upgrading: re-seal version 1 promotion markers under the promotion key.

    A version 1 marker was sealed under its run's data key, which jobs hold; readers now
    refuse it. Each one whose checkpoint opens is sealed again (docs/format.md §8.4); exit
    1 when some marker was refused. Version 1 fences are listed: the federation daemon
    rewrites the ones it knows.
    """
    from slurm_geo.ckpt import load_master_key
    from slurm_geo.ckpt.ops.reseal import reseal as reseal_store

    report = reseal_store(_open(store_url), load_master_key(key_file), dry_run=dry_run)
    if as_json:
        click.echo(json.dumps({**asdict(report), "dry_run": dry_run}, indent=2))
    else:
        verb = "would re-seal" if dry_run else "re-sealed"
        for name in report.resealed:
            click.echo(f"{verb} {name}")
        for name, why in report.refused.items():
            click.echo(f"slurm-geo: refused {name}: {why}", err=True)
        for name in report.old_fences:
            click.echo(f"version 1 fence {name}: the federation daemon rewrites it")
        click.echo(f"{verb} {len(report.resealed)} marker(s), {len(report.current)} already "
                   f"current, {len(report.refused)} refused")
    sys.exit(1 if report.refused else 0)


@ckpt.command()
@store_option("--store", "Store to clean")
@click.option("--dry-run", is_flag=True, help="Report what would be deleted; delete nothing.")
@key_file_option
@json_option
def gc(store_url: str, dry_run: bool, key_file: Path, as_json: bool) -> None:
    """Delete packs no checkpoint references (refuses while a push is in flight)."""
    from slurm_geo.ckpt import Repository, load_master_key
    from slurm_geo.ckpt.ops.gc import collect_garbage

    store = _open(store_url)
    report = collect_garbage(store, Repository(store, load_master_key(key_file)),
                             datetime.now(UTC), dry_run=dry_run)
    for note in report.notes:  # a lock no push holds: one line each, never a wait
        click.echo(f"slurm-geo: {note}", err=True)
    verb = "would delete" if dry_run else "deleted"
    _report({**asdict(report), "dry_run": dry_run}, as_json,
            f"{verb} {len(report.deleted_packs)} pack(s), kept {report.kept_packs}")


@ckpt.command()
@click.argument("run")
@store_option("--store", "The run's local (tier 1) store")
@click.option("--offsite", "offsite_url", metavar="STORE",
              help="Its off-site (tier 2) store; without it nothing counts as replicated.")
@click.option("--keep-local", type=click.IntRange(min=1), help="Tier 1: checkpoints kept locally.")
@click.option("--replicate-every", type=click.IntRange(min=1),
              help="Tier 2: every k-th checkpoint goes off-site (the newest always does).")
@click.option("--remote-days", type=click.FloatRange(min=0, min_open=True),
              help="Tier 2: days a replica is kept (the newest always stays).")
@click.option("--dry-run", is_flag=True, help="Report what would be deleted; delete nothing.")
@key_file_option
@json_option
def prune(run: str, store_url: str, offsite_url: str | None, keep_local: int | None,
          replicate_every: int | None, remote_days: float | None, dry_run: bool,
          key_file: Path, as_json: bool) -> None:
    """Apply the retention tiers to RUN (defaults from the config's [retention] table).

    Never deletes a checkpoint that still owes its off-site replica, the newest replica,
    or a promoted checkpoint. Packs are freed by the next `gc`.
    """
    from dataclasses import replace

    from slurm_geo.ckpt import Repository, load_master_key
    from slurm_geo.ckpt.ops.prune import prune_run
    from slurm_geo.policy.retention import RetentionPolicy

    policy = _site_retention() or RetentionPolicy()
    overrides = {"keep_local": keep_local, "replicate_every": replicate_every,
                 "remote_days": remote_days}
    policy = replace(policy, **{k: v for k, v in overrides.items() if v is not None})
    master_keys = load_master_key(key_file)
    local = Repository(_open(store_url), master_keys)
    remote = Repository(_open(offsite_url), master_keys) if offsite_url else None
    if not local.steps(run) and (remote is None or not remote.steps(run)):
        raise no_run(run, store_url)
    report = prune_run(run, local, remote, policy, datetime.now(UTC), dry_run=dry_run)
    verb = "would delete" if dry_run else "deleted"
    _report({**asdict(report), "dry_run": dry_run}, as_json,
            f"{run}: {verb} {len(report.local_deleted)} local and "
            f"{len(report.remote_deleted)} off-site checkpoint(s); "
            f"{len(report.awaiting_replication)} await replication")


# --- helpers ----------------------------------------------------------------------------

def _site_retention():
    """The config's [retention], or None when there is no config file."""
    from slurm_geo.config.model import config_path_from_env, load_config

    path = chosen_config() or config_path_from_env()
    return load_config(path).retention if path.exists() else None


def _promoted(repository, run: str, step: int) -> bool:
    """A marker that does not open (version 1, another key) counts as none, said once."""
    from slurm_geo.ckpt.errors import CorruptObject, UnsupportedFormat, WrongKey

    try:
        return bool(repository.is_promoted(run, step))
    except (UnsupportedFormat, WrongKey, CorruptObject) as exc:
        click.echo(f"slurm-geo: warning: {exc}", err=True)
        return False


def _open(url: str, config: Path | None = None):
    from slurm_geo.ckpt.stores.open_store import open_store_or_named

    return open_store_or_named(url, config or chosen_config())


def _copy_with_progress(source, source_store, destination, run: str, step: int, verb: str,
                        as_json: bool):
    from slurm_geo.ckpt.ops.replicate import copy_checkpoint

    with progress(f"{verb} {run}@{step}", as_json) as bar:
        return copy_checkpoint(source, source_store, destination, run, step, on_bytes=bar)


def _since(started: float) -> float:
    return round(time.monotonic() - started, 3)


def _fail_on_faults(faults, what: str) -> None:
    if faults:
        for fault in faults:
            click.echo(f"slurm-geo: fault: {fault}", err=True)
        click.echo(f"slurm-geo: error: {what}: {len(faults)} damaged object(s)", err=True)
        sys.exit(1)


def _report(result: dict, as_json: bool, template: str, **extra: str) -> None:
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        click.echo(template.format(**{**result, **extra}))


def _table(rows: list[dict], columns: list[str]) -> str:
    return table([[c.upper() for c in columns]] + [[cell(row[c]) for c in columns]
                                                    for row in rows])
