"""Bytes on the sandbox's wire, from the kernel's own counters: what a benchmark says
crossed a WAN link is what the link's veth counted, never slurm-geo's accounting.

`link_bytes` reads both ends of a shaped link (`ip -s -j link show`, the interface's
64-bit counters); `Crossing` is the difference of two readings, per direction.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass

from slurm_geo.sandbox.sites import End, Site, Topology, WanLink


@dataclass(frozen=True)
class EndBytes:
    sent: int
    received: int


@dataclass(frozen=True)
class LinkBytes:
    """The counters of a WAN link's two ends, `a` at the first site of its name."""

    which: WanLink
    a: EndBytes
    b: EndBytes


@dataclass(frozen=True)
class Crossing:
    """What crossed a link between two readings: bytes each way, as its sender counted."""

    which: WanLink
    forward: int   # from the first site of its name to the second
    backward: int

    def from_site(self, site: Site) -> int:
        return self.forward if site is self.which.sites[0] else self.backward

    @property
    def total(self) -> int:
        return self.forward + self.backward


def end_bytes(end: End) -> EndBytes:
    argv = ["ip", *(["-n", end.namespace] if end.namespace else []), "-s", "-j", "link",
            "show", "dev", end.ifname]
    shown = json.loads(subprocess.run(argv, capture_output=True, text=True,
                                      check=True).stdout)[0]["stats64"]
    return EndBytes(int(shown["tx"]["bytes"]), int(shown["rx"]["bytes"]))


def link_bytes(topo: Topology, which: WanLink = WanLink.HOME_REMOTE) -> LinkBytes:
    link = topo.wan_link(which)
    return LinkBytes(which, end_bytes(link.a), end_bytes(link.b))


def crossing(before: LinkBytes, after: LinkBytes) -> Crossing:
    """Bytes that crossed between two readings of one link (pure)."""
    if before.which is not after.which:
        raise ValueError("two readings of different links")
    return Crossing(before.which, after.a.sent - before.a.sent, after.b.sent - before.b.sent)
