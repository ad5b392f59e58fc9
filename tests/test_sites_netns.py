"""sandbox.netns for real: namespaces, the triangle of links, shaping, cuts and heals of a
link or of a site in this kernel, as root.

Each test makes its own topology (prefix `sgt<pid>-`, block 10.77.0.0/24 or 10.77.255.0/24,
which no sandbox uses) and removes it, with every process it started in it. Rates are only
bounded from above: a loaded machine can make a transfer slower, never faster than the
shaping lets it (the +-15 % figure is bench/wan_link.py's).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from datetime import UTC, datetime
from pathlib import Path

import pytest

from slurm_geo.errors import SandboxError
from slurm_geo.sandbox import certs, etcd_members, netns, site_readings, sites, stages, throughput
from slurm_geo.sandbox.layout import SandboxLayout
from slurm_geo.sandbox.sites import Site, WanLink
from tests.helpers import eventually

pytestmark = [pytest.mark.root(reason="network namespaces need root"),
              pytest.mark.skipif(shutil.which("ip") is None,
                                 reason="network namespaces need iproute2")]

PEER = str(Path(__file__).with_name("site_peer.py"))
PORT = 5701
ALLOWANCE = 1.15


def free_block(prefix: str) -> int:
    routes = subprocess.run(["ip", "-j", "route", "show"], capture_output=True, text=True,
                            check=True).stdout
    for block in (0, 255):
        if not site_readings.conflicting_routes(sites.topology(prefix, block), routes):
            return block
    pytest.skip("10.77.0.0/24 and 10.77.255.0/24 are both in use (other test runs?)")


def kill_everything_in(topo) -> None:
    """The processes in our namespaces: only this test starts any there."""
    for namespace in topo.namespaces:
        listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True,
                                text=True, check=False).stdout.split()
        for pid in listed:
            os.kill(int(pid), signal.SIGKILL)


@pytest.fixture
def topo():
    prefix = f"sgt{os.getpid()}-"
    made = sites.topology(prefix, free_block(prefix))
    yield made
    kill_everything_in(made)
    netns.remove(made)
    assert not leftovers(made)


@pytest.fixture
def up(topo):
    netns.create(topo, 200)
    return topo


def leftovers(topo) -> list[str]:
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                           check=True).stdout
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True,
                           check=True).stdout
    routes = subprocess.run(["ip", "route", "show", str(topo.block)], capture_output=True,
                            text=True, check=True).stdout
    return [line for line in (names + links + routes).splitlines() if topo.prefix in line
            or str(topo.block) in line]


@pytest.fixture
def listen(up):
    """Start an echo server in a site; each is stopped (by its pid) at the test's end."""
    servers: list[subprocess.Popen] = []

    def start(site: Site, address: str = "0.0.0.0") -> None:
        server = subprocess.Popen(sites.exec_argv(up, site, [sys.executable, PEER, "listen",
                                                             address, str(PORT)]),
                                  stdout=subprocess.PIPE, text=True)
        servers.append(server)
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"

    yield start
    for server in servers:
        server.kill()
        server.wait()


def reaches(topo, site: Site | None, address) -> bool:
    """From `site`'s namespace (None: the login host's), does an echo to address work?"""
    argv = [sys.executable, PEER, "probe", str(address), str(PORT)]
    if site is not None:
        argv = sites.exec_argv(topo, site, argv)
    return subprocess.run(argv, capture_output=True, timeout=30, check=False).returncode == 0


def test_home_is_reached_from_remote_over_the_wan_and_by_the_login_host(up, listen):
    listen(Site.HOME)
    home, remote = up.site_address(Site.HOME), up.site_address(Site.REMOTE)
    assert reaches(up, Site.REMOTE, home)
    assert reaches(up, None, home)                       # users' sbatch to home's controller
    assert not reaches(up, Site.REMOTE, up.login_address)  # the login host relays nothing
    route = netns.exec_in(up, Site.REMOTE, ["ip", "route", "get", str(home)], check=True)
    assert f"dev {up.wan.b.ifname} src {remote}" in route.stdout
    # remote has no interface but its two WAN links' ends
    links = netns.exec_in(up, Site.REMOTE, ["ip", "-br", "link"], check=True).stdout
    assert sorted(line.split()[0].split("@")[0] for line in links.splitlines()) == sorted([
        "lo", up.wan.b.ifname, up.end_at(WanLink.CONTROL_REMOTE, Site.REMOTE).ifname])
    listen(Site.REMOTE, str(remote))
    assert reaches(up, None, remote)                     # the REST API, through home


