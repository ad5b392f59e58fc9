"""The sandbox's two sites as network namespaces joined by shaped links: pure, no I/O.

This module describes the topology and returns the exact `ip`/`tc` argv lists that create,
shape, cut, heal and remove it; `slurm_geo.sandbox.netns` runs them and reads the live
state back. Everything here is a function of its arguments, tested without a kernel.

    login host (the machine's own namespace: admins, users, sbatch, curl)
      |  <prefix>lan-l  10.77.B.5/30      LAN: not shaped, never cut
      |  <prefix>lan-h  10.77.B.6/30      (the login host is at home)
    +-+------------------------------+        +------------------------------------+
    | <prefix>home                   |  WAN   | <prefix>remote                     |
    | site address 10.77.B.1 (lo)    |========| site address 10.77.B.2 (lo)        |
    | onprem's slurmctld, slurmd,    | shaped | rented's slurmctld, slurmd,        |
    | the pfs store, home's S3       |  (htb) | slurmrestd, the offsite S3         |
    | forwards LAN <-> WAN (gateway) |        | forwards nothing                   |
    +--------------------------------+        +------------------------------------+
      <prefix>wan-h 10.77.B.9/30  <---veth--->  <prefix>wan-r 10.77.B.10/30

Why this shape:
- The login host is at home: it reaches home over the LAN and remote only *through home's
  gateway and the WAN*, so what it sends to rented's REST API shares the WAN's rate and
  is partitioned by a cut, as a home admin's traffic to a provider would be.
- No transit through the login host: the machine's namespace has a link to home only,
  so nothing it forwards (whatever its ip_forward says) can carry remote's traffic to
  home; home and remote reach each other only over the WAN veth.
- Each site's services bind to its site address, a /32 on the site's `lo`, reachable
  from everywhere the routes allow; 127.0.0.1 stays private to the site.
- Every address lies in one /24 per sandbox (10.77.B.0/24, B from the sandbox's
  directory), inside 10.77.0.0/16; no namespace has a default route, so nothing is routed
  off the machine.

Shaping: each WAN end has an htb root (`1:`) with one class `1:10` at the WAN rate (the
default class: all traffic, ARP included) whose leaf is a byte-limited fifo, and a class
`1:99` whose leaf is a fifo of limit 0 (drops everything). Egress of both ends is shaped,
so both directions get the rate. A rate change replaces class 1:10 and its fifo's limit in
place (established connections keep their packets). A cut adds one u32 filter sending every
packet of both ends to 1:99: a silent partition (timeouts, as a real one), while the rate
stays configured, so a heal (deleting the filter) restores it exactly. This kernel has
neither netem nor matchall/gact nor iptables, hence a drop class instead of a drop action.
No ARP crosses the WAN (each end has its peer as a permanent neighbour, fixed MACs), as
none crosses a routed WAN: a cut drops IP only, and a heal is complete at once.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Iterable
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
    HOME = "home"
    REMOTE = "remote"


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
        return self.block[1] if site is Site.HOME else self.block[2]

    @property
    def namespaces(self) -> tuple[str, str]:
        return (self.namespace(Site.HOME), self.namespace(Site.REMOTE))

    @property
    def lan(self) -> Link:
        """The login host's link to home: not shaped, never cut."""
        return Link("lan",
                    End(None, f"{self.prefix}lan-l", self._p2p(4, 1)),
                    End(self.namespace(Site.HOME), f"{self.prefix}lan-h", self._p2p(4, 2)),
                    shaped=False)

    @property
    def wan(self) -> Link:
        """Home to remote, the only path between the sites: shaped, and what a cut cuts."""
        return Link("wan",
                    End(self.namespace(Site.HOME), f"{self.prefix}wan-h", self._p2p(8, 1)),
                    End(self.namespace(Site.REMOTE), f"{self.prefix}wan-r", self._p2p(8, 2)),
                    shaped=True)

    @property
    def links(self) -> tuple[Link, Link]:
        return (self.lan, self.wan)

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
    """Each WAN end knows its peer's MAC for good, so no ARP crosses the WAN, as none
    crosses a routed one: a cut drops only IP, and a heal is whole at once (with ARP,
    the neighbour entries failed during a cut and the first connection after took 1 s)."""
    wan = topo.wan
    return [ip_cmd(near.namespace, "neigh", "replace", str(far.address.ip), "lladdr", far.mac,
                   "dev", near.ifname, "nud", "permanent")
            for near, far in ((wan.a, wan.b), (wan.b, wan.a))]


def routes(topo: Topology) -> list[list[str]]:
    """Each namespace routes the sandbox's block and nothing else (no default route)."""
    home, remote, lan, wan = Site.HOME, Site.REMOTE, topo.lan, topo.wan
    return [
        # the login host: the whole block through home's gateway
        ip_cmd(None, "route", "replace", str(topo.block), "via", str(lan.b.address.ip),
            "dev", lan.a.ifname),
        # home: remote's site address over the WAN, from home's own
        ip_cmd(topo.namespace(home), "route", "replace", f"{topo.site_address(remote)}/32",
            "via", str(wan.b.address.ip), "dev", wan.a.ifname,
            "src", str(topo.site_address(home))),
        # remote: everything of the block (home, the login host) over the WAN
        ip_cmd(topo.namespace(remote), "route", "replace", str(topo.block),
            "via", str(wan.a.address.ip), "dev", wan.b.ifname,
            "src", str(topo.site_address(remote))),
    ]


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


