"""Runs sandbox.sites' commands: create, shape, cut, heal and remove the sites' network
namespaces, read the live WAN back from the kernel, run a command inside a site.

The thin I/O layer: every decision (which command, from what is there) is in `sites`;
this module observes, runs each command checked, and turns a failure into one line.
Needs root, as `ip netns` does.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path

from slurm_geo.atomic import write_if_changed
from slurm_geo.errors import SandboxError
from slurm_geo.sandbox import sites
from slurm_geo.sandbox.layout import SandboxLayout
from slurm_geo.sandbox.sites import Observed, Site, Topology, WanState

COMMAND_TIMEOUT_S = 30
NOT_UP = "the sandbox's sites are not up: run `slurm-geo sandbox up`"
INCOMPLETE = ("the sandbox's sites are incomplete ({missing} missing): "
              "run `slurm-geo sandbox up` to repair them")


def sandbox_topology(layout: SandboxLayout) -> Topology:
    return sites.topology(layout.network_prefix, layout.network_block_index)


# --- the sandbox's side: what `up`/`down` call, and the remembered rate -------------------


def up_sites(layout: SandboxLayout, wan_mbit: int | None = None) -> Topology:
    """Create or repair the sandbox's sites at `wan_mbit` (else the remembered rate, else
    200 Mbit/s) and remember it; the WAN ends healed. For `Sandbox.up`."""
    mbit = wan_mbit if wan_mbit is not None else remembered_wan_mbit(layout)
    topo = sandbox_topology(layout)
    create(topo, mbit)
    remember_wan_mbit(layout, mbit)
    return topo


def down_sites(layout: SandboxLayout) -> None:
    """Remove the sandbox's namespaces and links; call once its processes are stopped."""
    remove(sandbox_topology(layout))


def remembered_wan_mbit(layout: SandboxLayout) -> int:
    try:
        return int(json.loads(layout.sites_file.read_text())["wan_mbit"])
    except (FileNotFoundError, KeyError, ValueError, TypeError):
        return sites.DEFAULT_WAN_MBIT


def remember_wan_mbit(layout: SandboxLayout, mbit: int) -> None:
    write_if_changed(layout.sites_file, json.dumps({"wan_mbit": mbit}) + "\n")


# --- operations on a topology ----------------------------------------------------------


def create(topo: Topology, mbit: int) -> None:
    """Make the topology whole at `mbit`, whatever part of it exists (idempotent)."""
    _require_root()
    observed = observe(topo)
    if not sites.is_up(topo, observed):
        clashes = sites.conflicting_routes(topo, _output(["ip", "-j", "route", "show"]))
        if clashes:
            raise SandboxError(f"addresses {topo.block} are already routed here "
                               f"({'; '.join(clashes)}); take that network down or give "
                               "the sandbox another --dir")
    _run_all(sites.plan_up(topo, observed, mbit), "creating the sandbox's sites")


def remove(topo: Topology) -> None:
    """Delete the namespaces and links; refuses while processes still run inside (the
    namespace and its links would outlive its name)."""
    _require_root()
    observed = observe(topo)
    for namespace in topo.namespaces:
        if namespace in observed.namespaces:
            pids = _output(["ip", "netns", "pids", namespace]).split()
            if pids:
                raise SandboxError(f"processes {', '.join(pids[:8])} still run in network "
                                   f"namespace {namespace}; stop them (`slurm-geo sandbox "
                                   "down` does) before removing the sites")
    _run_all(sites.plan_down(topo, observed), "removing the sandbox's sites")


def set_wan_rate(topo: Topology, mbit: int) -> None:
    _require_up(topo)
    _run_all(sites.plan_rate(topo, mbit), f"setting the WAN to {mbit} Mbit/s")


def cut_wan(topo: Topology) -> None:
    _require_up(topo)
    _run_all(sites.plan_cut(topo), "cutting the WAN")


def heal_wan(topo: Topology) -> None:
    observed = _require_up(topo)
    _run_all(sites.plan_heal(topo, observed), "healing the WAN")