def test_control_reaches_home_and_remote_each_over_its_direct_link(up, listen):
    listen(Site.HOME)
    listen(Site.REMOTE)
    control = up.site_address(Site.CONTROL)
    for other, link in ((Site.HOME, WanLink.HOME_CONTROL),
                        (Site.REMOTE, WanLink.CONTROL_REMOTE)):
        assert reaches(up, Site.CONTROL, up.site_address(other))
        route = netns.exec_in(up, Site.CONTROL, ["ip", "route", "get",
                                                 str(up.site_address(other))], check=True)
        assert f"dev {up.end_at(link, Site.CONTROL).ifname} src {control}" in route.stdout
    listen(Site.CONTROL, str(control))
    assert reaches(up, Site.HOME, control) and reaches(up, Site.REMOTE, control)
    assert reaches(up, None, control)      # an admin at home, through home's gateway
    assert not reaches(up, Site.REMOTE, up.end_at(WanLink.HOME_CONTROL, Site.CONTROL).address.ip)


def test_isolating_home_leaves_control_and_remote_talking_and_heal_all_restores(up, listen):
    for site in Site:
        listen(site)
    address = {site: up.site_address(site) for site in Site}
    netns.isolate_site(up, Site.HOME)
    netns.isolate_site(up, Site.HOME)                    # isolating twice changes nothing
    assert reaches(up, Site.CONTROL, address[Site.REMOTE])
    assert reaches(up, Site.REMOTE, address[Site.CONTROL])
    for site in (Site.CONTROL, Site.REMOTE):
        assert not reaches(up, site, address[Site.HOME])
        assert not reaches(up, Site.HOME, address[site])
        assert not reaches(up, None, address[site])     # the login host is at home
    assert reaches(up, None, address[Site.HOME])         # ... and home's LAN is not cut
    states = netns.wan_states(up)
    assert [state.cut for state in states] == [True, True, False]
    assert site_readings.isolated_sites(states) == [Site.HOME]
    netns.heal_all(up)
    netns.heal_all(up)
    assert not any(state.cut for state in netns.wan_states(up))
    for one, other in itertools.permutations(Site, 2):
        assert reaches(up, one, address[other]), f"{one.value} -> {other.value}"


def test_a_rate_or_a_cut_on_one_link_leaves_the_others_as_they_were(up):
    netns.set_wan_rate(up, 10, WanLink.HOME_CONTROL)
    assert {state.link: state.mbit for state in netns.wan_states(up)} == {
        WanLink.HOME_REMOTE: 200, WanLink.HOME_CONTROL: 10, WanLink.CONTROL_REMOTE: 200}
    netns.cut_wan(up, [WanLink.CONTROL_REMOTE])
    assert [state.cut for state in netns.wan_states(up)] == [False, False, True]
    netns.heal_wan(up, [WanLink.CONTROL_REMOTE])
    # The rate is in force on its link alone: 2 MB take 1.6 s at 10 Mbit/s, 0.08 s at 200
    # (the bound for the other link is 17 times below its rate, which load cannot reach).
    slow = throughput.measure(up, Site.CONTROL, Site.HOME, 2_000_000, PORT)
    fast = throughput.measure(up, Site.CONTROL, Site.REMOTE, 2_000_000, PORT + 1)
    assert slow.mbit <= 10 * ALLOWANCE < fast.mbit


def test_a_cut_partitions_home_and_remote_and_a_heal_restores_the_rate(up, listen):
    listen(Site.HOME)
    listen(Site.REMOTE)
    home, remote = up.site_address(Site.HOME), up.site_address(Site.REMOTE)
    netns.set_wan_rate(up, 150)
    netns.cut_wan(up)
    netns.cut_wan(up)                                    # cutting twice changes nothing
    state = netns.wan_state(up)
    assert state.cut and all(end.cut for end in state.ends) and state.mbit == 150
    for address in (home, up.lan.b.address.ip, up.login_address):
        assert not reaches(up, Site.REMOTE, address)
    assert not reaches(up, Site.HOME, remote)
    assert not reaches(up, None, remote)                 # the login host is at home
    assert reaches(up, None, home)                       # ... and home's LAN is not cut
    listen(Site.CONTROL)                                 # no detour through control:
    control = up.site_address(Site.CONTROL)              # both still reach it
    assert reaches(up, Site.HOME, control) and reaches(up, Site.REMOTE, control)
    netns.heal_wan(up)
    netns.heal_wan(up)
    state = netns.wan_state(up)
    assert not state.cut and state.mbit == 150
    assert reaches(up, Site.REMOTE, home) and reaches(up, None, remote)


