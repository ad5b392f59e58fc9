"""sandbox.sites and sandbox.site_readings: the triangle of sites, its ip/tc command plans
and the parsers, without a kernel."""

from __future__ import annotations

import ipaddress
import itertools
import json
from pathlib import Path

import pytest

from slurm_geo.errors import SandboxError
from slurm_geo.sandbox import netns, site_readings, sites
from slurm_geo.sandbox.layout import SandboxLayout
from slurm_geo.sandbox.site_readings import EndState, WanState
from slurm_geo.sandbox.sites import End, Observed, Site, WanLink

TOPO = sites.topology("sg1a2b-", 7)
EVERY_WAN_END = frozenset(end.ifname for link in TOPO.wan_links for end in link.ends)
EVERYTHING = Observed(
    namespaces=frozenset(TOPO.namespaces),
    interfaces=frozenset((end.namespace, end.ifname) for link in TOPO.links for end in link.ends),
    htb_roots=EVERY_WAN_END,
)
HOME, REMOTE, CONTROL = Site.HOME, Site.REMOTE, Site.CONTROL
HR, HC, CR = WanLink.HOME_REMOTE, WanLink.HOME_CONTROL, WanLink.CONTROL_REMOTE


def joined(plan: list[list[str]]) -> list[str]:
    return [" ".join(argv) for argv in plan]


def end(namespace: str | None, ifname: str, address: str) -> End:
    return End(namespace and f"sg1a2b-{namespace}", f"sg1a2b-{ifname}",
               ipaddress.IPv4Interface(f"10.77.7.{address}/30"))


# --- the topology ------------------------------------------------------------------------


def test_names_and_addresses_of_a_topology():
    assert TOPO.namespaces == ("sg1a2b-home", "sg1a2b-remote", "sg1a2b-control")
    assert [str(TOPO.site_address(s)) for s in Site] == ["10.77.7.1", "10.77.7.2", "10.77.7.3"]
    assert (TOPO.lan.a, TOPO.lan.b) == (end(None, "lan-l", "5"), end("home", "lan-h", "6"))
    assert TOPO.wan == TOPO.wan_link(HR)   # what `sandbox wan` acts on by default
    assert [link.name for link in TOPO.links] == [
        "lan", "home-remote", "home-control", "control-remote"]
    assert [link.shaped for link in TOPO.links] == [False, True, True, True]


@pytest.mark.parametrize("which, a, b", [
    (HR, end("home", "wan-h", "9"), end("remote", "wan-r", "10")),
    (HC, end("home", "hc-h", "13"), end("control", "hc-c", "14")),
    (CR, end("control", "cr-c", "17"), end("remote", "cr-r", "18")),
])
def test_the_triangle_each_pair_of_sites_its_own_link(which, a, b):
    link = TOPO.wan_link(which)
    assert (link.a, link.b) == (a, b)
    assert [TOPO.namespace(site) for site in which.sites] == [a.namespace, b.namespace]
    assert (TOPO.end_at(which, which.sites[0]), TOPO.end_at(which, which.sites[1])) == (a, b)


@pytest.mark.parametrize("site, links", [
    (HOME, (HR, HC)), (REMOTE, (HR, CR)), (CONTROL, (HC, CR))])
def test_each_site_has_two_links_one_to_each_other_site(site, links):
    assert sites.links_of(site) == links
    for which in links:
        other = next(s for s in which.sites if s is not site)
        assert sites.link_between(site, other) is sites.link_between(other, site) is which


@pytest.mark.parametrize("prefix", ["sg1a2b-", "sgt32768-", "abcdefghi-"])
def test_every_interface_name_fits_the_kernels_limit(prefix):
    topo = sites.topology(prefix, 0)
    names = list(sites.all_ifnames(topo))
    assert len(names) == 8 and len(set(names)) == 8
    assert all(len(name) <= sites.IFNAME_MAX for name in names)