def plan_up(topo: Topology, observed: Observed, mbit: int) -> list[list[str]]:
    """Commands taking whatever is there to the whole topology at `mbit`, healed.

    Every command is idempotent (`replace`, `set ... up`) except creations, made only for
    what is missing; a link with one end missing is deleted and made again."""
    check_wan_mbit(mbit)
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
    for end in topo.wan.ends:
        kept = end.ifname not in fresh
        plan += shaping_commands(end, mbit, kept and end.ifname in observed.htb_roots)
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


def plan_rate(topo: Topology, mbit: int) -> list[list[str]]:
    check_wan_mbit(mbit)
    return [cmd for end in topo.wan.ends for cmd in rate_commands(end, mbit)]


def plan_cut(topo: Topology) -> list[list[str]]:
    return [cut_command(end) for end in topo.wan.ends]


def plan_heal(topo: Topology, observed: Observed) -> list[list[str]]:
    return [heal_command(end) for end in topo.wan.ends if end.ifname in observed.cut_ends]


def is_up(topo: Topology, observed: Observed) -> bool:
    return all(ns in observed.namespaces for ns in topo.namespaces) and all(
        observed.has(end) for link in topo.links for end in link.ends)


# --- parsing what `ip -j` and `tc` print -------------------------------------------------


def parse_netns_names(ip_json: str) -> frozenset[str]:
    """`ip -j netns list` (empty output when there is none)."""
    return frozenset(row["name"] for row in _json_rows(ip_json))


def parse_link_names(ip_json: str) -> frozenset[str]:
    """`ip -j link show`."""
    return frozenset(row["ifname"] for row in _json_rows(ip_json))


def parse_has_htb_root(tc_json: str) -> bool:
    """`tc -j qdisc show dev X`: is our htb (handle 1:) the root qdisc?"""
    return any(row.get("root") and row.get("kind") == "htb" and row.get("handle") == HTB_ROOT
               for row in _json_rows(tc_json))


def parse_is_cut(tc_json: str) -> bool:
    """`tc -j filter show dev X`: does a filter send traffic to the drop class?"""
    return any((row.get("options") or {}).get("flowid") == DROP_CLASS
               for row in _json_rows(tc_json))


_RATE = re.compile(r"\brate (\d+(?:\.\d+)?)([KMG]?)bit\b")
_UNIT_MBIT = {"": 1e-6, "K": 1e-3, "M": 1.0, "G": 1e3}


def parse_class_mbit(tc_text: str, classid: str = RATE_CLASS) -> float | None:
    """`tc class show dev X` (its htb lines have no JSON form in iproute2 6.1): the rate
    of `classid` in Mbit/s, None when the class is missing."""
    for line in tc_text.splitlines():
        words = line.split()
        if len(words) > 2 and words[:2] == ["class", "htb"] and words[2] == classid:
            match = _RATE.search(line)
            return float(match.group(1)) * _UNIT_MBIT[match.group(2)] if match else None
    return None


def _json_rows(text: str) -> list[dict]:
    text = text.strip()
    return json.loads(text) if text else []


@dataclass(frozen=True)
class EndState:
    ifname: str
    namespace: str
    mbit: float | None
    cut: bool


@dataclass(frozen=True)
class WanState:
    """The WAN as the kernel has it: each end's rate and cut."""

    home: EndState
    remote: EndState

    @property
    def ends(self) -> tuple[EndState, EndState]:
        return (self.home, self.remote)

    @property
    def mbit(self) -> float | None:
        """The rate when both ends agree (they always do unless someone used tc by hand)."""
        rates = {end.mbit for end in self.ends}
        return rates.pop() if len(rates) == 1 else None

    @property
    def cut(self) -> bool:
        return any(end.cut for end in self.ends)

    def describe(self) -> str:
        rate = f"{self.mbit:g} Mbit/s" if self.mbit is not None else (
            "rates differ: " + ", ".join(f"{e.ifname} {e.mbit}" for e in self.ends))
        if all(end.cut for end in self.ends):
            state = "CUT (home and remote are partitioned)"
        elif self.cut:
            state = "HALF CUT (" + ", ".join(e.ifname for e in self.ends if e.cut) + " drops)"
        else:
            state = "up"
        return f"WAN home <-> remote: {rate}, {state}"


def missing_parts(topo: Topology, observed: Observed) -> list[str]:
    """What is missing, for a one-line error."""
    names = [ns for ns in topo.namespaces if ns not in observed.namespaces]
    names += [end.ifname for link in topo.links for end in link.ends if not observed.has(end)]
    return names


def conflicting_routes(topo: Topology, route_json: str) -> list[str]:
    """Routes of the machine's namespace into our block through a device not ours (from
    `ip -j route show`): another sandbox or network already uses the block."""
    ours = {topo.lan.a.ifname}
    clashes = []
    for row in _json_rows(route_json):
        dst = row.get("dst", "")
        if dst in ("default", "") or row.get("dev") in ours or _is_range_blackhole(row):
            continue
        try:
            network = ipaddress.ip_network(dst, strict=False)
        except ValueError:
            continue
        if network.version == 4 and network.overlaps(topo.block):
            clashes.append(f"{dst} dev {row.get('dev')}")
    return clashes


def _is_range_blackhole(row: dict) -> bool:
    """The route every sandbox's `up` keeps for NETWORK_RANGE (routes), no clash."""
    return row.get("type") == "blackhole" and row.get("dst") == str(NETWORK_RANGE)


def all_ifnames(topo: Topology) -> Iterable[str]:
    return (end.ifname for link in topo.links for end in link.ends)