def test_an_established_connection_outlives_a_cut_and_its_heal(up, listen):
    listen(Site.HOME)
    client = subprocess.Popen(
        sites.exec_argv(up, Site.REMOTE, [sys.executable, PEER, "hold",
                                          str(up.site_address(Site.HOME)), str(PORT)]),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert client.stdin and client.stdout and client.stdout.readline().strip() == "connected"
    netns.cut_wan(up)
    client.stdin.write("during the cut\n")
    client.stdin.flush()
    drops = eventually_dropped(up)
    netns.heal_wan(up)
    assert client.stdout.readline().strip() == "during the cut"   # retransmitted after heal
    assert drops > 0
    client.stdin.close()
    assert client.wait(timeout=10) == 0


def eventually_dropped(topo) -> int:
    """Packets the drop class of remote's WAN end has dropped, once it has."""
    def dropped() -> int:
        end = topo.wan.b
        shown = netns.exec_in(topo, Site.REMOTE, ["tc", "-s", "qdisc", "show", "dev",
                                                  end.ifname, "parent", sites.DROP_CLASS],
                              check=True).stdout
        return int(shown.split("dropped ")[1].split(",")[0])

    return eventually(dropped, lambda n: n > 0, timeout_s=10, interval_s=0.2)


@pytest.mark.slow
@pytest.mark.parametrize("sender, receiver", [(Site.HOME, Site.REMOTE),
                                              (Site.REMOTE, Site.HOME)])
def test_bulk_tcp_between_the_sites_is_no_faster_than_the_wan(up, sender, receiver):
    result = throughput.measure(up, sender, receiver, 50_000_000, PORT)
    assert result.nbytes == 50_000_000
    assert result.mbit <= 200 * ALLOWANCE


@pytest.mark.slow
def test_a_rate_change_keeps_a_running_transfer_and_takes_effect(up):
    results: list[throughput.Measurement] = []
    transfer = threading.Thread(target=lambda: results.append(
        throughput.measure(up, Site.HOME, Site.REMOTE, 30_000_000, PORT)))
    transfer.start()
    threading.Event().wait(0.5)
    netns.set_wan_rate(up, 50)
    transfer.join(timeout=120)
    assert results and results[0].nbytes == 30_000_000  # the connection was not dropped
    assert netns.wan_state(up).mbit == 50
    after = throughput.measure(up, Site.REMOTE, Site.HOME, 8_000_000, PORT + 1)
    assert after.mbit <= 50 * ALLOWANCE


def test_up_again_repairs_and_heals(up, listen):
    netns.cut_wan(up)
    netns.exec_in(up, Site.REMOTE, ["ip", "link", "del", up.wan.b.ifname], check=True)
    with pytest.raises(SandboxError, match=f"incomplete .*{up.wan.a.ifname}.*sandbox up"):
        netns.wan_state(up)      # the peer of a deleted veth dies with it
    netns.create(up, 300)
    netns.create(up, 300)
    state = netns.wan_state(up)
    assert (state.mbit, state.cut) == (300, False)
    listen(Site.HOME)
    assert reaches(up, Site.REMOTE, up.site_address(Site.HOME))


def test_remove_refuses_while_a_process_runs_inside_then_leaves_nothing(up):
    sleeper = subprocess.Popen(sites.exec_argv(up, Site.HOME, ["sleep", "60"]))
    try:
        with pytest.raises(SandboxError, match=f"processes {sleeper.pid} still run"):
            netns.remove(up)
    finally:
        sleeper.kill()
        sleeper.wait()
    netns.remove(up)
    assert not leftovers(up)
    netns.remove(up)             # removing nothing is fine


def test_an_absent_topology_says_so_in_one_line(topo):
    for operation in (netns.wan_state, netns.cut_wan, netns.heal_wan,
                      lambda t: netns.set_wan_rate(t, 10)):
        with pytest.raises(SandboxError) as caught:
            operation(topo)
        assert str(caught.value) == netns.NOT_UP


def test_the_address_block_of_someone_else_is_refused(topo):
    other = sites.topology(f"sgu{os.getpid()}-", topo.block.network_address.packed[2])
    netns.create(other, 100)
    try:
        with pytest.raises(SandboxError, match=f"{topo.block} are already routed here"):
            netns.create(topo, 100)
    finally:
        netns.remove(other)


# --- the CLI on a sandbox directory's own sites ---------------------------------------------


def slurm_geo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "slurm_geo", "sandbox", *args],
                          capture_output=True, text=True, timeout=60, check=False)