@pytest.mark.parametrize("block", [0, 7, 255])
def test_every_address_is_private_inside_the_documented_range(block):
    topo = sites.topology("sg-", block)
    addresses = [topo.site_address(s) for s in Site] + [
        end.address.ip for link in topo.links for end in link.ends]
    assert len(set(addresses)) == len(addresses)
    assert all(a.is_private and a in topo.block and a in sites.NETWORK_RANGE for a in addresses)
    # the four /30s overlap neither each other nor the site addresses
    networks = [link.a.address.network for link in topo.links]
    assert all(link.a.address.network == link.b.address.network for link in topo.links)
    assert not [(x, y) for x, y in itertools.combinations(networks, 2) if x.overlaps(y)]
    assert not [a for s in Site for n in networks if (a := topo.site_address(s)) in n]
    # and MACs, made from the addresses, are unique too
    macs = [end.mac for link in topo.links for end in link.ends]
    assert len(set(macs)) == len(macs)


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


@pytest.mark.parametrize("rates, expected, says", [
    (200, {HR: 200, HC: 200, CR: 200}, None),
    ({HR: 50, HC: 100, CR: 150}, {HR: 50, HC: 100, CR: 150}, None),
    ({HR: 50, CR: 150}, None, "no rate given for link.s. home-control"),
    ({HR: 50, HC: 0, CR: 150}, None, "--mbit"),
    (20_000, None, "--mbit"),
])
def test_link_rates_one_for_all_or_each_links(rates, expected, says):
    if says is None:
        assert sites.link_rates(rates) == expected
    else:
        with pytest.raises(SandboxError, match=says):
            sites.link_rates(rates)


def test_a_sandbox_layout_names_its_own_network_from_its_directory():
    one, other = SandboxLayout(Path("/var/tmp/a")), SandboxLayout(Path("/var/tmp/b"))
    assert one.network_prefix == SandboxLayout(Path("/var/tmp/a")).network_prefix
    assert one.network_prefix != other.network_prefix
    for layout in (one, other):
        assert sites.PREFIX_PATTERN.match(layout.network_prefix)
        assert 1 <= layout.network_block_index <= 254  # 0 and 255 are the tests'
        sites.topology(layout.network_prefix, layout.network_block_index)


@pytest.mark.parametrize("saved, rates", [
    (None, {HR: 200, HC: 200, CR: 200}),                        # never set
    ({"wan_mbit": 80}, {HR: 80, HC: 80, CR: 80}),               # a two-site sandbox's file
    ({"link_mbit": {"home-remote": 50, "home-control": 70, "control-remote": 90}},
     {HR: 50, HC: 70, CR: 90}),
    ({"link_mbit": {"home-control": 70}}, {HR: 200, HC: 70, CR: 200}),
    ({"link_mbit": {"home-remote": "fast"}}, {HR: 200, HC: 200, CR: 200}),
    ([1, 2], {HR: 200, HC: 200, CR: 200}),
])
def test_remembered_rates_per_link(tmp_path, saved, rates):
    layout = SandboxLayout(tmp_path)
    if saved is not None:
        layout.sites_file.write_text(json.dumps(saved))
    assert netns.remembered_link_rates(layout) == rates
    assert netns.remembered_wan_mbit(layout) == rates[HR]


def test_remembering_one_links_rate_keeps_the_others(tmp_path):
    layout = SandboxLayout(tmp_path)
    netns.remember_link_rates(layout, {HR: 50, HC: 60, CR: 70})
    netns.remember_link_rate(layout, HC, 10)
    assert netns.remembered_link_rates(layout) == {HR: 50, HC: 10, CR: 70}


# --- routes: each pair of sites meets only over its own link ------------------------------


def routes_by_namespace() -> dict[str | None, list[list[str]]]:
    found: dict[str | None, list[list[str]]] = {}
    for argv in sites.routes(TOPO):
        found.setdefault(argv[2] if argv[1] == "-n" else None, []).append(argv)
    return found


def destination_of(route: list[str]) -> str:
    """`... route replace [blackhole] DESTINATION ...`"""
    after = route[route.index("replace") + 1:]
    return after[1] if after[0] == "blackhole" else after[0]


def route_to(namespace: str | None, destination: str) -> list[str]:
    return next(argv for argv in routes_by_namespace()[namespace]
                if argv[argv.index("replace") + 1] == destination)


def test_routes_give_no_namespace_a_default_route_and_keep_to_the_block():
    for argv in sites.routes(TOPO):
        assert destination_of(argv) != "default"
        assert ipaddress.ip_network(destination_of(argv)).subnet_of(TOPO.block)


