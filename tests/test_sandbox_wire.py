"""The kernel's byte counters of a WAN link, and what crossed between two readings."""

from __future__ import annotations

import ipaddress

import pytest

from slurm_geo.sandbox.sites import End, Site, WanLink
from slurm_geo.sandbox.wire import Crossing, EndBytes, LinkBytes, crossing, end_bytes


def test_a_crossing_is_what_each_end_sent_between_two_readings():
    before = LinkBytes(WanLink.HOME_REMOTE, EndBytes(100, 40), EndBytes(40, 100))
    after = LinkBytes(WanLink.HOME_REMOTE, EndBytes(1100, 90), EndBytes(90, 1100))
    got = crossing(before, after)
    assert got == Crossing(WanLink.HOME_REMOTE, 1000, 50)
    assert got.from_site(Site.HOME) == 1000 and got.from_site(Site.REMOTE) == 50
    assert got.total == 1050


def test_readings_of_two_links_do_not_make_a_crossing():
    one = LinkBytes(WanLink.HOME_REMOTE, EndBytes(0, 0), EndBytes(0, 0))
    other = LinkBytes(WanLink.HOME_CONTROL, EndBytes(0, 0), EndBytes(0, 0))
    with pytest.raises(ValueError):
        crossing(one, other)


def test_the_counters_are_the_kernels():
    got = end_bytes(End(None, "lo", ipaddress.IPv4Interface("127.0.0.1/8")))
    assert got.sent > 0 and got.received > 0