def test_sandbox_wan_and_exec_act_on_the_sandboxs_sites(tmp_path):
    layout = SandboxLayout(tmp_path / "sandbox")
    layout.root.mkdir()  # a sandbox directory whose sites are down; a missing one is refused
    assert slurm_geo("wan", "--dir", str(layout.root)).stderr.strip() == (
        f"slurm-geo: error: {netns.NOT_UP}")
    topo = netns.up_sites(layout, 120)
    try:
        root = str(layout.root)
        row = json.loads(slurm_geo("wan", "--dir", root, "--json").stdout)
        assert (row["mbit"], row["cut"], row["configured_mbit"]) == (120, False, 120)
        assert row["sites"]["control"]["namespace"] == topo.namespace(Site.CONTROL)
        assert [link["link"] for link in row["links"]] == [link.value for link in WanLink]
        changed = slurm_geo("wan", "--dir", root, "--mbit", "80", "--cut")
        assert changed.stdout.splitlines() == [         # --mbit and --cut: home-remote
            "WAN home <-> remote: 80 Mbit/s, CUT (home and remote are partitioned)",
            "WAN home <-> control: 120 Mbit/s, up",
            "WAN control <-> remote: 120 Mbit/s, up"]
        assert netns.remembered_wan_mbit(layout) == 80
        assert "remote: 80 Mbit/s, up" in slurm_geo("wan", "--dir", root, "--heal").stdout
        other = slurm_geo("wan", "--dir", root, "--link", "home-control", "--mbit", "30",
                          "--cut")
        assert "WAN home <-> control: 30 Mbit/s, CUT" in other.stdout
        assert "WAN home <-> remote: 80 Mbit/s, up" in other.stdout
        isolated = json.loads(slurm_geo("wan", "--dir", root, "--isolate", "home",
                                        "--json").stdout)
        assert isolated["isolated"] == ["home"]
        assert [link["cut"] for link in isolated["links"]] == [True, True, False]
        assert [link["configured_mbit"] for link in isolated["links"]] == [80, 30, 120]
        assert "home is isolated" in slurm_geo("wan", "--dir", root).stdout
        healed = slurm_geo("wan", "--dir", root, "--heal-all").stdout
        assert "CUT" not in healed and "isolated" not in healed
        for clash in (["--cut", "--heal"], ["--isolate", "home", "--heal-all"],
                      ["--cut", "--isolate", "remote"]):
            refused = slurm_geo("wan", "--dir", root, *clash)
            assert refused.returncode == 2 and "exclude each other" in refused.stderr
        inside = slurm_geo("exec", "--dir", root, "remote", "--", "ip", "-br",
                           "addr", "show", "lo")
        assert f"{topo.site_address(Site.REMOTE)}/32" in inside.stdout
        inside = slurm_geo("exec", "--dir", root, "control", "--", "ip", "-br",
                           "addr", "show", "lo")
        assert f"{topo.site_address(Site.CONTROL)}/32" in inside.stdout
        status = slurm_geo("exec", "--dir", root, "home", "--", "sh", "-c", "exit 7")
        assert status.returncode == 7
        netns.up_sites(layout)                               # the remembered rates
        assert [state.mbit for state in netns.wan_states(topo)] == [80, 30, 120]
    finally:
        netns.down_sites(layout)
    assert not leftovers(topo)


def test_a_sandbox_whose_block_another_holds_takes_the_next_free_one_and_keeps_it(tmp_path):
    layout = SandboxLayout(tmp_path / "sandbox")
    preferred = layout.preferred_block_index
    squatter = sites.topology(f"sgq{os.getpid() % 10000}-", preferred)
    netns.create(squatter, 100)                  # another sandbox, on the block ours suggests
    try:
        topo = netns.up_sites(layout, 100)
        try:
            assert layout.network_block_index != preferred
            assert topo.block == layout.topology.block
            assert layout.network_block_file.read_text().strip() == str(
                layout.network_block_index)
            netns.remove(squatter)
            netns.up_sites(layout)               # the block it was given, not the suggested
            assert layout.network_block_index != preferred
        finally:
            netns.down_sites(layout)
        assert not leftovers(topo)
    finally:
        netns.remove(squatter)