def test_the_sandbox_range_is_a_blackhole_on_the_login_host_and_no_clash():
    """A site that is down is unreachable, not reached through the default route."""
    assert sites.range_blackhole() == ["ip", "route", "replace", "blackhole", "10.77.0.0/16"]
    assert sites.range_blackhole() in sites.plan_up(TOPO, sites.Observed(), 200)
    kept = '[{"type":"blackhole","dst":"10.77.0.0/16","flags":[]}]'
    assert site_readings.conflicting_routes(TOPO, kept) == []


@pytest.mark.parametrize("site, destination, dev, via", [
    # each other site's address over the direct link, never through the third
    (HOME, "10.77.7.2/32", "wan-h", "10.77.7.10"),
    (HOME, "10.77.7.3/32", "hc-h", "10.77.7.14"),
    (REMOTE, "10.77.7.1/32", "wan-r", "10.77.7.9"),
    (REMOTE, "10.77.7.3/32", "cr-r", "10.77.7.17"),
    (CONTROL, "10.77.7.1/32", "hc-c", "10.77.7.13"),
    (CONTROL, "10.77.7.2/32", "cr-c", "10.77.7.18"),
    # the login host's LAN over each site's link to home (for the replies)
    (REMOTE, "10.77.7.4/30", "wan-r", "10.77.7.9"),
    (CONTROL, "10.77.7.4/30", "hc-c", "10.77.7.13"),
])
def test_each_pair_of_sites_talks_over_its_direct_link_from_its_own_address(
        site, destination, dev, via):
    argv = route_to(TOPO.namespace(site), destination)
    assert argv[argv.index("dev") + 1] == f"sg1a2b-{dev}"
    assert argv[argv.index("via") + 1] == via
    assert argv[argv.index("src") + 1] == str(TOPO.site_address(site))


def test_each_site_routes_its_neighbours_and_the_lan_and_blackholes_the_rest():
    for site in Site:
        found = routes_by_namespace()[TOPO.namespace(site)]
        others = [f"{TOPO.site_address(s)}/32" for s in Site if s is not site]
        lan = [] if site is HOME else ["10.77.7.4/30"]       # home has it on the LAN
        assert found[0][-2:] == ["blackhole", "10.77.7.0/24"]
        assert [destination_of(argv) for argv in found[1:]] == others + lan


def test_the_login_host_routes_only_through_home():
    (login,) = routes_by_namespace()[None]
    assert login == ["ip", "route", "replace", "10.77.7.0/24", "via", "10.77.7.6",
                     "dev", "sg1a2b-lan-l"]
    # No link joins the login host and another site: nothing can transit through it.
    assert all(end.namespace in (None, "sg1a2b-home") for end in TOPO.lan.ends)


def test_only_home_forwards():
    setups = joined([cmd for site in Site for cmd in sites.site_setup(TOPO, site)])
    assert "ip netns exec sg1a2b-home sysctl -qw net.ipv4.ip_forward=1" in setups
    assert "ip netns exec sg1a2b-remote sysctl -qw net.ipv4.ip_forward=0" in setups
    assert "ip netns exec sg1a2b-control sysctl -qw net.ipv4.ip_forward=0" in setups
    assert "ip -n sg1a2b-control link set lo up" in setups
    assert "ip -n sg1a2b-control addr replace 10.77.7.3/32 dev lo" in setups


# --- plans ---------------------------------------------------------------------------------


