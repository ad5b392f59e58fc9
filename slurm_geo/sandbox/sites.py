r"""The sandbox's three sites as network namespaces joined by shaped links: pure, no I/O.

This module describes the topology and returns the exact `ip`/`tc` argv lists that create,
shape, cut, heal and remove it; `slurm_geo.sandbox.netns` runs them and reads the live
state back (`site_readings` parses it). Everything here is a function of its arguments,
tested without a kernel.

    login host (the machine's own namespace: admins, users, sbatch, curl)
      |  <prefix>lan-l  .5/30      LAN: not shaped, never cut
      |  <prefix>lan-h  .6/30      (the login host is at home)
    +-+---------------------------+   home-remote    +-------------------------------+
    | <prefix>home                |==================| <prefix>remote                |
    | site address 10.77.B.1 (lo) | wan-h .9/30      | site address 10.77.B.2 (lo)   |
    | onprem's slurmctld, slurmd, |     wan-r .10/30 | rented's slurmctld, slurmd,   |
    | the pfs store, an etcd      |                  | slurmrestd, the offsite S3,   |
    | member; forwards for the    |                  | an etcd member (sealed state  |
    | login host (its gateway)    |                  | only); forwards nothing       |
    +-------------+---------------+                  +---------------+---------------+
                  \  home-control                  control-remote  /
      hc-h .13/30  \                                              /  cr-r .18/30
                    \  hc-c .14/30                   cr-c .17/30  /
                    +-------------------------------------------+
                    | <prefix>control    site address 10.77.B.3 |
                    | a trusted room of the organisation (a DR  |
                    | room, a VM in another region): no GPUs, a |
                    | federation replica, the master key, an    |
                    | etcd member; forwards nothing             |
                    +-------------------------------------------+

    10.77.B.0/24   .1 .2 .3 site addresses (/32 on lo: home, remote, control)
                   .4/30  LAN            login host .5, home .6
                   .8/30  home-remote    home .9 (wan-h), remote .10 (wan-r)
                   .12/30 home-control   home .13 (hc-h), control .14 (hc-c)
                   .16/30 control-remote control .17 (cr-c), remote .18 (cr-r)

Why this shape:
- A triangle of WAN links, each pair of sites its own veth: losing home (its processes
  killed, its links cut) leaves control and remote talking over theirs, so the etcd
  members there keep a quorum and the control replica can take over.
- Each pair of sites talks over its direct link only: a site routes each other site's
  address over the link between them, from its own address, and nothing through the
  third site (no site but home forwards, and no site routes another's address via
  home). A cut link partitions its two sites from each other even while both still reach
  the third: a partition, not a detour.
- The login host is at home: it reaches home over the LAN, and remote and control only
  *through home's gateway* and the link from home, as an admin at home reaches a
  provider or the DR room. So what it sends to rented's REST API shares home-remote's
  rate and is partitioned by its cut; and once home is isolated the login host reaches
  neither control nor remote (`sandbox exec control -- ...` still runs commands there).
  Control and remote route the LAN's /30 over their link to home, for the replies.
- No transit through the login host: the machine's namespace has a link to home only,
  so nothing it forwards (whatever its ip_forward says) can carry a site's traffic to
  another; the sites reach each other only over their WAN veths.
- Each site's services bind to its site address, a /32 on the site's `lo`, reachable
  from everywhere the routes allow; 127.0.0.1 stays private to the site.
- Every address lies in one /24 per sandbox (10.77.B.0/24, B from the sandbox's
  directory), inside 10.77.0.0/16; no namespace has a default route, so nothing is routed
  off the machine. Each site's route for the whole /24 is a blackhole (its own links and
  the routes above are more specific): `replace` puts it in place of the route an older,
  two-site sandbox gave remote (the /24 over the WAN, which would carry remote's traffic
  to control's other addresses through home), and what no route names is dropped.

Shaping: each WAN end has an htb root (`1:`) with one class `1:10` at its link's rate (the
default class: all traffic, ARP included) whose leaf is a byte-limited fifo, and a class
`1:99` whose leaf is a fifo of limit 0 (drops everything). Egress of both ends is shaped,
so both directions get the rate; each link has its own rate. A rate change replaces class
1:10 and its fifo's limit in place (established connections keep their packets). A cut
adds one u32 filter sending every packet of both ends of a link to 1:99: a silent
partition (timeouts, as a real one), while the rate stays configured, so a heal (deleting
the filter) restores it exactly. Isolating a site cuts each of its two links. This kernel
has neither netem nor matchall/gact nor iptables, hence a drop class instead of a drop
action. No ARP crosses a WAN link (each end has its peer as a permanent neighbour, fixed
MACs), as none crosses a routed WAN: a cut drops IP only, and a heal is complete at once.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum

from slurm_geo.errors import SandboxError

NETWORK_RANGE = ipaddress.ip_network("10.77.0.0/16")
DEFAULT_WAN_MBIT = 200
MAX_WAN_MBIT = 10_000
IFNAME_MAX = 15  # IFNAMSIZ (16) less the NUL
_LONGEST_SUFFIX = "lan-l"
PREFIX_PATTERN = re.compile(r"^[a-z][a-z0-9]*-$")

HTB_ROOT = "1:"
RATE_CLASS = "1:10"  # `default 10` below: tc reads both as hex, consistently
DROP_CLASS = "1:99"
CUT_FILTER_PREF = "1"
# Measured on veth here (bench/wan_link.py): a token bucket of 2 ms of traffic (never below
# 32 KiB) and a queue of 80 ms (never below 256 KiB) give one bulk TCP stream 0.957 of the
# rate at 50, 200 and 1000 Mbit/s, which is TCP's payload share of a full frame (1448 of
# 1514 bytes). A 32 KiB queue at 200 Mbit/s dropped 560 packets and TCP crawled at 3.5
# Mbit/s (each loss waits out a 200 ms minimum RTO on a sub-millisecond path); an 8 KB
# bucket at 1000 Mbit/s gave 0.928.
BURST_S = 0.002
MIN_BURST_BYTES = 32 * 1024
QUEUE_S = 0.080
MIN_QUEUE_BYTES = 256 * 1024


class Site(Enum):
    """In the order of their site addresses (.1, .2, .3)."""

    HOME = "home"
    REMOTE = "remote"
    CONTROL = "control"


SITE_HOST = {Site.HOME: 1, Site.REMOTE: 2, Site.CONTROL: 3}  # the site address's last octet


class WanLink(Enum):
    """The shaped links of the triangle, each named by its two sites."""

    HOME_REMOTE = "home-remote"
    HOME_CONTROL = "home-control"
    CONTROL_REMOTE = "control-remote"

    @property
    def sites(self) -> tuple[Site, Site]:
        first, second = self.value.split("-")
        return (Site(first), Site(second))

    def joins(self, site: Site) -> bool:
        return site in self.sites


def links_of(site: Site) -> tuple[WanLink, ...]:
    """The two links `site` has: what isolating it cuts."""
    return tuple(link for link in WanLink if link.joins(site))


def link_between(one: Site, other: Site) -> WanLink:
    return next(link for link in WanLink if set(link.sites) == {one, other})


# Each link's /30 (its base in the block; .0 and .4 are the site addresses' and the LAN's)
# and its ends' interface suffixes. home-remote keeps the names of the two-site sandbox's
# only WAN (wan-h, wan-r); the others are the link's initials and the end's site's.
_WAN_LINKS = {
    WanLink.HOME_REMOTE: (8, "wan-h", "wan-r"),
    WanLink.HOME_CONTROL: (12, "hc-h", "hc-c"),
    WanLink.CONTROL_REMOTE: (16, "cr-c", "cr-r"),
}


@dataclass(frozen=True)
class End:
    """One side of a veth pair: its namespace (None: the machine's own), name, address."""

    namespace: str | None
    ifname: str
    address: ipaddress.IPv4Interface

    @property
    def mac(self) -> str:
        """Locally administered, from the address: fixed, so a peer can know it."""
        return ":".join(f"{octet:02x}" for octet in (2, 0, *self.address.ip.packed))


@dataclass(frozen=True)
class Link:
    name: str
    a: End
    b: End
    shaped: bool

    @property
    def ends(self) -> tuple[End, End]:
        return (self.a, self.b)


@dataclass(frozen=True)
class Topology:
    """The sites and links of one sandbox, named from `prefix`, numbered in `block`."""

    prefix: str
    block: ipaddress.IPv4Network

    def namespace(self, site: Site) -> str:
        return f"{self.prefix}{site.value}"

    def site_address(self, site: Site) -> ipaddress.IPv4Address:
        return self.block[SITE_HOST[site]]

    @property
    def namespaces(self) -> tuple[str, ...]:
        return tuple(self.namespace(site) for site in Site)

    @property
    def lan(self) -> Link:
        """The login host's link to home: not shaped, never cut."""
        return Link("lan",
                    End(None, f"{self.prefix}lan-l", self._p2p(4, 1)),
                    End(self.namespace(Site.HOME), f"{self.prefix}lan-h", self._p2p(4, 2)),
                    shaped=False)

    def wan_link(self, which: WanLink) -> Link:
        """A shaped link between two sites: end `a` at the first site of its name."""
        base, a_suffix, b_suffix = _WAN_LINKS[which]
        a_site, b_site = which.sites
        return Link(which.value,
                    End(self.namespace(a_site), f"{self.prefix}{a_suffix}", self._p2p(base, 1)),
                    End(self.namespace(b_site), f"{self.prefix}{b_suffix}", self._p2p(base, 2)),
                    shaped=True)

    @property
    def wan(self) -> Link:
        """Home to remote: what `sandbox wan --mbit/--cut/--heal` act on by default."""
        return self.wan_link(WanLink.HOME_REMOTE)

    @property
    def wan_links(self) -> tuple[Link, ...]:
        return tuple(self.wan_link(which) for which in WanLink)

    @property
    def links(self) -> tuple[Link, ...]:
        return (self.lan, *self.wan_links)

    def end_at(self, which: WanLink, site: Site) -> End:
        link = self.wan_link(which)
        return link.a if site is which.sites[0] else link.b

    @property
    def login_address(self) -> ipaddress.IPv4Address:
        return self.lan.a.address.ip

    def _p2p(self, base: int, host: int) -> ipaddress.IPv4Interface:
        return ipaddress.IPv4Interface(f"{self.block[base + host]}/30")


def topology(prefix: str, block_index: int) -> Topology:
    """The topology named `prefix...` in 10.77.<block_index>.0/24; a bad name is one line."""
    if not PREFIX_PATTERN.match(prefix):
        raise SandboxError(f"network prefix {prefix!r} must be lowercase letters and digits "
                           "ending in '-', e.g. 'sg1a2b-'")
    if len(prefix) + len(_LONGEST_SUFFIX) > IFNAME_MAX:
        raise SandboxError(f"network prefix {prefix!r} is too long: interface names "
                           f"'{prefix}{_LONGEST_SUFFIX}' must fit in {IFNAME_MAX} characters; "
                           f"use at most {IFNAME_MAX - len(_LONGEST_SUFFIX)}")
    if not 0 <= block_index <= 255:
        raise SandboxError(f"address block {block_index} is outside 10.77.0-255.0/24")
    return Topology(prefix, ipaddress.IPv4Network(f"10.77.{block_index}.0/24"))


def check_wan_mbit(mbit: int) -> int:
    if not 1 <= mbit <= MAX_WAN_MBIT:
        raise SandboxError(f"WAN rate {mbit} Mbit/s is outside 1-{MAX_WAN_MBIT}; "
                           "pass --mbit with a value in that range")
    return mbit


def link_rates(rates: int | Mapping[WanLink, int]) -> dict[WanLink, int]:
    """Each link's rate, checked: one rate for all, or one per link (all of them)."""
    if isinstance(rates, int):
        return {link: check_wan_mbit(rates) for link in WanLink}
    missing = [link.value for link in WanLink if link not in rates]
    if missing:
        raise SandboxError(f"no rate given for link(s) {', '.join(missing)}")
    return {link: check_wan_mbit(rates[link]) for link in WanLink}


# --- commands ------------------------------------------------------------------------


def ip_cmd(namespace: str | None, *args: str) -> list[str]:
    return ["ip", *(["-n", namespace] if namespace else []), *args]


def tc_cmd(end: End, *args: str) -> list[str]:
    return ["tc", *(["-n", end.namespace] if end.namespace else []), *args]


def exec_argv(topo: Topology, site: Site, argv: list[str]) -> list[str]:
    """`argv` run inside `site`'s namespace (ip netns exec setns()es, then execs: same pid)."""
    return ["ip", "netns", "exec", topo.namespace(site), *argv]


def _sysctl(namespace: str, setting: str) -> list[str]:
    return ["ip", "netns", "exec", namespace, "sysctl", "-qw", setting]


def create_link(link: Link) -> list[str]:
    """Both ends made straight in their namespaces: neither ever exists in the wrong one."""
    return ["ip", "link", "add", link.a.ifname, *_netns_arg(link.a), "address", link.a.mac,
            "type", "veth", "peer", "name", link.b.ifname, *_netns_arg(link.b),
            "address", link.b.mac]


def _netns_arg(end: End) -> list[str]:
    return ["netns", end.namespace] if end.namespace else []


def address_and_up(end: End) -> list[list[str]]:
    return [ip_cmd(end.namespace, "link", "set", end.ifname, "address", end.mac),
            ip_cmd(end.namespace, "addr", "replace", str(end.address), "dev", end.ifname),
            ip_cmd(end.namespace, "link", "set", end.ifname, "up")]


def wan_neighbours(topo: Topology) -> list[list[str]]:
    """Each WAN end knows its peer's MAC for good, so no ARP crosses a WAN link, as none
    crosses a routed one: a cut drops only IP, and a heal is whole at once (with ARP,
    the neighbour entries failed during a cut and the first connection after took 1 s)."""
    return [ip_cmd(near.namespace, "neigh", "replace", str(far.address.ip), "lladdr", far.mac,
                   "dev", near.ifname, "nud", "permanent")
            for link in topo.wan_links for near, far in ((link.a, link.b), (link.b, link.a))]


def routes(topo: Topology) -> list[list[str]]:
    """Each namespace routes parts of the sandbox's block and nothing else (no default
    route): the login host all of it through home; each site the block to a blackhole,
    each other site's address over the link between them (from its own), and the LAN
    over its link to home (home has it on the LAN)."""
    lan = topo.lan
    plan = [ip_cmd(None, "route", "replace", str(topo.block), "via", str(lan.b.address.ip),
                   "dev", lan.a.ifname)]
    for site in Site:
        namespace = topo.namespace(site)
        plan.append(ip_cmd(namespace, "route", "replace", "blackhole", str(topo.block)))
        for other in Site:
            if other is not site:
                plan.append(_route_over(topo, site, other, f"{topo.site_address(other)}/32"))
        if site is not Site.HOME:
            plan.append(_route_over(topo, site, Site.HOME, str(lan.a.address.network)))
    return plan


def _route_over(topo: Topology, site: Site, toward: Site, destination: str) -> list[str]:
    """`destination` from `site` over its link to `toward`, from `site`'s own address."""
    which = link_between(site, toward)
    near, far = topo.end_at(which, site), topo.end_at(which, toward)
    return ip_cmd(topo.namespace(site), "route", "replace", destination,
                  "via", str(far.address.ip), "dev", near.ifname,
                  "src", str(topo.site_address(site)))


def range_blackhole() -> list[str]:
    """The login host sends the whole sandbox range nowhere but to the sites' blocks, each
    routed more specifically: without it, a probe of a site that is down would follow the
    default route off the machine. `down` keeps it: it drops only what no sandbox routes."""
    return ip_cmd(None, "route", "replace", "blackhole", str(NETWORK_RANGE))


def site_setup(topo: Topology, site: Site) -> list[list[str]]:
    namespace = topo.namespace(site)
    forward = "1" if site is Site.HOME else "0"  # home is the login host's gateway
    return [ip_cmd(namespace, "link", "set", "lo", "up"),
            ip_cmd(namespace, "addr", "replace", f"{topo.site_address(site)}/32", "dev", "lo"),
            _sysctl(namespace, f"net.ipv4.ip_forward={forward}")]


def burst_bytes(mbit: int) -> int:
    return max(MIN_BURST_BYTES, int(mbit * 1e6 / 8 * BURST_S))


def queue_bytes(mbit: int) -> int:
    return max(MIN_QUEUE_BYTES, int(mbit * 1e6 / 8 * QUEUE_S))


def rate_commands(end: End, mbit: int) -> list[list[str]]:
    """Class 1:10 and its queue at `mbit`: in place on a shaped end, so no reset."""
    burst = str(burst_bytes(mbit))
    return [
        tc_cmd(end, "class", "replace", "dev", end.ifname, "parent", HTB_ROOT,
            "classid", RATE_CLASS, "htb", "rate", f"{mbit}mbit", "ceil", f"{mbit}mbit",
            "burst", burst, "cburst", burst, "quantum", "60000"),
        tc_cmd(end, "qdisc", "replace", "dev", end.ifname, "parent", RATE_CLASS,
            "handle", "10:", "bfifo", "limit", str(queue_bytes(mbit))),
    ]


def shaping_commands(end: End, mbit: int, has_htb_root: bool) -> list[list[str]]:
    """The htb tree of a WAN end. htb's root cannot be `replace`d in place (the kernel
    refuses the change), so it is only made where it is missing; the rest is replaced."""
    root = [] if has_htb_root else [
        tc_cmd(end, "qdisc", "replace", "dev", end.ifname, "root", "handle", HTB_ROOT,
            "htb", "default", "10")]
    drop = [
        tc_cmd(end, "class", "replace", "dev", end.ifname, "parent", HTB_ROOT,
            "classid", DROP_CLASS, "htb", "rate", "8kbit", "ceil", "8kbit", "quantum", "1514"),
        tc_cmd(end, "qdisc", "replace", "dev", end.ifname, "parent", DROP_CLASS,
            "handle", "99:", "pfifo", "limit", "0"),
    ]
    return root + rate_commands(end, mbit) + drop


def cut_command(end: End) -> list[str]:
    # `replace` with a fixed handle: cutting a cut end changes nothing.
    return tc_cmd(end, "filter", "replace", "dev", end.ifname, "parent", HTB_ROOT,
               "protocol", "all", "pref", CUT_FILTER_PREF, "handle", "800::800",
               "u32", "match", "u32", "0", "0", "flowid", DROP_CLASS)


def heal_command(end: End) -> list[str]:
    return tc_cmd(end, "filter", "del", "dev", end.ifname, "parent", HTB_ROOT,
               "protocol", "all", "pref", CUT_FILTER_PREF)


# --- what is there, and the plans from it ----------------------------------------------


@dataclass(frozen=True)
class Observed:
    """What the kernel has of one topology: its namespaces, the interfaces found (as
    (namespace or None, name)), which WAN ends have the htb root and which are cut."""

    namespaces: frozenset[str] = frozenset()
    interfaces: frozenset[tuple[str | None, str]] = frozenset()
    htb_roots: frozenset[str] = frozenset()
    cut_ends: frozenset[str] = frozenset()

    def has(self, end: End) -> bool:
        return (end.namespace, end.ifname) in self.interfaces


def plan_up(topo: Topology, observed: Observed,
            rates: int | Mapping[WanLink, int]) -> list[list[str]]:
    """Commands taking whatever is there to the whole topology at `rates` (one for every
    link, or each link's), healed.

    Every command is idempotent (`replace`, `set ... up`) except creations, made only for
    what is missing; a link with one end missing is deleted and made again."""
    mbit = link_rates(rates)
    plan = [["ip", "netns", "add", ns] for ns in topo.namespaces if ns not in observed.namespaces]
    fresh: set[str] = set()  # interfaces made now: no qdisc, no filter on them yet
    for link in topo.links:
        present = [end for end in link.ends if observed.has(end)]
        if len(present) == 2:
            continue
        plan += [ip_cmd(end.namespace, "link", "del", end.ifname) for end in present]
        plan.append(create_link(link))
        fresh |= {end.ifname for end in link.ends}
    for site in Site:
        plan += site_setup(topo, site)
    for link in topo.links:
        for end in link.ends:
            plan += address_and_up(end)
    plan += [range_blackhole(), *wan_neighbours(topo), *routes(topo)]
    for which in WanLink:
        for end in topo.wan_link(which).ends:
            kept = end.ifname not in fresh
            plan += shaping_commands(end, mbit[which], kept and end.ifname in observed.htb_roots)
            if kept and end.ifname in observed.cut_ends:
                plan.append(heal_command(end))
    return plan


def plan_down(topo: Topology, observed: Observed) -> list[list[str]]:
    """The login host's end first (a veth dies with its peer), then each namespace."""
    plan = [ip_cmd(None, "link", "del", end.ifname)
            for link in topo.links for end in link.ends
            if end.namespace is None and observed.has(end)]
    return plan + [["ip", "netns", "del", ns] for ns in topo.namespaces
                   if ns in observed.namespaces]


def plan_rate(topo: Topology, which: WanLink, mbit: int) -> list[list[str]]:
    check_wan_mbit(mbit)
    return [cmd for end in topo.wan_link(which).ends for cmd in rate_commands(end, mbit)]


def plan_cut(topo: Topology, links: Iterable[WanLink]) -> list[list[str]]:
    return [cut_command(end) for which in links for end in topo.wan_link(which).ends]


def plan_heal(topo: Topology, observed: Observed, links: Iterable[WanLink]) -> list[list[str]]:
    return [heal_command(end) for which in links for end in topo.wan_link(which).ends
            if end.ifname in observed.cut_ends]


def is_up(topo: Topology, observed: Observed) -> bool:
    return all(ns in observed.namespaces for ns in topo.namespaces) and all(
        observed.has(end) for link in topo.links for end in link.ends)


def missing_parts(topo: Topology, observed: Observed) -> list[str]:
    """What is missing, for a one-line error."""
    names = [ns for ns in topo.namespaces if ns not in observed.namespaces]
    names += [end.ifname for link in topo.links for end in link.ends if not observed.has(end)]
    return names


def all_ifnames(topo: Topology) -> Iterable[str]:
    return (end.ifname for link in topo.links for end in link.ends)
