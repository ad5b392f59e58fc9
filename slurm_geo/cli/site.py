"""`slurm-geo site install`: put slurm-geo's pieces in place on a Slurm site from the
installed package (slurm_geo.site.install), and print the configuration lines to add."""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath

import click


@click.group()
def site() -> None:
    """Install slurm-geo on a Slurm site: hooks, units, SPANK plugin, helper."""


@site.command("install")
@click.option("--root", type=click.Path(file_okay=False, path_type=Path), default=Path("/"),
              show_default=True, metavar="DIR",
              help="Install under DIR (a staging or image root); the installed files still "
                   "name the paths they will have on the site.")
@click.option("--prefix", default="/usr/local", show_default=True, metavar="PREFIX",
              help="Hooks and helper in PREFIX/libexec/slurm-geo, the plugin in "
                   "PREFIX/lib/slurm-geo, man pages and completion under PREFIX/share.")
@click.option("--slurm-include", type=click.Path(file_okay=False, path_type=Path),
              default=Path("/usr/include"), show_default=True, metavar="DIR",
              help="Where the installed Slurm's headers are (slurm/spank.h).")
@click.option("--dry-run", is_flag=True, help="Say what would change; write nothing.")
@click.option("--json", "as_json", is_flag=True,
              help="Print {root, prefix, items: [{kind, path, installed_at, action, mode}], "
                   "setuid, slurm_conf, plugstack_conf, next} as JSON.")
def install(root: Path, prefix: str, slurm_include: Path, dry_run: bool,
            as_json: bool) -> None:
    """Install the Slurm hooks, the systemd units, the SPANK plugin (built here against
    the installed Slurm), the submit-as helper, man pages and bash completion.

    Idempotent: what is already in place (same bytes, mode and owner) is left alone and
    reported unchanged. It edits no configuration: it prints the slurm.conf and
    plugstack.conf lines to add. The units are installed, not enabled. The helper is
    setuid root, group slurm-geo, only when run as root with --root / where that group
    exists (the daemons' hosts); otherwise it is installed without setuid, and the command
    to finish it is printed.
    """
    from slurm_geo.site.install import Options, SiteInstallError
    from slurm_geo.site.install import install as run_install

    if not PurePosixPath(prefix).is_absolute():
        raise SiteInstallError(f"--prefix {prefix} is not an absolute path; give one such "
                               "as /usr/local")
    report = run_install(Options(man_pages=_man_pages(), completion=_bash_completion(),
                                 root=root, prefix=PurePosixPath(prefix),
                                 slurm_include=slurm_include, dry_run=dry_run))
    if as_json:
        click.echo(json.dumps(report.as_json(), indent=2))
        return
    data = report.as_json()
    verb = "would " if dry_run else ""
    for row in data["items"]:
        shown = row["installed_at"]
        said = row["action"] if row["action"] == "unchanged" else verb + row["action"]
        click.echo(f"{said:<15} {row['kind']:<10} {row['mode']}  {shown}")
    changed = sum(row["action"] != "unchanged" for row in data["items"])
    click.echo(f"{len(data['items'])} items, {changed} "
               f"{'would change' if dry_run else 'changed'}")
    if not report.setuid:
        click.echo(f"note: {report.layout.submit_as} is installed without setuid (not root, "
                   "--root is not /, or no group slurm-geo: docs/install.md, section 4)")
    click.echo("\nAdd to slurm.conf (nothing was edited):")
    for line in data["slurm_conf"]:
        click.echo(f"  {line}")
    click.echo("\nAdd to plugstack.conf (CLUSTER: this cluster's name in [clusters]):")
    click.echo(f"  {data['plugstack_conf']}")
    click.echo("\nThen:")
    for line in data["next"]:
        click.echo(f"  {line}")


def _man_pages() -> dict[str, str]:
    from slurm_geo.cli import PROG, cli
    from slurm_geo.cli.manpages import pages

    return pages(cli, PROG)


def _bash_completion() -> str:
    from click.shell_completion import get_completion_class

    from slurm_geo.cli import COMPLETE_VAR, PROG, cli

    script_class = get_completion_class("bash")
    assert script_class is not None
    return script_class(cli, {}, PROG, COMPLETE_VAR).source() + "\n"