def test_up_from_nothing_creates_everything_in_order():
    plan = joined(sites.plan_up(TOPO, Observed(), 200))
    assert plan[:7] == [
        "ip netns add sg1a2b-home",
        "ip netns add sg1a2b-remote",
        "ip netns add sg1a2b-control",
        "ip link add sg1a2b-lan-l address 02:00:0a:4d:07:05 type veth peer name sg1a2b-lan-h "
        "netns sg1a2b-home address 02:00:0a:4d:07:06",
        "ip link add sg1a2b-wan-h netns sg1a2b-home address 02:00:0a:4d:07:09 type veth "
        "peer name sg1a2b-wan-r netns sg1a2b-remote address 02:00:0a:4d:07:0a",
        "ip link add sg1a2b-hc-h netns sg1a2b-home address 02:00:0a:4d:07:0d type veth "
        "peer name sg1a2b-hc-c netns sg1a2b-control address 02:00:0a:4d:07:0e",
        "ip link add sg1a2b-cr-c netns sg1a2b-control address 02:00:0a:4d:07:11 type veth "
        "peer name sg1a2b-cr-r netns sg1a2b-remote address 02:00:0a:4d:07:12",
    ]
    assert ("ip -n sg1a2b-remote neigh replace 10.77.7.9 lladdr 02:00:0a:4d:07:09 "
            "dev sg1a2b-wan-r nud permanent") in plan
    assert ("ip -n sg1a2b-control neigh replace 10.77.7.18 lladdr 02:00:0a:4d:07:12 "
            "dev sg1a2b-cr-c nud permanent") in plan
    assert sum(" neigh replace " in cmd for cmd in plan) == 6   # every WAN end, no LAN end
    htb = "tc -n sg1a2b-home qdisc replace dev sg1a2b-wan-h root handle 1: htb default 10"
    rate = ("tc -n sg1a2b-remote class replace dev sg1a2b-wan-r parent 1: classid 1:10 htb "
            "rate 200mbit ceil 200mbit burst 50000 cburst 50000 quantum 60000")
    assert htb in plan and rate in plan
    assert sum(" root handle 1: htb" in cmd for cmd in plan) == 6
    # addresses before routes (a route's next hop must be on an up link)
    first_route = next(i for i, cmd in enumerate(plan) if " route " in cmd)
    assert all(" addr " not in cmd for cmd in plan[first_route:])


def test_up_gives_each_link_its_own_rate():
    plan = joined(sites.plan_up(TOPO, EVERYTHING, {HR: 50, HC: 100, CR: 300}))
    for ifname, mbit in (("wan-h", 50), ("wan-r", 50), ("hc-h", 100), ("hc-c", 100),
                         ("cr-c", 300), ("cr-r", 300)):
        assert [cmd for cmd in plan if f"dev sg1a2b-{ifname} parent 1: classid 1:10" in cmd
                and f"rate {mbit}mbit" in cmd]


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
                   frozenset({"sg1a2b-wan-r", "sg1a2b-cr-c"}))
    assert [cmd for cmd in joined(sites.plan_up(TOPO, cut, 100)) if "filter" in cmd] == [
        "tc -n sg1a2b-remote filter del dev sg1a2b-wan-r parent 1: protocol all pref 1",
        "tc -n sg1a2b-control filter del dev sg1a2b-cr-c parent 1: protocol all pref 1"]


def test_down_deletes_the_login_hosts_end_then_the_namespaces():
    assert joined(sites.plan_down(TOPO, EVERYTHING)) == [
        "ip link del sg1a2b-lan-l", "ip netns del sg1a2b-home", "ip netns del sg1a2b-remote",
        "ip netns del sg1a2b-control"]
    assert sites.plan_down(TOPO, Observed()) == []


@pytest.mark.parametrize("mbit, burst, queue", [
    (1, 32 * 1024, 256 * 1024),
    (50, 32 * 1024, 500_000),
    (200, 50_000, 2_000_000),
    (1000, 250_000, 10_000_000),
])
def test_rate_change_in_place_with_burst_and_queue_for_the_rate(mbit, burst, queue):
    plan = joined(sites.plan_rate(TOPO, HR, mbit))
    assert len(plan) == 4 and not [cmd for cmd in plan if "root" in cmd or " del " in cmd]
    assert (f"tc -n sg1a2b-home class replace dev sg1a2b-wan-h parent 1: classid 1:10 htb "
            f"rate {mbit}mbit ceil {mbit}mbit burst {burst} cburst {burst} quantum 60000"
            ) in plan
    assert (f"tc -n sg1a2b-remote qdisc replace dev sg1a2b-wan-r parent 1:10 handle 10: "
            f"bfifo limit {queue}") in plan


@pytest.mark.parametrize("which, ends", [
    (HR, ["home wan-h", "remote wan-r"]),
    (HC, ["home hc-h", "control hc-c"]),
    (CR, ["control cr-c", "remote cr-r"]),
])
def test_a_rate_change_touches_its_link_alone(which, ends):
    plan = sites.plan_rate(TOPO, which, 30)
    touched = sorted({f"{argv[2].removeprefix('sg1a2b-')} {argv[6].removeprefix('sg1a2b-')}"
                      for argv in plan})
    assert touched == sorted(ends)


