"""The sandbox's clusters in their sites: each daemon in its site's network namespace,
home and remote joined only by the WAN, which a cut partitions and a heal restores."""

from __future__ import annotations

import os
import sys

import pytest

from slurm_geo.sandbox import netns
from slurm_geo.sandbox.render import federation_port
from slurm_geo.sandbox.sites import Site
from tests.helpers import daemon_pid

pytestmark = pytest.mark.sandbox

CONNECT = ("import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), "
           "timeout=1).close()")


def network_namespace_of(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


def named_namespace(name: str) -> str:
    return f"net:[{os.stat(f'/run/netns/{name}').st_ino}]"


def reaches(sandbox, site: Site, host: str, port: int) -> bool:
    argv = [sys.executable, "-c", CONNECT, host, str(port)]
    return netns.exec_in(sandbox.layout.topology, site, argv, timeout=10).returncode == 0


@pytest.mark.parametrize("daemon, site", [
    ("onprem-slurmctld", Site.HOME), ("onprem-n1", Site.HOME), ("onprem-slurmdbd", Site.HOME),
    ("federation", Site.HOME), ("checkpoint-sync", Site.HOME),
    ("rented-slurmctld", Site.REMOTE), ("rented-n2", Site.REMOTE),
    ("rented-slurmrestd", Site.REMOTE), ("rented-rest-tls", Site.REMOTE), ("s3", Site.REMOTE),
    ("etcd-home", Site.HOME), ("etcd-control", Site.CONTROL), ("etcd-remote", Site.REMOTE),
])
def test_each_daemon_runs_in_its_site(sandbox, daemon, site):
    pid = daemon_pid(sandbox, daemon)

    assert pid is not None, f"{daemon} is not running"
    assert network_namespace_of(pid) == named_namespace(sandbox.layout.namespace(site))
    assert network_namespace_of(pid) != network_namespace_of(os.getpid())


def test_munge_and_mariadb_stay_on_the_login_host_reached_by_their_sockets(sandbox):
    for daemon in ("munged", "mariadb"):
        pid = sandbox.processes.running_pid(daemon)
        assert pid is not None and network_namespace_of(pid) == network_namespace_of(os.getpid())


def test_the_sites_reach_each_other_only_while_the_wan_is_up(sandbox):
    layout = sandbox.layout
    onprem, rented = layout.onprem, layout.rented
    home_daemon = (onprem.address, federation_port(layout))
    assert reaches(sandbox, Site.REMOTE, onprem.address, onprem.ctld_port)
    assert reaches(sandbox, Site.REMOTE, *home_daemon)       # moved jobs renew leases
    assert reaches(sandbox, Site.HOME, rented.address, rented.rest_port)

    netns.cut_wan(layout.topology)
    try:
        assert not reaches(sandbox, Site.REMOTE, onprem.address, onprem.ctld_port)
        assert not reaches(sandbox, Site.REMOTE, *home_daemon)
        assert not reaches(sandbox, Site.HOME, rented.address, rented.rest_port)
        # The login host is at home: its LAN stays up, its way to the provider is cut.
        assert reaches_from_login(onprem.address, onprem.ctld_port)
        assert not reaches_from_login(rented.address, rented.rest_port)
    finally:
        netns.heal_wan(layout.topology)

    assert reaches(sandbox, Site.REMOTE, onprem.address, onprem.ctld_port)
    assert reaches_from_login(rented.address, rented.rest_port)


def reaches_from_login(host: str, port: int) -> bool:
    import socket
    try:
        socket.create_connection((host, port), timeout=1).close()
    except OSError:
        return False
    return True


def test_slurmrestd_is_reached_only_through_its_tls_relay(sandbox):
    """slurmrestd listens on a unix socket; what the network reaches is https."""
    import requests
    rented = sandbox.layout.rented

    with pytest.raises(requests.exceptions.ConnectionError):
        requests.get(f"http://{rented.address}:{rented.rest_port}/openapi", timeout=5)
    answer = requests.get(f"{rented.rest_url}/openapi", timeout=5,
                          verify=str(sandbox.layout.ca_cert))
    assert answer.status_code  # slurmrestd answered through TLS the site CA vouches for
