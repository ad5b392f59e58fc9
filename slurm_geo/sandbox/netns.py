"""Runs sandbox.sites' commands: create, shape, cut, heal and remove the sites' network
namespaces, read each live WAN link back from the kernel, run a command inside a site.

The thin I/O layer: every decision (which command, from what is there) is in `sites`;
this module observes, runs each command checked, and turns a failure into one line.
Needs root, as `ip netns` does.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path

from slurm_geo.atomic import write_if_changed
from slurm_geo.errors import SandboxError
from slurm_geo.sandbox import site_readings, sites
from slurm_geo.sandbox.layout import SandboxLayout
from slurm_geo.sandbox.site_readings import EndState, WanState
from slurm_geo.sandbox.sites import Observed, Site, Topology, WanLink

HOME_REMOTE = (WanLink.HOME_REMOTE,)  # what the WAN of the two-site sandbox was

COMMAND_TIMEOUT_S = 30
NOT_UP = "the sandbox's sites are not up: run `slurm-geo sandbox up`"
INCOMPLETE = ("the sandbox's sites are incomplete ({missing} missing): "
              "run `slurm-geo sandbox up` to repair them")


def sandbox_topology(layout: SandboxLayout) -> Topology:
    return sites.topology(layout.network_prefix, layout.network_block_index)


# --- the sandbox's side: what `up`/`down` call, and the remembered rates -----------------


def up_sites(layout: SandboxLayout, wan_mbit: int | None = None) -> Topology:
    """Create or repair the sandbox's sites with every WAN link at `wan_mbit` (else each
    at its remembered rate, else 200 Mbit/s) and remember the rates; the links healed.
    For `Sandbox.up`."""
    rates = sites.link_rates(wan_mbit if wan_mbit is not None else remembered_link_rates(layout))
    _choose_block(layout)
    topo = sandbox_topology(layout)
    create(topo, rates)
    remember_link_rates(layout, rates)
    return topo


def _choose_block(layout: SandboxLayout) -> None:
    """Remember the sandbox's address block the first time its sites come up: the one its
    directory suggests, else the next one no other network here routes (two directories
    may suggest one block). A remembered block is kept; `create` refuses it if taken."""
    if layout.network_block_file.exists():
        return
    preferred = sites.topology(layout.network_prefix, layout.preferred_block_index)
    chosen = layout.preferred_block_index
    if not sites.is_up(preferred, observe(preferred)):
        found = site_readings.free_block_index(layout.network_prefix, chosen,
                                               _output(["ip", "-j", "route", "show"]))
        if found is None:
            raise SandboxError(f"every address block of {sites.NETWORK_RANGE} is routed "
                               "here already; take another sandbox's sites down first")
        chosen = found
    layout.root.mkdir(parents=True, exist_ok=True)
    layout.network_block_file.write_text(f"{chosen}\n")


def down_sites(layout: SandboxLayout) -> None:
    """Remove the sandbox's namespaces and links; call once its processes are stopped."""
    remove(sandbox_topology(layout))


def remembered_link_rates(layout: SandboxLayout) -> dict[WanLink, int]:
    """Each link's rate as last set, else 200 Mbit/s. A two-site sandbox's file has only
    `wan_mbit`, its one WAN's: the links it lacked start at that rate too."""
    try:
        saved = json.loads(layout.sites_file.read_text())
        by_name = saved.get("link_mbit") or {}
        fallback = saved.get("wan_mbit", sites.DEFAULT_WAN_MBIT)
        return sites.link_rates({link: int(by_name.get(link.value, fallback))
                                 for link in WanLink})
    except (FileNotFoundError, ValueError, TypeError, AttributeError, SandboxError):
        return sites.link_rates(sites.DEFAULT_WAN_MBIT)


def remembered_wan_mbit(layout: SandboxLayout) -> int:
    """home-remote's remembered rate: what `sandbox wan --mbit` sets."""
    return remembered_link_rates(layout)[WanLink.HOME_REMOTE]


def remember_link_rates(layout: SandboxLayout, rates: Mapping[WanLink, int]) -> None:
    write_if_changed(layout.sites_file, json.dumps(
        {"link_mbit": {link.value: rates[link] for link in WanLink}}) + "\n")


