"""`slurm-geo billing ...`: ingest accounting and egress, report, invoice, check budgets."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

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


@billing.command()
@click.option("--cluster", "clusters", multiple=True,
              help="Only this cluster (repeatable; default: every cluster in the config).")
@click.option("--since", default=None, help="Start here instead of at the watermark (UTC).")
@click.option("--until", default=None, help="End of the window (UTC; default: now).")
@click.option("--check-budgets", is_flag=True,
              help="Then check this month's budgets, as `billing budgets` does.")
@db_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def ingest(clusters: tuple[str, ...], since: str | None, until: str | None,
           check_budgets: bool, db_path: Path | None, as_json: bool) -> None:
    """Fetch accounting (every requeued incarnation) and checkpoint egress into the database."""
    from slurm_geo.billing.errors import BillingError
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
        for stats in result.clusters:
            click.echo(f"{stats.cluster}: {stats.incarnations} incarnation(s) from "
                       f"{stats.records} record(s), {stats.malformed} malformed, "
                       f"{stats.pending} pending ({stats.as_dict()['since']} .. "
                       f"{stats.as_dict()['until']})")
        click.echo(f"egress: {result.transfers} transfer(s)"
                   + (f"; prices changed, {result.repriced} row(s) repriced"
                      if result.repriced else ""))
    if result.failures:
        names = ", ".join(sorted(result.failures))
        raise BillingError(f"not ingested: {names} ({next(iter(result.failures.values()))}); "
                           "the next run retries from the same watermark")
    if check_budgets:
        _check_budgets(db_path or config.database, None, None, False, as_json=False)


@billing.command()
@period_option
@click.option("--by", type=click.Choice(["cost-center", "user", "cluster", "job"]),
              default="cost-center", show_default=True)
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table",
              show_default=True)
@db_option
def report(period_text: str | None, by: str, fmt: str, db_path: Path | None) -> None:
    """Costs of a period; flags (unknown TRES, no price, no cost center) are listed."""
    from slurm_geo.billing import service
    from slurm_geo.billing.report import render

    period = _period(period_text)
    with opened(db_path or _config().database, readonly=True) as db:
        result = service.report(db, period, by)
    click.echo(render(result, fmt))


@billing.command()
@period_option
@click.option("--out", "out_dir", type=click.Path(path_type=Path), required=True,
              help="Directory the invoices are written to.")
@click.option("--cost-center", "centers", multiple=True,
              help="Only this cost center (repeatable).")
@db_option
def invoices(period_text: str | None, out_dir: Path, centers: tuple[str, ...],
             db_path: Path | None) -> None:
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
    for center, invoice in found.items():
        if centers and center not in centers:
            continue
        stem = file_stem(center, period)
        write_if_changed(out_dir / f"{stem}.csv", invoice_csv(invoice), 0o644)
        write_if_changed(out_dir / f"{stem}.html", invoice_html(invoice), 0o644)
        click.echo(f"{center}: {invoice.total:.2f} USD -> {out_dir / stem}.csv, .html"
                   + (f" ({invoice.unpriced} line(s) without a price)"
                      if invoice.unpriced else ""))
    if flags:
        click.echo(f"{len(aggregate_flags(flags))} flag(s): see `slurm-geo billing report "
                   f"--period {period.label}`", err=True)


@billing.command()
@period_option
@click.option("--webhook", default=None, help="POST alerts here (default: [billing] "
                                              "webhook_url).")
@click.option("--no-webhook", is_flag=True, help="Do not POST, even if configured.")
@db_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def budgets(period_text: str | None, webhook: str | None, no_webhook: bool,
            db_path: Path | None, as_json: bool) -> None:
    """Check budgets; exit 51 when a cost center (or a job) is over its budget."""
    _check_budgets(db_path, period_text, webhook, no_webhook, as_json)


def _check_budgets(db_path: Path | None, period_text: str | None, webhook: str | None,
                   no_webhook: bool, as_json: bool) -> None:
    from slurm_geo.billing import service
    from slurm_geo.billing.budgets import check_jobs, check_monthly, post_webhook, spending
    from slurm_geo.billing.errors import BudgetExceeded
    from slurm_geo.billing.report import Flag

    config = _config()
    period = _period(period_text)
    flags: list[Flag] = []
    with opened(db_path or config.database, readonly=True) as db:
        centers, jobs = spending(service.period_lines(db, period, flags))
    alerts = (check_monthly(centers, config.budgets, config.warn_pct, period.label)
              + check_jobs(jobs, config.job_budgets))
    for alert in alerts:
        click.echo(f"slurm-geo: {alert.level}: {alert.message}", err=True)
    url = None if no_webhook else (webhook or config.webhook_url)
    if url and alerts:
        problem = post_webhook(url, period.label, alerts)
        if problem:
            click.echo(f"slurm-geo: warning: {problem}; the alerts above were not delivered",
                       err=True)
    if as_json:
        click.echo(json.dumps({"period": period.label, "spent": centers,
                               "budgets": dict(config.budgets),
                               "alerts": [a.__dict__ for a in alerts]}, indent=2))
    elif not alerts:
        click.echo(f"{period.label}: no budget exceeded ({len(config.budgets)} monthly "
                   f"budget(s) in [billing.budgets], {len(config.job_budgets)} per-job in "
                   "[policy.budgets])")
    exceeded = [a for a in alerts if a.level == "exceeded"]
    if exceeded:
        raise BudgetExceeded(f"{len(exceeded)} budget(s) exceeded in {period.label}")


def _load() -> tuple[Any, Any]:
    from slurm_geo.billing.config import billing_config
    from slurm_geo.config.model import load_config

    site = load_config()
    return site, billing_config(site)


def _config() -> Any:
    return _load()[1]


def _period(text: str | None) -> Any:
    from datetime import UTC, datetime

    from slurm_geo.billing.periods import parse_period

    return parse_period(text or datetime.now(UTC).strftime("%Y-%m"))
