"""sandbox.sites: the topology, its ip/tc command plans and the parsers, without a kernel."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from slurm_geo.errors import SandboxError
from slurm_geo.sandbox import sites
from slurm_geo.sandbox.layout import SandboxLayout
from slurm_geo.sandbox.sites import End, EndState, Observed, Site, WanState

TOPO = sites.topology("sg1a2b-", 7)
EVERYTHING = Observed(
    namespaces=frozenset(TOPO.namespaces),
    interfaces=frozenset((end.namespace, end.ifname) for link in TOPO.links for end in link.ends),
    htb_roots=frozenset(end.ifname for end in TOPO.wan.ends),
)


def joined(plan: list[list[str]]) -> list[str]:
    return [" ".join(argv) for argv in plan]


# --- the topology ------------------------------------------------------------------------


def test_names_and_addresses_of_a_topology():
    assert TOPO.namespaces == ("sg1a2b-home", "sg1a2b-remote")
    assert (TOPO.wan.a, TOPO.wan.b) == (
        End("sg1a2b-home", "sg1a2b-wan-h", ipaddress.IPv4Interface("10.77.7.9/30")),
        End("sg1a2b-remote", "sg1a2b-wan-r", ipaddress.IPv4Interface("10.77.7.10/30")))
    assert (TOPO.lan.a, TOPO.lan.b) == (
        End(None, "sg1a2b-lan-l", ipaddress.IPv4Interface("10.77.7.5/30")),
        End("sg1a2b-home", "sg1a2b-lan-h", ipaddress.IPv4Interface("10.77.7.6/30")))
    assert [str(TOPO.site_address(s)) for s in Site] == ["10.77.7.1", "10.77.7.2"]
    assert (TOPO.wan.shaped, TOPO.lan.shaped) == (True, False)


@pytest.mark.parametrize("prefix", ["sg1a2b-", "sgt32768-", "abcdefghi-"])
def test_every_interface_name_fits_the_kernels_limit(prefix):
    topo = sites.topology(prefix, 0)
    assert all(len(name) <= sites.IFNAME_MAX for name in sites.all_ifnames(topo))


@pytest.mark.parametrize("block", [0, 7, 255])
def test_every_address_is_private_inside_the_documented_range(block):
    topo = sites.topology("sg-", block)
    addresses = [topo.site_address(s) for s in Site] + [
        end.address.ip for link in topo.links for end in link.ends]
    assert len(set(addresses)) == len(addresses)
    assert all(a.is_private and a in topo.block and a in sites.NETWORK_RANGE for a in addresses)
    # the two /30s and the site addresses do not overlap
    assert not topo.lan.a.address.network.overlaps(topo.wan.a.address.network)


@pytest.mark.parametrize("prefix, block, says", [
    ("SG-", 1, "lowercase letters and digits"),
    ("sg", 1, "ending in '-'"),
    ("sg x-", 1, "lowercase"),
    ("-sg-", 1, "lowercase"),
    ("abcdefghijk-", 1, "at most 10"),
    ("sg-", 256, "outside 10.77.0-255.0/24"),
    ("sg-", -1, "outside"),
])
def test_bad_names_and_blocks_are_one_line(prefix, block, says):
    with pytest.raises(SandboxError, match=says) as caught:
        sites.topology(prefix, block)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("mbit, ok", [(0, False), (1, True), (200, True), (10_000, True),
                                      (10_001, False), (-5, False)])
def test_wan_rates_in_range(mbit, ok):
    if ok:
        assert sites.check_wan_mbit(mbit) == mbit
    else:
        with pytest.raises(SandboxError, match="--mbit"):
            sites.check_wan_mbit(mbit)


def test_a_sandbox_layout_names_its_own_network_from_its_directory():
    one, other = SandboxLayout(Path("/var/tmp/a")), SandboxLayout(Path("/var/tmp/b"))
    assert one.network_prefix == SandboxLayout(Path("/var/tmp/a")).network_prefix
    assert one.network_prefix != other.network_prefix
    for layout in (one, other):
        assert sites.PREFIX_PATTERN.match(layout.network_prefix)
        assert 1 <= layout.network_block_index <= 254  # 0 and 255 are the tests'
        sites.topology(layout.network_prefix, layout.network_block_index)


# --- routes: sites meet only over the WAN ---------------------------------------------------


def test_routes_give_no_namespace_a_default_route_and_keep_to_the_block():
    for argv in sites.routes(TOPO):
        destination = argv[argv.index("replace") + 1]
        assert destination != "default"
        assert ipaddress.ip_network(destination).subnet_of(TOPO.block)


def test_the_sandbox_range_is_a_blackhole_on_the_login_host_and_no_clash():
    """A site that is down is unreachable, not reached through the default route."""
    assert sites.range_blackhole() == ["ip", "route", "replace", "blackhole", "10.77.0.0/16"]
    assert sites.range_blackhole() in sites.plan_up(TOPO, sites.Observed(), 200)
    kept = '[{"type":"blackhole","dst":"10.77.0.0/16","flags":[]}]'
    assert sites.conflicting_routes(TOPO, kept) == []


def test_the_login_host_routes_only_through_home_and_remote_only_over_the_wan():
    by_namespace = {(argv[2] if argv[1] == "-n" else None): argv for argv in sites.routes(TOPO)}
    login, home, remote = (by_namespace[None], by_namespace["sg1a2b-home"],
                           by_namespace["sg1a2b-remote"])
    assert login[-3:] == ["10.77.7.6", "dev", "sg1a2b-lan-l"]           # via home's LAN end
    assert home[home.index("dev") + 1] == "sg1a2b-wan-h"
    assert remote[remote.index("dev") + 1] == "sg1a2b-wan-r"
    assert remote[remote.index("via") + 1] == "10.77.7.9"               # home's WAN end
    # No link joins the login host and remote: nothing can transit through it.
    assert all(end.namespace != "sg1a2b-remote" for end in TOPO.lan.ends)


def test_only_home_forwards():
    setups = joined(sites.site_setup(TOPO, Site.HOME) + sites.site_setup(TOPO, Site.REMOTE))
    assert "ip netns exec sg1a2b-home sysctl -qw net.ipv4.ip_forward=1" in setups
    assert "ip netns exec sg1a2b-remote sysctl -qw net.ipv4.ip_forward=0" in setups
    assert "ip -n sg1a2b-home link set lo up" in setups
    assert "ip -n sg1a2b-remote addr replace 10.77.7.2/32 dev lo" in setups


# --- plans ---------------------------------------------------------------------------------


def test_up_from_nothing_creates_everything_in_order():
    plan = joined(sites.plan_up(TOPO, Observed(), 200))
    assert plan[:4] == [
        "ip netns add sg1a2b-home",
        "ip netns add sg1a2b-remote",
        "ip link add sg1a2b-lan-l address 02:00:0a:4d:07:05 type veth peer name sg1a2b-lan-h "
        "netns sg1a2b-home address 02:00:0a:4d:07:06",
        "ip link add sg1a2b-wan-h netns sg1a2b-home address 02:00:0a:4d:07:09 type veth "
        "peer name sg1a2b-wan-r netns sg1a2b-remote address 02:00:0a:4d:07:0a",
    ]
    assert ("ip -n sg1a2b-remote neigh replace 10.77.7.9 lladdr 02:00:0a:4d:07:09 "
            "dev sg1a2b-wan-r nud permanent") in plan
    htb = "tc -n sg1a2b-home qdisc replace dev sg1a2b-wan-h root handle 1: htb default 10"
    rate = ("tc -n sg1a2b-remote class replace dev sg1a2b-wan-r parent 1: classid 1:10 htb "
            "rate 200mbit ceil 200mbit burst 50000 cburst 50000 quantum 60000")
    assert htb in plan and rate in plan
    # addresses before routes (a route's next hop must be on an up link)
    first_route = next(i for i, cmd in enumerate(plan) if " route " in cmd)
    assert all(" addr " not in cmd for cmd in plan[first_route:])


def test_up_on_a_whole_topology_creates_nothing_and_leaves_htb_roots_alone():
    plan = joined(sites.plan_up(TOPO, EVERYTHING, 200))
    assert not [cmd for cmd in plan if " add " in cmd.replace("addr", "")
                or " root handle" in cmd or " del " in cmd]
    assert all(word in ("ip", "tc") for word in (cmd.split()[0] for cmd in plan))


def test_up_heals_a_cut_and_remakes_a_half_missing_link():
    half = Observed(EVERYTHING.namespaces,
                    EVERYTHING.interfaces - {("sg1a2b-remote", "sg1a2b-wan-r")},
                    EVERYTHING.htb_roots, cut_ends=frozenset({"sg1a2b-wan-h"}))
    plan = joined(sites.plan_up(TOPO, half, 100))
    assert "ip -n sg1a2b-home link del sg1a2b-wan-h" in plan
    assert any(cmd.startswith("ip link add sg1a2b-wan-h") for cmd in plan)
    # both ends are new: each gets a fresh htb root, and no heal of a filter now gone
    assert sum(" root handle 1: htb" in cmd for cmd in plan) == 2
    assert not [cmd for cmd in plan if "filter del" in cmd]
    cut = Observed(EVERYTHING.namespaces, EVERYTHING.interfaces, EVERYTHING.htb_roots,
                   frozenset({"sg1a2b-wan-r"}))
    assert joined(sites.plan_up(TOPO, cut, 100))[-1] == (
        "tc -n sg1a2b-remote filter del dev sg1a2b-wan-r parent 1: protocol all pref 1")


def test_down_deletes_the_login_hosts_end_then_the_namespaces():
    assert joined(sites.plan_down(TOPO, EVERYTHING)) == [
        "ip link del sg1a2b-lan-l", "ip netns del sg1a2b-home", "ip netns del sg1a2b-remote"]
    assert sites.plan_down(TOPO, Observed()) == []


@pytest.mark.parametrize("mbit, burst, queue", [
    (1, 32 * 1024, 256 * 1024),
    (50, 32 * 1024, 500_000),
    (200, 50_000, 2_000_000),
    (1000, 250_000, 10_000_000),
])
def test_rate_change_in_place_with_burst_and_queue_for_the_rate(mbit, burst, queue):
    plan = joined(sites.plan_rate(TOPO, mbit))
    assert len(plan) == 4 and not [cmd for cmd in plan if "root" in cmd or " del " in cmd]
    assert (f"tc -n sg1a2b-home class replace dev sg1a2b-wan-h parent 1: classid 1:10 htb "
            f"rate {mbit}mbit ceil {mbit}mbit burst {burst} cburst {burst} quantum 60000"
            ) in plan
    assert (f"tc -n sg1a2b-remote qdisc replace dev sg1a2b-wan-r parent 1:10 handle 10: "
            f"bfifo limit {queue}") in plan


def test_cut_sends_both_ends_to_the_drop_class_and_heal_undoes_only_what_is_cut():
    assert joined(sites.plan_cut(TOPO)) == [
        f"tc -n sg1a2b-{ns} filter replace dev sg1a2b-wan-{e} parent 1: protocol all pref 1 "
        f"handle 800::800 u32 match u32 0 0 flowid 1:99" for ns, e in (("home", "h"),
                                                                       ("remote", "r"))]
    one_cut = Observed(cut_ends=frozenset({"sg1a2b-wan-h"}))
    assert joined(sites.plan_heal(TOPO, one_cut)) == [
        "tc -n sg1a2b-home filter del dev sg1a2b-wan-h parent 1: protocol all pref 1"]
    assert sites.plan_heal(TOPO, EVERYTHING) == []


def test_exec_argv_enters_the_sites_namespace():
    assert sites.exec_argv(TOPO, Site.REMOTE, ["curl", "-s", "x y"]) == [
        "ip", "netns", "exec", "sg1a2b-remote", "curl", "-s", "x y"]


def test_what_is_missing_and_whether_it_is_up():
    assert sites.is_up(TOPO, EVERYTHING)
    assert not sites.is_up(TOPO, Observed())
    partial = Observed(frozenset({"sg1a2b-home"}), frozenset({(None, "sg1a2b-lan-l")}))
    assert sites.missing_parts(TOPO, partial) == [
        "sg1a2b-remote", "sg1a2b-lan-h", "sg1a2b-wan-h", "sg1a2b-wan-r"]


# --- parsers (samples as iproute2 6.1 prints them) ------------------------------------------

CLASS_TEXT = """class htb 1:99 root prio 0 rate 8Kbit ceil 8Kbit burst 1600b cburst 1600b
class htb 1:10 root leaf 10: prio 0 rate 1Gbit ceil 1Gbit burst 250Kb cburst 250Kb
"""
FILTER_CUT = ('[{"parent":"1:","protocol":"all","pref":1,"kind":"u32","chain":0},'
              '{"parent":"1:","protocol":"all","pref":1,"kind":"u32","chain":0,"options":'
              '{"fh":"800:","ht_divisor":1}},{"parent":"1:","protocol":"all","pref":1,'
              '"kind":"u32","chain":0,"options":{"fh":"800::800","order":2048,"key_ht":"800",'
              '"bkt":"0","flowid":"1:99","not_in_hw":true,"match":{"value":"0","mask":"0",'
              '"offmask":"","off":0}}}]')
QDISCS = ('[{"kind":"htb","handle":"1:","root":true,"refcnt":3,"options":{"r2q":10,'
          '"default":"0x10"}},{"kind":"pfifo","handle":"99:","parent":"1:99",'
          '"options":{"limit":0}}]')


@pytest.mark.parametrize("text, classid, mbit", [
    (CLASS_TEXT, "1:10", 1000.0),
    (CLASS_TEXT, "1:99", 0.008),
    ("class htb 1:10 root leaf 10: prio 0 rate 200Mbit ceil 200Mbit burst 50000b", "1:10",
     200.0),
    ("class htb 1:10 root leaf 10: prio 0 rate 1500Mbit ceil 1500Mbit", "1:10", 1500.0),
    ("class htb 1:10 root rate 512bit ceil 512bit", "1:10", 0.000512),
    (CLASS_TEXT, "1:20", None),
    ("", "1:10", None),
])
def test_parse_class_rate(text, classid, mbit):
    assert sites.parse_class_mbit(text, classid) == pytest.approx(mbit) if mbit else \
        sites.parse_class_mbit(text, classid) is None


@pytest.mark.parametrize("text, cut", [(FILTER_CUT, True), ("[]", False), ("", False),
                                       (FILTER_CUT.replace("1:99", "1:10"), False)])
def test_parse_cut(text, cut):
    assert sites.parse_is_cut(text) is cut


@pytest.mark.parametrize("text, has", [
    (QDISCS, True), ("[]", False),
    ('[{"kind":"noqueue","handle":"0:","root":true,"refcnt":2,"options":{}}]', False),
    ('[{"kind":"htb","handle":"2:","root":true}]', False),
])
def test_parse_htb_root(text, has):
    assert sites.parse_has_htb_root(text) is has


def test_parse_names():
    assert sites.parse_netns_names('[{"name":"sg1a2b-home"},{"name":"x","id":0}]') == {
        "sg1a2b-home", "x"}
    assert sites.parse_netns_names("") == frozenset()
    assert sites.parse_link_names('[{"ifindex":1,"ifname":"lo"},{"ifindex":2,"ifname":"a"}]') \
        == {"lo", "a"}


@pytest.mark.parametrize("routes, clashes", [
    ('[{"dst":"default","gateway":"172.16.0.1","dev":"eth0"}]', []),
    ('[{"dst":"10.77.7.0/24","gateway":"10.77.7.6","dev":"sg1a2b-lan-l"}]', []),   # ours
    ('[{"dst":"10.77.7.0/24","dev":"sgffff-lan-l"}]', ["10.77.7.0/24 dev sgffff-lan-l"]),
    ('[{"dst":"10.0.0.0/8","dev":"eth1"}]', ["10.0.0.0/8 dev eth1"]),
    ('[{"dst":"10.77.8.0/24","dev":"eth1"},{"dst":"fe80::/64","dev":"eth0"}]', []),
    ('[{"dst":"10.77.7.5","dev":"eth1"}]', ["10.77.7.5 dev eth1"]),
])
def test_routes_of_someone_else_into_our_block(routes, clashes):
    assert sites.conflicting_routes(TOPO, routes) == clashes


@pytest.mark.parametrize("home, remote, says", [
    ((200.0, False), (200.0, False), "WAN home <-> remote: 200 Mbit/s, up"),
    ((50.0, True), (50.0, True), "WAN home <-> remote: 50 Mbit/s, CUT (home and remote are "
                                 "partitioned)"),
    ((50.0, True), (50.0, False), "WAN home <-> remote: 50 Mbit/s, HALF CUT (h drops)"),
    ((50.0, False), (70.0, False), "WAN home <-> remote: rates differ: h 50.0, r 70.0, up"),
])
def test_wan_state_in_one_line(home, remote, says):
    state = WanState(EndState("h", "ns-h", *home), EndState("r", "ns-r", *remote))
    assert state.describe() == says
    assert state.cut is (home[1] or remote[1])
