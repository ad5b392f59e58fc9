"""`slurm-geo doctor`: check a deployment from the host it runs on (slurm_geo.doctor)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from slurm_geo.cli.options import CONFIG_HELP
from slurm_geo.doctor import ROLES
from slurm_geo.exitcodes import ExitCode


@click.command("doctor")
@click.option("--config", type=click.Path(path_type=Path), default=None, help=CONFIG_HELP)
@click.option("--role", "roles", type=click.Choice(ROLES), multiple=True,
              help="What this host is (repeat for several); default: found from the config "
                   "and what is installed (slurmd: compute, slurmctld: controller, a daemon's "
                   "unit or the master key: daemon; login always).")
@click.option("--systemd-root", type=click.Path(path_type=Path, file_okay=False),
              default=Path("/"), show_default=True,
              help="The root whose units are checked (an image or a chroot); systemctl is "
                   "asked only for / on a host systemd runs.")
@click.option("--munge-socket", type=click.Path(path_type=Path), default=None,
              help="munged's socket (default: [federation] munge_socket, else slurm.conf's "
                   "AuthInfo=socket=, else munge's own).")
@click.option("--no-stores", is_flag=True,
              help="Skip the write/read/list/delete probe of each store.")
@click.option("--link-rate", is_flag=True,
              help="Also time a write and a read back of 4 MB to each store and report the "
                   "rates (never an error).")
# A host whose clock is off, for the tests: never for a site's use.
@click.option("--clock-offset-s", type=float, default=0.0, hidden=True)
@click.option("--all", "show_all", is_flag=True, help="Also list what is fine.")
@click.option("--json", "as_json", is_flag=True, help="Print every finding as JSON.")
def doctor(config: Path | None, roles: tuple[str, ...], systemd_root: Path,
           munge_socket: Path | None, no_stores: bool, link_rate: bool, clock_offset_s: float,
           show_all: bool, as_json: bool) -> None:
    """Check this host's part of the deployment: slurm.conf's lines and the SPANK plugin
    against the Slurm here, munge, the master key's and the secrets' modes, TLS chains and
    expiry, token expiry, the daemons' units, etcd's members and quorum, each store's
    write/read/list/delete, and the clock against the federation daemon. One line per
    problem with its fix; exits DOCTOR_FAILED (60) on any error, 0 with warnings only."""
    from dataclasses import asdict

    from slurm_geo.config.model import load_config
    from slurm_geo.doctor.checks import ERROR, INFO, OK, failed
    from slurm_geo.doctor.examine import Options, detect_roles, examine

    site = load_config(config)
    chosen = roles or detect_roles(site, systemd_root)
    findings = examine(site, Options(chosen, systemd_root, munge_socket, clock_offset_s,
                                     stores=not no_stores, link_rate=link_rate,
                                     roles_given=bool(roles)))
    if as_json:
        click.echo(json.dumps({"roles": list(chosen), "ok": not failed(findings),
                               "findings": [asdict(f) for f in findings]}, indent=2))
    else:
        shown = [f for f in findings if show_all or f.level != OK]
        for finding in shown:
            click.echo(f"{finding.level.upper():5}  {finding.line()}")
        errors = sum(f.level == ERROR for f in findings)
        checked = sum(f.level != INFO for f in findings)
        click.echo(f"{checked} checks on this host ({', '.join(chosen)}): "
                   f"{errors} error(s), {sum(f.level == 'warn' for f in findings)} "
                   "warning(s)" + ("" if errors else "; all good"))
    if failed(findings):
        raise SystemExit(ExitCode.DOCTOR_FAILED)