def remember_link_rate(layout: SandboxLayout, which: WanLink, mbit: int) -> None:
    remember_link_rates(layout, {**remembered_link_rates(layout), which: mbit})


# --- operations on a topology ----------------------------------------------------------


def create(topo: Topology, rates: int | Mapping[WanLink, int]) -> None:
    """Make the topology whole with its links at `rates` (one for every link, or each
    link's), whatever part of it exists (idempotent)."""
    _require_root()
    observed = observe(topo)
    if not sites.is_up(topo, observed):
        clashes = site_readings.conflicting_routes(topo,
                                                   _output(["ip", "-j", "route", "show"]))
        if clashes:
            raise SandboxError(f"addresses {topo.block} are already routed here "
                               f"({'; '.join(clashes)}); take that network down or give "
                               "the sandbox another --dir")
    _run_all(sites.plan_up(topo, observed, rates), "creating the sandbox's sites")


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


def set_wan_rate(topo: Topology, mbit: int, which: WanLink = WanLink.HOME_REMOTE) -> None:
    _require_up(topo)
    _run_all(sites.plan_rate(topo, which, mbit), f"setting {which.value} to {mbit} Mbit/s")


def cut_wan(topo: Topology, links: Iterable[WanLink] = HOME_REMOTE) -> None:
    links = tuple(links)
    _require_up(topo)
    _run_all(sites.plan_cut(topo, links), f"cutting {_names(links)}")


def heal_wan(topo: Topology, links: Iterable[WanLink] = HOME_REMOTE) -> None:
    links = tuple(links)
    observed = _require_up(topo)
    _run_all(sites.plan_heal(topo, observed, links), f"healing {_names(links)}")


def isolate_site(topo: Topology, site: Site) -> None:
    """Cut both links of `site`: it reaches neither other site (its LAN, if home, stays)."""
    cut_wan(topo, sites.links_of(site))


def heal_all(topo: Topology) -> None:
    heal_wan(topo, WanLink)


def wan_state(topo: Topology, which: WanLink = WanLink.HOME_REMOTE) -> WanState:
    """A WAN link as the kernel has it now (rate and cut of each end)."""
    _require_up(topo)
    return _link_state(topo, which)


def wan_states(topo: Topology) -> tuple[WanState, ...]:
    """Every WAN link as the kernel has it now, in WanLink's order."""
    _require_up(topo)
    return tuple(_link_state(topo, which) for which in WanLink)


def observe(topo: Topology) -> Observed:
    listed = site_readings.parse_netns_names(_output(["ip", "-j", "netns", "list"]))
    namespaces = listed & set(topo.namespaces)
    interfaces: set[tuple[str | None, str]] = set()
    for namespace in (None, *topo.namespaces):
        if namespace is None or namespace in namespaces:
            shown = _output(sites.ip_cmd(namespace, "-j", "link", "show"))
            names = site_readings.parse_link_names(shown)
            interfaces |= {(namespace, name) for name in names & set(sites.all_ifnames(topo))}
    htb_roots, cut = set(), set()
    for end in (end for link in topo.wan_links for end in link.ends):
        if (end.namespace, end.ifname) in interfaces:
            qdiscs = _output(sites.tc_cmd(end, "-j", "qdisc", "show", "dev", end.ifname))
            if site_readings.parse_has_htb_root(qdiscs):
                htb_roots.add(end.ifname)
                filters = _output(sites.tc_cmd(end, "-j", "filter", "show", "dev", end.ifname,
                                            "parent", sites.HTB_ROOT))
                if site_readings.parse_is_cut(filters):
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


def _link_state(topo: Topology, which: WanLink) -> WanState:
    link = topo.wan_link(which)
    return WanState(which, _end_state(link.a), _end_state(link.b))


def _end_state(end: sites.End) -> EndState:
    classes = _output(sites.tc_cmd(end, "class", "show", "dev", end.ifname))
    filters = _output(sites.tc_cmd(end, "-j", "filter", "show", "dev", end.ifname,
                                "parent", sites.HTB_ROOT))
    assert end.namespace is not None  # WAN ends live in the sites
    return EndState(end.ifname, end.namespace, site_readings.parse_class_mbit(classes),
                    site_readings.parse_is_cut(filters))


def _names(links: tuple[WanLink, ...]) -> str:
    return ", ".join(link.value for link in links)


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