def wan_state(topo: Topology) -> WanState:
    """The WAN as the kernel has it now (rate and cut of each end)."""
    _require_up(topo)
    home, remote = (_end_state(end) for end in topo.wan.ends)
    return WanState(home, remote)


def observe(topo: Topology) -> Observed:
    listed = sites.parse_netns_names(_output(["ip", "-j", "netns", "list"]))
    namespaces = listed & set(topo.namespaces)
    interfaces: set[tuple[str | None, str]] = set()
    for namespace in (None, *topo.namespaces):
        if namespace is None or namespace in namespaces:
            names = sites.parse_link_names(_output(sites.ip_cmd(namespace, "-j", "link", "show")))
            interfaces |= {(namespace, name) for name in names & set(sites.all_ifnames(topo))}
    htb_roots, cut = set(), set()
    for end in topo.wan.ends:
        if (end.namespace, end.ifname) in interfaces:
            qdiscs = _output(sites.tc_cmd(end, "-j", "qdisc", "show", "dev", end.ifname))
            if sites.parse_has_htb_root(qdiscs):
                htb_roots.add(end.ifname)
                filters = _output(sites.tc_cmd(end, "-j", "filter", "show", "dev", end.ifname,
                                            "parent", sites.HTB_ROOT))
                if sites.parse_is_cut(filters):
                    cut.add(end.ifname)
    return Observed(frozenset(namespaces), frozenset(interfaces), frozenset(htb_roots),
                    frozenset(cut))


# --- running inside a site ---------------------------------------------------------------


def exec_in(topo: Topology, site: Site, argv: list[str], *, check: bool = False,
            env: Mapping[str, str] | None = None, timeout: float | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run `argv` in `site`'s namespace and wait, capturing its output as text."""
    return subprocess.run(sites.exec_argv(topo, site, argv), capture_output=True, text=True,
                          check=check, env=dict(env) if env is not None else None,
                          timeout=timeout, cwd=cwd)


def exec_replacing_this_process(topo: Topology, site: Site, argv: list[str]) -> None:
    """`sandbox exec`: become `argv` inside the site (its stdio, its exit status)."""
    _require_up(topo)
    full = sites.exec_argv(topo, site, argv)
    os.execvp(full[0], full)


# --- plumbing --------------------------------------------------------------------------


def _end_state(end: sites.End) -> sites.EndState:
    classes = _output(sites.tc_cmd(end, "class", "show", "dev", end.ifname))
    filters = _output(sites.tc_cmd(end, "-j", "filter", "show", "dev", end.ifname,
                                "parent", sites.HTB_ROOT))
    assert end.namespace is not None  # WAN ends live in the sites
    return sites.EndState(end.ifname, end.namespace, sites.parse_class_mbit(classes),
                          sites.parse_is_cut(filters))


def _require_up(topo: Topology) -> Observed:
    _require_root()
    observed = observe(topo)
    if not observed.namespaces:
        raise SandboxError(NOT_UP)
    if not sites.is_up(topo, observed):
        missing = ", ".join(sites.missing_parts(topo, observed))
        raise SandboxError(INCOMPLETE.format(missing=missing))
    return observed


def _require_root() -> None:
    if os.geteuid() != 0:
        raise SandboxError("the sandbox's sites are network namespaces, which need root; "
                           "rerun with sudo")


def _run_all(commands: list[list[str]], what: str) -> None:
    for argv in commands:
        _run(argv, what)


def _run(argv: list[str], what: str) -> str:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, check=False,
                              timeout=COMMAND_TIMEOUT_S)
    except FileNotFoundError:
        raise SandboxError(f"{what}: `{argv[0]}` is not installed; "
                           "install it with: apt-get install -y iproute2") from None
    except subprocess.TimeoutExpired:
        raise SandboxError(f"{what}: `{' '.join(argv)}` hung for {COMMAND_TIMEOUT_S} s") from None
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        raise SandboxError(f"{what}: `{' '.join(argv)}` failed: "
                           f"{detail[0] if detail else f'exit {proc.returncode}'}")
    return proc.stdout


def _output(argv: list[str]) -> str:
    return _run(argv, "reading the sandbox's network")
