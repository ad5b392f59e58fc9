"""`slurm-geo sync scrub-here`: check a store's packs where they are, with no key.

Run next to a checkpoint-sync destination, as an unprivileged account of its site with
the store's own credentials (AWS_* from the environment for s3://): it reads every pack,
checks it against its name and writes `scrub/report`, which checkpoint-sync reads with
`[sync] scrub_at = "destination"` (docs/checkpoint-sync.md, "Scrubbing"). It takes no
key and never looks for one.
"""

from __future__ import annotations

import sys
from datetime import UTC, datetime

import click

from slurm_geo.exitcodes import ExitCode


@click.command("scrub-here")
@click.option("--store", "url", required=True, metavar="URL",
              help="The store to scrub: file:///PATH or s3://BUCKET[/PREFIX] (endpoint and "
                   "credentials from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (the report).")
@click.option("--no-report", is_flag=True,
              help="Do not write scrub/report into the store (read-only access suffices).")
@click.option("--rate-mb-s", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Read at most this many MB (10^6 bytes) a second on average; 0: no cap.")
def scrub_here(url: str, as_json: bool, no_report: bool, rate_mb_s: float) -> None:
    """Read every pack of the store at URL, check each against its name (its hash) and
    write the report to scrub/report for checkpoint-sync. Needs no key: sealed objects
    (manifests, keys) are left to checkpoint-sync. Exit 1 when a pack is damaged."""
    from slurm_geo.ckpt.stores.open_store import open_store
    from slurm_geo.ckpt.stores.scrub_store import REPORT_NAME, scrub_store, write_report
    from slurm_geo.cli.progress import human_bytes, progress

    store = open_store(url)
    with progress(f"scrub {url}", as_json) as bar:
        report = scrub_store(store, url, rate_bytes_s=rate_mb_s * 1e6, on_bytes=bar)
    if not no_report:
        write_report(store, report)
    if as_json:
        click.echo(report.to_json())
    else:
        rows = [("store", url), ("started", _moment(report.started_at)),
                ("finished", _moment(report.finished_at)),
                ("packs checked", str(report.packs_checked)),
                ("bytes read", human_bytes(report.bytes_read)),
                ("damaged", str(len(report.damaged) + report.damaged_cut)),
                ("vanished", str(report.vanished) if report.vanished else "-"),
                ("report", "not written (--no-report)" if no_report else REPORT_NAME)]
        width = max(len(k) for k, _ in rows)
        click.echo("\n".join(f"{k.ljust(width)}  {v}" for k, v in rows))
        for name in report.damaged:
            click.echo(f"damaged: {name}")
        click.echo(f"not checked: {report.unchecked}")
    if not report.ok:
        click.echo(f"slurm-geo: error: {len(report.damaged) + report.damaged_cut} damaged "
                   f"pack(s) in {url}; checkpoint-sync copies them again from its source "
                   "(scrub_at = \"destination\")", err=True)
        sys.exit(ExitCode.FAILURE)


def _moment(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
