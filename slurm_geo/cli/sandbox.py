"""`slurm-geo sandbox ...`: bring the local two-cluster sandbox up and down."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import click

from slurm_geo.cells import table
from slurm_geo.errors import SandboxError
from slurm_geo.sandbox.layout import ROOT_ENV, root_from_env
from slurm_geo.sandbox.sites import Site, WanLink

DIR_HELP = f"Sandbox directory (default: ${ROOT_ENV} or /var/lib/slurm-geo/sandbox)."

dir_option = click.option("--dir", "root", type=click.Path(path_type=Path), default=None,
                          help=DIR_HELP)


def existing_root(explicit: Path | None) -> Path:
    """The sandbox directory, which every command but `up` needs to exist: a mistyped
    --dir is refused, never created and left behind empty."""
    root = root_from_env(explicit)
    if not root.is_dir():
        raise SandboxError(f"there is no sandbox in {root} (no such directory); bring one up "
                           f"with `slurm-geo sandbox up --dir {root}`, or name it with --dir")
    return root


@click.group()
def sandbox() -> None:
    """Run a local two-cluster Slurm sandbox: `onprem` (CLI) and `rented` (slurmrestd)."""


@sandbox.command()
@dir_option
@click.option("--port-base", type=click.IntRange(1024, 65000), default=None,
              help="First of the sandbox's ports (default 16800; fixed at first `up`).")
@click.option("--wan-mbit", type=click.IntRange(1, 10_000), default=None,
              help="Rate of every WAN link between the sites, Mbit/s [default: each "
                   "link's rate last set, else 200].")
@click.option("--replicated", is_flag=True, default=None,
              help="Run federation replicas at home and at control, their state in the "
                   "sites' etcd, as a site that must survive losing home does (fixed at "
                   "first `up`).")
@click.option("--remote-slurm", type=click.Choice(["host", "provider"]), default=None,
              help="The rented cluster's Slurm: the host's, with slurm-geo's plugins "
                   "(host), or a stock Slurm 26.05 on the provider's own root filesystem, "
                   "reached only through slurmrestd (provider) [default: provider; fixed at "
                   "first `up`; a sandbox made before this option keeps host].")
def up(root: Path | None, port_base: int | None, wan_mbit: int | None,
       replicated: bool | None, remote_slurm: str | None) -> None:
    """Make the sites (home, remote and control network namespaces joined by shaped WAN
    links) and start munge, MariaDB, the etcd members, both clusters, slurmrestd behind
    TLS, the S3 server and the slurm-geo daemons, each in its site (idempotent)."""
    from slurm_geo.sandbox.lifecycle import Sandbox

    Sandbox(root_from_env(root), port_base, replicated, remote_slurm).up(
        progress=lambda msg: click.echo(msg, err=True), wan_mbit=wan_mbit)


@sandbox.command()
@dir_option
@click.option("--purge", is_flag=True, help="Also delete the sandbox directory.")
def down(root: Path | None, purge: bool) -> None:
    """Stop every process the sandbox started, and nothing else."""
    from slurm_geo.sandbox.lifecycle import Sandbox

    Sandbox(existing_root(root)).down(purge=purge)


@sandbox.command()
@dir_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(root: Path | None, as_json: bool) -> None:
    """Show each component up or down; exits 1 unless all are up."""
    from slurm_geo.sandbox.lifecycle import Sandbox

    rows = Sandbox(existing_root(root)).status()
    if as_json:
        click.echo(json.dumps([asdict(row) for row in rows], indent=2))
    else:
        width = max(len(row.name) for row in rows)
        for row in rows:
            state = click.style("up", fg="green") if row.up else click.style("down", fg="red")
            pid = str(row.pid or "-")
            click.echo(f"{row.name:<{width}}  {state:<4}  pid {pid:<8} {row.endpoint}")
    sys.exit(0 if all(row.up for row in rows) else 1)


@sandbox.command()
@dir_option
@click.argument("cluster")
def env(root: Path | None, cluster: str) -> None:
    """Print `export` lines for CLUSTER: eval "$(slurm-geo sandbox env onprem)"."""
    from slurm_geo.errors import ConfigError
    from slurm_geo.sandbox.lifecycle import Sandbox

    sandbox = Sandbox(existing_root(root))
    if sandbox.layout.cluster(cluster) is None:  # an unknown cluster: 3, as everywhere
        names = ", ".join(c.name for c in sandbox.layout.clusters)
        raise ConfigError(f"cluster '{cluster}' is not a sandbox cluster (known clusters: "
                          f"{names})")
    for line in sandbox.env_lines(cluster, as_root=os.geteuid() == 0):
        click.echo(line)


@sandbox.command()
@dir_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def demo(root: Path | None, as_json: bool) -> None:
    """Run one job on each sandbox cluster and print their accounting rows."""
    from slurm_geo.config import load_config
    from slurm_geo.sandbox.demo import all_completed, run_job_on_each_cluster
    from slurm_geo.sandbox.lifecycle import Sandbox

    site = load_config(Sandbox(existing_root(root)).layout.site_config)
    records = run_job_on_each_cluster(site, progress=lambda msg: click.echo(msg, err=True))
    if as_json:
        click.echo(json.dumps([_record_json(r) for r in records], indent=2))
    else:
        click.echo(_accounting_table(records))
    sys.exit(0 if all_completed(records) else 1)


LINK_NAMES = [link.value for link in WanLink]
SITE_NAMES = [site.value for site in Site]


@sandbox.command()
@dir_option
@click.option("--link", "link_name", type=click.Choice(LINK_NAMES), default="home-remote",
              show_default=True, help="The link --mbit, --cut and --heal act on.")
@click.option("--mbit", type=click.IntRange(1, 10_000), default=None,
              help="Set the link's rate, both directions, keeping connections (remembered).")
@click.option("--cut", is_flag=True, help="Partition the link's two sites: it drops all.")
@click.option("--heal", is_flag=True, help="End a --cut of the link; the rate is as it was.")
@click.option("--isolate", type=click.Choice(SITE_NAMES), default=None,
              help="Cut both links of a site: it reaches neither other site.")
@click.option("--heal-all", is_flag=True, help="Heal every link.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def wan(root: Path | None, link_name: str, mbit: int | None, cut: bool, heal: bool,
        isolate: str | None, heal_all: bool, as_json: bool) -> None:
    """Show or change the shaped links between the sandbox's sites (home-remote unless
    --link names another); one line per link."""
    from slurm_geo.sandbox import netns
    from slurm_geo.sandbox.layout import SandboxLayout

    changes = [name for name, given in (("--cut", cut), ("--heal", heal),
                                        ("--isolate", isolate), ("--heal-all", heal_all))
               if given]
    if len(changes) > 1:
        raise click.UsageError(f"{' and '.join(changes)} exclude each other")
    layout = SandboxLayout(existing_root(root))
    topo = netns.sandbox_topology(layout)
    which = WanLink(link_name)
    if mbit is not None:
        netns.set_wan_rate(topo, mbit, which)
        netns.remember_link_rate(layout, which, mbit)
    if cut:
        netns.cut_wan(topo, [which])
    if heal:
        netns.heal_wan(topo, [which])
    if isolate:
        netns.isolate_site(topo, Site(isolate))
    if heal_all:
        netns.heal_all(topo)
    states = netns.wan_states(topo)
    if as_json:
        click.echo(json.dumps(_wan_json(topo, states, netns.remembered_link_rates(layout)),
                              indent=2))
    else:
        click.echo(_wan_lines(states))


def _wan_lines(states) -> str:
    from slurm_geo.sandbox.site_readings import isolated_sites

    lines = [state.describe() for state in states]
    lines += [f"{site.value} is isolated: every link of it is cut"
              for site in isolated_sites(states)]
    return "\n".join(lines)


def _wan_json(topo, states, configured) -> dict:
    """home-remote's at the top, as the two-site sandbox printed it, and every link's."""
    from slurm_geo.sandbox.site_readings import isolated_sites

    links = [{"link": state.link.value, "sites": [site.value for site in state.link.sites],
              "mbit": state.mbit, "cut": state.cut,
              "configured_mbit": configured[state.link],
              "ends": [asdict(end) for end in state.ends]} for state in states]
    home_remote = next(row for row in links if row["link"] == WanLink.HOME_REMOTE.value)
    return {
        **{key: home_remote[key] for key in ("mbit", "cut", "configured_mbit", "ends")},
        "links": links,
        "isolated": [site.value for site in isolated_sites(states)],
        "sites": {site.value: {"namespace": topo.namespace(site),
                               "address": str(topo.site_address(site))} for site in Site},
        "login_address": str(topo.login_address),
        "block": str(topo.block),
    }


@sandbox.command(name="exec", context_settings={"ignore_unknown_options": True,
                                                "allow_interspersed_args": False})
@dir_option
@click.argument("site", type=click.Choice(SITE_NAMES))
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def exec_(root: Path | None, site: str, command: tuple[str, ...]) -> None:
    """Run COMMAND inside SITE's network namespace: sandbox exec remote -- curl ..."""
    from slurm_geo.sandbox import netns
    from slurm_geo.sandbox.layout import SandboxLayout

    argv = list(command)
    if argv[:1] == ["--"]:  # click keeps the `--` once SITE has ended its options
        argv = argv[1:]
    if not argv:
        raise click.UsageError("name the command to run: sandbox exec SITE -- COMMAND...")
    topo = netns.sandbox_topology(SandboxLayout(existing_root(root)))
    netns.exec_replacing_this_process(topo, Site(site), argv)


def _record_json(record) -> dict:
    row = asdict(record)
    row["state"] = record.state.value
    for key in ("submit_time", "start_time", "end_time"):
        row[key] = row[key].isoformat() if row[key] else None
    return row


def _accounting_table(records) -> str:
    header = ("CLUSTER", "JOBID", "NAME", "STATE", "START (UTC)", "END (UTC)", "ELAPSED",
              "TRES")
    rows = [header] + [
        (r.cluster, str(r.job_id), r.name, r.state.value,
         r.start_time.strftime("%Y-%m-%d %H:%M:%S") if r.start_time else "-",
         r.end_time.strftime("%Y-%m-%d %H:%M:%S") if r.end_time else "-",
         f"{r.elapsed_s} s", ",".join(f"{k}={v}" for k, v in sorted(r.allocated_tres.items())))
        for r in records
    ]
    return table(rows)