def test_a_listener_on_127_0_0_1_inside_a_site_is_that_sites_alone(up, listen):
    listen(Site.HOME, "127.0.0.1")
    assert reaches(up, Site.HOME, "127.0.0.1")
    assert not reaches(up, Site.REMOTE, "127.0.0.1")  # remote's own loopback


# --- etcd: a member per site, as the sandbox runs them ----------------------------------------


@pytest.fixture
def etcd_in_sites(up, tmp_path):
    """The sandbox's three etcd members (its command lines, its data directories' modes)
    in our sites, on the test block's addresses; stopped by their pids."""
    if shutil.which("etcd") is None or shutil.which("etcdctl") is None:
        pytest.skip("etcd is not installed: apt-get install etcd-server etcd-client")
    ca = certs.make_ca("test site CA", datetime.now(UTC))
    (tmp_path / "ca.pem").write_bytes(ca.cert_pem)
    cluster = etcd_members.cluster_in(up, 2379, 2380, tmp_path / "etcd",
                                      etcd_members.EtcdFiles(tmp_path / "ca.pem", tmp_path))
    certs.ensure_etcd_certs(ca, cluster, datetime.now(UTC))
    (tmp_path / "etcd").mkdir(mode=0o700)
    members: list[subprocess.Popen] = []
    for member, daemon in zip(cluster.members, stages.etcd_daemons(cluster), strict=True):
        member.data_dir.mkdir(mode=0o700)
        with open(tmp_path / f"{daemon.name}.log", "wb") as log:
            members.append(subprocess.Popen(daemon.command, env={**os.environ, **daemon.env},
                                            stdout=log, stderr=subprocess.STDOUT))
    try:
        eventually(lambda: [cluster.is_healthy(m) for m in cluster.members],
                   all, timeout_s=20, interval_s=0.2)
        yield cluster
    finally:
        for process in members:          # one at a time, as `sandbox down` stops them
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def etcdctl(topo, cluster, site: Site, member, *args: str) -> subprocess.CompletedProcess[str]:
    """etcdctl inside `site`, asking `cluster`'s `member` (from where the login host may
    not reach), with the client certificate the members ask for."""
    return netns.exec_in(topo, site, ["etcdctl", "--endpoints", member.client_url,
                                      *cluster.ctl_flags(), "--command-timeout=2s",
                                      *args], timeout=20)


def test_three_etcd_members_keep_a_quorum_while_home_is_isolated(up, etcd_in_sites):
    home, control, remote = (etcd_in_sites.member(site) for site in
                             (Site.HOME, Site.CONTROL, Site.REMOTE))

    def ctl(site, member, *args):
        return etcdctl(up, etcd_in_sites, site, member, *args)

    assert ctl(Site.CONTROL, control, "put", "before", "1").returncode == 0
    files = etcd_in_sites.files
    without_cert = netns.exec_in(up, Site.CONTROL, [
        "etcdctl", "--endpoints", control.client_url, "--cacert", str(files.ca),
        "--command-timeout=2s", "get", "before"], timeout=20)
    assert without_cert.returncode != 0 and "1" not in without_cert.stdout
    netns.isolate_site(up, Site.HOME)
    # control and remote are a quorum of two (electing a leader again if home's was it)
    eventually(lambda: ctl(Site.CONTROL, control, "put", "during", "2").returncode,
               lambda status: status == 0, timeout_s=20, interval_s=0.2)
    read = ctl(Site.REMOTE, remote, "get", "during", "--print-value-only")
    assert read.stdout.strip() == "2"
    # home alone is no quorum: it serves no (linearizable) read, and says it is unhealthy
    assert ctl(Site.HOME, home, "get", "before").returncode != 0
    eventually(lambda: etcd_in_sites.is_healthy(home), lambda ok: not ok,
               timeout_s=10, interval_s=0.2)
    netns.heal_all(up)
    eventually(lambda: etcd_in_sites.is_healthy(home), bool, timeout_s=20,
               interval_s=0.2)
    caught_up = ctl(Site.HOME, home, "get", "during", "--print-value-only")
    assert caught_up.stdout.strip() == "2"