def cut_filter(namespace: str, ifname: str) -> str:
    return (f"tc -n sg1a2b-{namespace} filter replace dev sg1a2b-{ifname} parent 1: protocol "
            "all pref 1 handle 800::800 u32 match u32 0 0 flowid 1:99")


def test_cut_sends_both_ends_to_the_drop_class_and_heal_undoes_only_what_is_cut():
    """`sandbox wan --cut` as before the triangle: home-remote, both ends."""
    assert joined(sites.plan_cut(TOPO, netns.HOME_REMOTE)) == [
        cut_filter("home", "wan-h"), cut_filter("remote", "wan-r")]
    one_cut = Observed(cut_ends=frozenset({"sg1a2b-wan-h"}))
    assert joined(sites.plan_heal(TOPO, one_cut, netns.HOME_REMOTE)) == [
        "tc -n sg1a2b-home filter del dev sg1a2b-wan-h parent 1: protocol all pref 1"]
    assert sites.plan_heal(TOPO, EVERYTHING, WanLink) == []


@pytest.mark.parametrize("links, cut", [
    ([HC], [("home", "hc-h"), ("control", "hc-c")]),
    ([CR], [("control", "cr-c"), ("remote", "cr-r")]),
    # isolating a site cuts both of its links, and no other
    (sites.links_of(HOME), [("home", "wan-h"), ("remote", "wan-r"), ("home", "hc-h"),
                            ("control", "hc-c")]),
    (sites.links_of(CONTROL), [("home", "hc-h"), ("control", "hc-c"), ("control", "cr-c"),
                               ("remote", "cr-r")]),
    (sites.links_of(REMOTE), [("home", "wan-h"), ("remote", "wan-r"), ("control", "cr-c"),
                              ("remote", "cr-r")]),
])
def test_cuts_per_link_and_per_site(links, cut):
    assert joined(sites.plan_cut(TOPO, links)) == [cut_filter(ns, ifname) for ns, ifname in cut]


def test_healing_every_link_deletes_only_the_filters_there_are():
    isolated = Observed(cut_ends=frozenset({"sg1a2b-wan-h", "sg1a2b-wan-r", "sg1a2b-hc-h",
                                            "sg1a2b-hc-c"}))
    assert joined(sites.plan_heal(TOPO, isolated, WanLink)) == [
        f"tc -n sg1a2b-{ns} filter del dev sg1a2b-{ifname} parent 1: protocol all pref 1"
        for ns, ifname in (("home", "wan-h"), ("remote", "wan-r"), ("home", "hc-h"),
                           ("control", "hc-c"))]
    assert sites.plan_heal(TOPO, isolated, [CR]) == []


def test_exec_argv_enters_the_sites_namespace():
    assert sites.exec_argv(TOPO, Site.REMOTE, ["curl", "-s", "x y"]) == [
        "ip", "netns", "exec", "sg1a2b-remote", "curl", "-s", "x y"]
    assert sites.exec_argv(TOPO, Site.CONTROL, ["true"])[:4] == [
        "ip", "netns", "exec", "sg1a2b-control"]


def test_what_is_missing_and_whether_it_is_up():
    assert sites.is_up(TOPO, EVERYTHING)
    assert not sites.is_up(TOPO, Observed())
    partial = Observed(frozenset({"sg1a2b-home", "sg1a2b-remote"}),
                       EVERYTHING.interfaces - {("sg1a2b-control", "sg1a2b-hc-c"),
                                                ("sg1a2b-control", "sg1a2b-cr-c")})
    assert sites.missing_parts(TOPO, partial) == [
        "sg1a2b-control", "sg1a2b-hc-c", "sg1a2b-cr-c"]
    assert not sites.is_up(TOPO, partial)


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
    assert site_readings.parse_class_mbit(text, classid) == pytest.approx(mbit) if mbit else \
        site_readings.parse_class_mbit(text, classid) is None


@pytest.mark.parametrize("text, cut", [(FILTER_CUT, True), ("[]", False), ("", False),
                                       (FILTER_CUT.replace("1:99", "1:10"), False)])
def test_parse_cut(text, cut):
    assert site_readings.parse_is_cut(text) is cut


@pytest.mark.parametrize("text, has", [
    (QDISCS, True), ("[]", False),
    ('[{"kind":"noqueue","handle":"0:","root":true,"refcnt":2,"options":{}}]', False),
    ('[{"kind":"htb","handle":"2:","root":true}]', False),
])
def test_parse_htb_root(text, has):
    assert site_readings.parse_has_htb_root(text) is has


