"""`slurm-geo billing ...`: ingest accounting and egress, report, invoice, check budgets."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from slurm_geo.cells import table
from slurm_geo.cli.options import chosen_config, config_option

db_option = click.option("--db", "db_path", type=click.Path(path_type=Path), default=None,
                         help="The billing database (default: [billing] database).")
period_option = click.option("--period", "period_text", default=None,
                             help="YYYY-MM (default: this month), YYYY-MM-DD or START..END "
                                  "(ISO times, UTC).")


@contextmanager
def opened(path: Path, readonly: bool = False) -> Iterator[Any]:
    """The billing database; SQLite's own errors (disk full, locked, not a database)
    become one line naming the file."""
    import sqlite3

    from slurm_geo.billing.db import BillingDB
    from slurm_geo.billing.errors import BillingError

    try:
        with BillingDB(path, readonly=readonly) as db:
            yield db
    except sqlite3.Error as exc:
        raise BillingError(f"billing database {path}: {exc}") from None
    except OSError as exc:
        raise BillingError(f"billing database {path}: {exc.strerror or exc}") from None


@click.group()
def billing() -> None:
    """Chargeback: rental, egress and marketplace costs per job and cost center."""


cluster_option = click.option(
    "--cluster", "clusters", multiple=True,
    help="Only this cluster (repeatable; default: every cluster in the config).")
alert_option = click.option(
    "--alert", is_flag=True,
    help="Also POST each failure to [billing] webhook_url, as budget alerts (the timer "
         "passes it).")


@billing.command()
@cluster_option
@click.option("--since", default=None, help="Start here instead of at the watermark (UTC).")
@click.option("--until", default=None, help="End of the window (UTC; default: now).")
@click.option("--check-budgets", is_flag=True,
              help="Then check this month's budgets, as `billing budgets` does.")
@alert_option
@db_option
@config_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def ingest(clusters: tuple[str, ...], since: str | None, until: str | None,
           check_budgets: bool, alert: bool, db_path: Path | None, as_json: bool) -> None:
    """Fetch accounting (every requeued incarnation) and checkpoint egress into the database.

    A source that cannot be read completely keeps its watermark (the next run reads that
    window again) and makes the command exit non-zero: 52, or 40 / 42 / 55 when only
    checkpoint-sync's state / the registry / the audit log failed.
    """
    from slurm_geo.billing.periods import epoch, utc_time
    from slurm_geo.billing.service import connect_all, run_ingest
    from slurm_geo.slurm import connect

    site, config = _load()
    clients = connect_all(site, clusters, connect)
    with opened(db_path or config.database) as db:
        result = run_ingest(db, config, clients, int(time.time()),
                            since=epoch(utc_time(since)) if since else None,
                            until=epoch(utc_time(until)) if until else None)
    if as_json:
        click.echo(json.dumps(result.as_dict(), indent=2))
    else:
        click.echo(_ingest_table(result))
    if result.failures:
        _fail("ingest", config, _period(None).label, result.failures, [], alert,
              result.exit_code)
    if check_budgets:
        _check_budgets(db_path or config.database, None, None, False, as_json=False)


@billing.command()
@period_option
@cluster_option
@click.option("--strict", is_flag=True,
              help="Also fail (exit 54) when part of what was billed could not be compared "
                   "yet (a source may still be recording it), naming it.")
@alert_option
@db_option
@config_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def check(period_text: str | None, clusters: tuple[str, ...], strict: bool, alert: bool,
          db_path: Path | None, as_json: bool) -> None:
    """Compare what was ingested with what the sources account for; exit 53 on any
    difference.

    Per cluster, Slurm's accounting now (jobs, incarnations, CPU- and GPU-seconds); per
    egress source, checkpoint-sync's transfers and the federation daemon's copies (count,
    bytes): each up to where ingest last read it completely. One line per difference;
    what was billed past that is named as not compared yet.
    """
    from slurm_geo.billing.service import connect_all, run_check
    from slurm_geo.slurm import connect

    site, config = _load()
    period = _period(period_text)
    clients = connect_all(site, clusters, connect)
    with opened(db_path or config.database, readonly=True) as db:
        result = run_check(db, config, clients, period, int(time.time()), strict=strict)
    click.echo(json.dumps(result.as_dict(), indent=2) if as_json else _check_table(result))
    if result.exit_code:
        _fail("check", config, period.label, result.failures,
              [(d.source, d.message) for d in result.differences], alert, result.exit_code,
              result.not_compared if strict else [])


def _fail(command: str, config: Any, period: str, failures: dict[str, str],
          differences: list[tuple[str, str]], alert: bool, code: int,
          uncompared: Sequence[tuple[str, str]] = ()) -> None:
    """Report each unreadable source, each window not compared (`check --strict`) and each
    difference on a line of its own (the journal, under systemd), POST them when asked,
    and exit with `code`."""
    from slurm_geo.billing.budgets import failure_alert, post_webhook
    from slurm_geo.billing.errors import BillingDiffers, BillingUncompared, SourceUnreadable

    lines = [(source, f"{source} not read: {text}") for source, text in failures.items()]
    lines += list(uncompared)
    for _, text in lines:
        click.echo(f"slurm-geo: error: {text}", err=True)
    for _, text in differences:
        click.echo(f"slurm-geo: difference: {text}", err=True)
    if alert:
        alerts = [failure_alert(subject, f"billing {command}: {text}")
                  for subject, text in [*lines, *differences]]
        problem = (post_webhook(config.webhook_url, period, alerts) if config.webhook_url
                   else "no [billing] webhook_url is configured")
        if problem:
            click.echo(f"slurm-geo: warning: {problem}; the lines above were not delivered",
                       err=True)
    parts = []
    if failures:
        parts.append(f"{len(failures)} source(s) not read ({', '.join(failures)})"
                     + ("; their watermarks stay, the next run reads those windows again"
                        if command == "ingest" else ""))
    if differences:
        parts.append(f"{len(differences)} difference(s) between billing and its sources")
    if uncompared and not differences and not failures:
        parts.append(f"{len(uncompared)} source(s) billed past where they could be compared "
                     "(--strict)")
    message = f"billing {command}{f' {period}' if command == 'check' else ''}: " \
              f"{'; '.join(parts)}"
    if differences:
        raise BillingDiffers(message)
    if code == BillingUncompared.exit_code:
        raise BillingUncompared(message)
    raise SourceUnreadable(message, code)


def _ingest_table(result: Any) -> str:
    rows = [("source", "outcome", "window", "detail")]
    for run in result.sources:
        detail = run.detail
        if run.outcome.value == "failed":
            mark = run.as_dict()["watermark"]
            detail = f"watermark stays at {mark}" if mark else "no watermark yet"
        rows.append((run.source, run.outcome.value, _window(run), detail))
    lines = [table(rows)]
    if result.repriced:
        lines.append(f"prices changed: {result.repriced} row(s) repriced")
    return "\n".join(lines)


def _check_table(result: Any) -> str:
    from slurm_geo.billing.periods import iso

    rows = [("source", "compared", "result")]
    for run in result.sources:
        sides = result.totals.get(run.source, {})
        billed, accounted = _totals(sides.get("billed")), _totals(sides.get("accounted"))
        if run.outcome.value == "failed":
            outcome = "not read"
        elif not sides:
            outcome = run.detail
        elif billed == accounted:
            outcome = f"agrees: {billed}"
        else:
            outcome = f"{run.detail}: billing holds {billed}; the source has {accounted}"
        later = result.uncompared.get(run.source)
        if later is not None and sides:
            outcome += f"; billed {iso(later[0])} .. {iso(later[1])} not compared yet " \
                       f"(ingest again after {iso(later[2])})"
        rows.append((run.source, _window(run), outcome))
    return "\n".join([f"billing check {result.period.label}", table(rows)])


def _window(run: Any) -> str:
    shown = run.as_dict()
    return f"{shown['since']} .. {shown['until']}" if run.since is not None and \
        run.until is not None else ""


def _totals(totals: dict[str, int] | None) -> str:
    names = {"cpu_seconds": "cpu-s", "gpu_seconds": "gpu-s"}
    return ", ".join(f"{value} {names.get(key, key)}" for key, value in (totals or {}).items())


@billing.command()
@period_option
@click.option("--by", type=click.Choice(["cost-center", "user", "cluster", "job"]),
              default="cost-center", show_default=True)
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table",
              show_default=True, help="--format json is the same as --json.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@db_option
@config_option
def report(period_text: str | None, by: str, fmt: str, as_json: bool,
           db_path: Path | None) -> None:
    """Costs of a period; flags (unknown TRES, no price, no cost center) are listed."""
    from slurm_geo.billing import service
    from slurm_geo.billing.report import render

    period = _period(period_text)
    with opened(db_path or _config().database, readonly=True) as db:
        result = service.report(db, period, by)
    click.echo(render(result, "json" if as_json else fmt))


@billing.command()
@period_option
@click.option("--out", "out_dir", type=click.Path(path_type=Path), required=True,
              help="Directory the invoices are written to.")
@click.option("--cost-center", "centers", multiple=True,
              help="Only this cost center (repeatable).")
@db_option
@config_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def invoices(period_text: str | None, out_dir: Path, centers: tuple[str, ...],
             db_path: Path | None, as_json: bool) -> None:
    """One CSV and one HTML page (cost-by-cluster chart) per cost center."""
    from slurm_geo.atomic import write_if_changed
    from slurm_geo.billing import service
    from slurm_geo.billing.invoice import file_stem, invoice_csv, invoice_html
    from slurm_geo.billing.invoice import invoices as make_invoices
    from slurm_geo.billing.report import Flag, aggregate_flags

    period = _period(period_text)
    flags: list[Flag] = []
    with opened(db_path or _config().database, readonly=True) as db:
        found = make_invoices(service.period_lines(db, period, flags), period)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for center, invoice in found.items():
        if centers and center not in centers:
            continue
        stem = file_stem(center, period)
        write_if_changed(out_dir / f"{stem}.csv", invoice_csv(invoice), 0o644)
        write_if_changed(out_dir / f"{stem}.html", invoice_html(invoice), 0o644)
        written.append({"cost_center": center, "total_usd": round(invoice.total, 2),
                        "unpriced_lines": invoice.unpriced,
                        "csv": str(out_dir / f"{stem}.csv"),
                        "html": str(out_dir / f"{stem}.html")})
        if as_json:
            continue
        click.echo(f"{center}: {invoice.total:.2f} USD -> {out_dir / stem}.csv, .html"
                   + (f" ({invoice.unpriced} line(s) without a price)"
                      if invoice.unpriced else ""))
    if flags:
        click.echo(f"{len(aggregate_flags(flags))} flag(s): see `slurm-geo billing report "
                   f"--period {period.label}`", err=True)
    if as_json:
        click.echo(json.dumps({"period": period.label, "invoices": written,
                               "flags": len(aggregate_flags(flags))}, indent=2))


@billing.command()
@period_option
@click.option("--webhook", default=None, help="POST alerts here (default: [billing] "
                                              "webhook_url).")
@click.option("--no-webhook", is_flag=True, help="Do not POST, even if configured.")
@db_option
@config_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def budgets(period_text: str | None, webhook: str | None, no_webhook: bool,
            db_path: Path | None, as_json: bool) -> None:
    """Check budgets; exit 51 when a cost center (or a job) is over its budget."""
    _check_budgets(db_path, period_text, webhook, no_webhook, as_json)


def _check_budgets(db_path: Path | None, period_text: str | None, webhook: str | None,
                   no_webhook: bool, as_json: bool) -> None:
    from slurm_geo.billing import service
    from slurm_geo.billing.budgets import check_budgets, post_webhook
    from slurm_geo.billing.errors import BudgetExceeded
    from slurm_geo.billing.report import Flag

    config = _config()
    period = _period(period_text)
    flags: list[Flag] = []
    with opened(db_path or config.database, readonly=True) as db:
        found = check_budgets(service.period_lines(db, period, flags), config.budgets,
                              config.warn_pct, config.job_budgets, period.label)
    alerts = found.alerts
    for alert in alerts:
        click.echo(f"slurm-geo: {alert.level}: {alert.message}", err=True)
    url = None if no_webhook else (webhook or config.webhook_url)
    if url and alerts:
        problem = post_webhook(url, period.label, alerts)
        if problem:
            click.echo(f"slurm-geo: warning: {problem}; the alerts above were not delivered",
                       err=True)
    if as_json:
        click.echo(json.dumps({"period": period.label, "spent": found.spent,
                               "budgets": dict(config.budgets),
                               "alerts": [a.__dict__ for a in alerts]}, indent=2))
    elif not alerts:
        click.echo(f"{period.label}: no budget exceeded ({len(config.budgets)} monthly "
                   f"budget(s) in [billing.budgets], {len(config.job_budgets)} per-job in "
                   "[policy.budgets])")
    if found.exceeded:
        raise BudgetExceeded(f"{len(found.exceeded)} budget(s) exceeded in {period.label}")


def _load() -> tuple[Any, Any]:
    from slurm_geo.billing.config import billing_config
    from slurm_geo.config.model import load_config

    site = load_config(chosen_config())
    return site, billing_config(site)


def _config() -> Any:
    return _load()[1]


def _period(text: str | None) -> Any:
    from datetime import UTC, datetime

    from slurm_geo.billing.periods import parse_period

    return parse_period(text or datetime.now(UTC).strftime("%Y-%m"))
