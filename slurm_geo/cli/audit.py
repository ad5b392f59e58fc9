"""`slurm-geo audit ...`: show and verify the federation daemon's hash-chained audit log."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from slurm_geo.cells import table
from slurm_geo.cli.options import chosen_config, config_option
from slurm_geo.errors import ConfigError

if TYPE_CHECKING:
    from slurm_geo.federation.state.interface import Audit

_db_flag = click.option(
    "--db", "db_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
    help="The audit database (default: [federation] audit_path of the slurm-geo config, or "
         "the log in etcd with etcd_endpoints).")


def db_option(command):
    return _db_flag(config_option(command))

json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")

_COLUMNS = ("seq", "time", "kind", "logical_job", "what", "why")
_HEAD = re.compile(r"([0-9]+):([0-9a-f]{64})")


@click.group()
def audit() -> None:
    """The federation daemon's append-only, hash-chained audit log."""


@audit.command()
@db_option
@click.option("--expect-head", default=None, metavar="SEQ:HASH",
              help="A head kept elsewhere (`audit verify` prints it): also catches entries "
                   "cut off the end of the log.")
@json_option
def verify(db_path: Path | None, expect_head: str | None, as_json: bool) -> None:
    """Recompute every hash and link; exit 56 naming the first bad entry."""
    from slurm_geo.federation.state.audit import AuditChainBroken

    expected = _parse_head(expect_head) if expect_head else None
    path, log = _open_log(db_path)
    with log:
        report = log.verify(expected_head=expected)
    if as_json:
        click.echo(json.dumps({"db": str(path), "ok": report.ok, "entries": report.entries,
                               "first_bad_seq": report.first_bad_seq,
                               "problem": report.problem,
                               "head": {"seq": report.head[0], "hash": report.head[1]}},
                              indent=2))
        if not report.ok:
            sys.exit(AuditChainBroken.exit_code)
        return
    if not report.ok:
        raise AuditChainBroken(f"audit log {path}: first bad entry {report.first_bad_seq}: "
                               f"{report.problem}")
    seq, digest = report.head
    click.echo(f"audit log {path}: {report.entries} entries, chain intact; head {seq}:{digest}")


@audit.command()
@db_option
@click.option("--job", "logical_job", default=None, help="Only this logical job's entries.")
@click.option("--since", "since_seq", type=click.IntRange(min=0), default=0,
              help="Only entries after this seq.")
@json_option
def show(db_path: Path | None, logical_job: str | None, since_seq: int,
         as_json: bool) -> None:
    """The entries, oldest first (`audit verify` checks them)."""
    with _open_log(db_path)[1] as log:
        entries = log.entries(logical_job=logical_job, since_seq=since_seq)
    if as_json:
        click.echo(json.dumps([e.to_json() for e in entries], indent=2))
    elif not entries:
        click.echo("no entries")
    else:
        click.echo(_table([e.to_json() for e in entries]))


def _open_log(db_path: Path | None) -> tuple[str, Audit]:
    """The log `--db` names, else the config's: where it is, and the log, read-only."""
    from slurm_geo.federation.state.audit import AuditLog

    if db_path is not None:
        return str(db_path), AuditLog(db_path, readonly=True)
    from slurm_geo.config.model import load_config
    from slurm_geo.federation.state.open import read_audit

    try:
        site = load_config(chosen_config())
    except ConfigError as exc:
        raise ConfigError(f"{exc}; or give --db PATH") from None
    config = site.federation
    if config is None:
        raise ConfigError(f"{site.source} has no [federation] table with audit_path; "
                          "give --db PATH")
    where = f"etcd {config.etcd_prefix}" if config.replicated else str(config.audit_path)
    return where, read_audit(config)


def _parse_head(text: str) -> tuple[int, str]:
    match = _HEAD.fullmatch(text.strip())
    if match is None:
        raise click.BadParameter("expected SEQ:HASH, e.g. 42:<64 hex digits>",
                                 param_hint="--expect-head")
    return int(match[1]), match[2]


def _table(rows: list[dict[str, Any]]) -> str:
    def cell(row: dict[str, Any], column: str) -> str:
        value = row[column]
        if value is None:
            return "-"
        text = "".join("?" if ord(c) < 32 or ord(c) == 127 else c for c in str(value))
        return text if len(text) <= 60 else text[:57] + "..."

    return table([[c.upper() for c in _COLUMNS]] + [[cell(r, c) for c in _COLUMNS]
                                                    for r in rows])
