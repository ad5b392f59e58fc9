"""What `ip -j` and `tc` print about a sandbox's sites, parsed, and each WAN link's state
from it: pure, tested on samples as iproute2 6.1 prints them (`sandbox.netns` reads them)."""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass

from slurm_geo.sandbox.sites import (
    DROP_CLASS,
    HTB_ROOT,
    NETWORK_RANGE,
    RATE_CLASS,
    Site,
    Topology,
    WanLink,
    links_of,
    topology,
)


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
    """One WAN link as the kernel has it: each end's rate and cut."""

    link: WanLink
    a: EndState
    b: EndState

    @property
    def ends(self) -> tuple[EndState, EndState]:
        return (self.a, self.b)

    @property
    def mbit(self) -> float | None:
        """The rate when both ends agree (they always do unless someone used tc by hand)."""
        rates = {end.mbit for end in self.ends}
        return rates.pop() if len(rates) == 1 else None

    @property
    def cut(self) -> bool:
        return any(end.cut for end in self.ends)

    def describe(self) -> str:
        one, other = (site.value for site in self.link.sites)
        rate = f"{self.mbit:g} Mbit/s" if self.mbit is not None else (
            "rates differ: " + ", ".join(f"{e.ifname} {e.mbit}" for e in self.ends))
        if all(end.cut for end in self.ends):
            state = f"CUT ({one} and {other} are partitioned)"
        elif self.cut:
            state = "HALF CUT (" + ", ".join(e.ifname for e in self.ends if e.cut) + " drops)"
        else:
            state = "up"
        return f"WAN {one} <-> {other}: {rate}, {state}"


def isolated_sites(states: Iterable[WanState]) -> list[Site]:
    """The sites every link of which is cut (at either end): they reach no other site."""
    cut = {state.link for state in states if state.cut}
    return [site for site in Site if set(links_of(site)) <= cut]


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


def free_block_index(prefix: str, preferred: int, route_json: str) -> int | None:
    """The first B from `preferred` on (1-254, wrapping) whose 10.77.B.0/24 no route of
    the machine's namespace reaches through a device not the sandbox's; None when all are
    taken. Two sandboxes whose directories suggest one block so get two."""
    for step in range(254):
        index = 1 + (preferred - 1 + step) % 254
        if not conflicting_routes(topology(prefix, index), route_json):
            return index
    return None


def _is_range_blackhole(row: dict) -> bool:
    """The route every sandbox's `up` keeps for NETWORK_RANGE (routes), no clash."""
    return row.get("type") == "blackhole" and row.get("dst") == str(NETWORK_RANGE)