def test_parse_names():
    assert site_readings.parse_netns_names('[{"name":"sg1a2b-home"},{"name":"x","id":0}]') == {
        "sg1a2b-home", "x"}
    assert site_readings.parse_netns_names("") == frozenset()
    links = '[{"ifindex":1,"ifname":"lo"},{"ifindex":2,"ifname":"a"}]'
    assert site_readings.parse_link_names(links) == {"lo", "a"}


@pytest.mark.parametrize("routes, clashes", [
    ('[{"dst":"default","gateway":"172.16.0.1","dev":"eth0"}]', []),
    ('[{"dst":"10.77.7.0/24","gateway":"10.77.7.6","dev":"sg1a2b-lan-l"}]', []),   # ours
    ('[{"dst":"10.77.7.0/24","dev":"sgffff-lan-l"}]', ["10.77.7.0/24 dev sgffff-lan-l"]),
    ('[{"dst":"10.0.0.0/8","dev":"eth1"}]', ["10.0.0.0/8 dev eth1"]),
    ('[{"dst":"10.77.8.0/24","dev":"eth1"},{"dst":"fe80::/64","dev":"eth0"}]', []),
    ('[{"dst":"10.77.7.5","dev":"eth1"}]', ["10.77.7.5 dev eth1"]),
])
def test_routes_of_someone_else_into_our_block(routes, clashes):
    assert site_readings.conflicting_routes(TOPO, routes) == clashes


@pytest.mark.parametrize("routes, preferred, chosen", [
    ("[]", 7, 7),
    ('[{"dst":"10.77.7.0/24","dev":"sgffff-lan-l"}]', 7, 8),      # another sandbox holds it
    ('[{"dst":"10.77.7.0/24","dev":"sg1a2b-lan-l"}]', 7, 7),      # our own, from before
    ('[{"dst":"10.77.254.0/24","dev":"eth1"}]', 254, 1),            # wraps round
    ('[{"dst":"10.77.0.0/16","dev":"eth1"}]', 7, None),             # all of them taken
    ('[{"type":"blackhole","dst":"10.77.0.0/16"}]', 7, 7),          # every sandbox's own
])
def test_a_sandbox_takes_the_next_free_block_when_its_own_is_routed(routes, preferred, chosen):
    assert site_readings.free_block_index("sg1a2b-", preferred, routes) == chosen


@pytest.mark.parametrize("which, a, b, says", [
    (HR, (200.0, False), (200.0, False), "WAN home <-> remote: 200 Mbit/s, up"),
    (HR, (50.0, True), (50.0, True), "WAN home <-> remote: 50 Mbit/s, CUT (home and remote "
                                     "are partitioned)"),
    (HR, (50.0, True), (50.0, False), "WAN home <-> remote: 50 Mbit/s, HALF CUT (a drops)"),
    (HR, (50.0, False), (70.0, False), "WAN home <-> remote: rates differ: a 50.0, b 70.0, up"),
    (HC, (20.0, True), (20.0, True), "WAN home <-> control: 20 Mbit/s, CUT (home and control "
                                     "are partitioned)"),
    (CR, (1000.0, False), (1000.0, False), "WAN control <-> remote: 1000 Mbit/s, up"),
])
def test_wan_state_in_one_line(which, a, b, says):
    state = WanState(which, EndState("a", "ns-a", *a), EndState("b", "ns-b", *b))
    assert state.describe() == says
    assert state.cut is (a[1] or b[1])


def states(*cut: WanLink) -> list[WanState]:
    return [WanState(which, EndState("a", "x", 200.0, which in cut),
                     EndState("b", "y", 200.0, False)) for which in WanLink]


@pytest.mark.parametrize("cut, isolated", [
    ((), []),
    ((HR,), []),                      # home and remote partitioned, each still has control
    ((HR, HC), [HOME]),
    ((HC, CR), [CONTROL]),
    ((HR, CR), [REMOTE]),
    ((HR, HC, CR), [HOME, REMOTE, CONTROL]),
])
def test_a_site_is_isolated_when_every_link_of_it_is_cut(cut, isolated):
    assert site_readings.isolated_sites(states(*cut)) == isolated
