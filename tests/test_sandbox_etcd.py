"""The sandbox's etcd members (sandbox.etcd_members, their stage, layout and status),
without starting any; tests/test_sites_netns.py runs them in real sites."""

from __future__ import annotations

import http.server
import threading
from pathlib import Path

import pytest

from slurm_geo.sandbox import etcd_members, stages
from slurm_geo.sandbox.layout import SandboxLayout
from slurm_geo.sandbox.sites import Site

LAYOUT = SandboxLayout(Path("/srv/box"), 20000)
CLUSTER = LAYOUT.etcd_cluster
HOME, CONTROL, REMOTE = Site.HOME, Site.CONTROL, Site.REMOTE


def flags(argv: list[str]) -> dict[str, str]:
    """--name value pairs; a flag without a value maps to ""."""
    given, words = {}, argv[1:]
    for i, word in enumerate(words):
        if word.startswith("--"):
            following = words[i + 1] if i + 1 < len(words) else "--"
            given[word] = "" if following.startswith("--") else following
    return given


def test_a_member_per_site_on_its_site_address_and_the_layouts_ports():
    assert [member.site for member in CLUSTER.members] == [HOME, CONTROL, REMOTE]
    for member in CLUSTER.members:
        assert member.namespace == LAYOUT.namespace(member.site)
        assert member.address == LAYOUT.address(member.site)
        assert (member.client_port, member.peer_port) == (20060, 20061)
        assert member.client_url == f"https://{LAYOUT.address(member.site)}:20060"
    assert LAYOUT.etcd_endpoints == CLUSTER.endpoints == (
        CLUSTER.member(HOME).client_url, CLUSTER.member(CONTROL).client_url,
        CLUSTER.member(REMOTE).client_url)


def test_the_etcd_ports_are_no_other_components():
    others = {LAYOUT.mariadb_port, LAYOUT.s3_port, *LAYOUT.s3_internal_ports,
              LAYOUT.port_base + 45, LAYOUT.port_base + 50}
    for cluster in LAYOUT.clusters:
        others |= {cluster.ctld_port, cluster.dbd_port, *cluster.node_ports, cluster.rest_port}
    assert not {LAYOUT.etcd_client_port, LAYOUT.etcd_peer_port} & others
    assert LAYOUT.etcd_client_port != LAYOUT.etcd_peer_port


def test_each_member_has_its_own_data_directory_the_remote_one_apart_from_any_secret():
    dirs = {member.site: member.data_dir for member in CLUSTER.members}
    assert dirs == {site: Path("/srv/box/etcd") / site.value for site in (HOME, CONTROL, REMOTE)}
    remote = dirs[REMOTE]
    secrets = [LAYOUT.master_key, LAYOUT.tls_dir, LAYOUT.s3_dir, LAYOUT.munge_dir,
               LAYOUT.offsite_job_credentials, dirs[HOME], dirs[CONTROL]]
    assert not [path for path in secrets if path.is_relative_to(remote)
                or remote.is_relative_to(path)]


@pytest.mark.parametrize("site", [HOME, CONTROL, REMOTE])
def test_a_members_command_line_binds_its_site_address_and_names_all_three(site):
    member = CLUSTER.member(site)
    argv = CLUSTER.argv(member, "/usr/bin/etcd")
    assert argv[0] == "/usr/bin/etcd"
    given = flags(argv)
    address = LAYOUT.address(site)
    assert given["--name"] == site.value
    assert given["--data-dir"] == f"/srv/box/etcd/{site.value}"
    assert given["--listen-client-urls"] == given["--advertise-client-urls"] == \
        f"https://{address}:20060"
    assert given["--listen-peer-urls"] == given["--initial-advertise-peer-urls"] == \
        f"https://{address}:20061"
    assert given["--initial-cluster"] == ",".join(
        f"{s.value}=https://{LAYOUT.address(s)}:20061" for s in (HOME, CONTROL, REMOTE))
    assert given["--initial-cluster-state"] == "new"
    assert given["--initial-cluster-token"] == f"slurm-geo-{LAYOUT.network_prefix[:-1]}"
    assert given["--auto-compaction-mode"] == "revision"
    # https both ways: for clients a certificate of the site CA, for peers one of the peer
    # CA, which no client port trusts; nobody let in without a certificate of the right CA
    for prefix, name, ca in (("", f"etcd-{site.value}", str(LAYOUT.ca_cert)),
                             ("peer-", f"etcd-{site.value}-peer", "/srv/box/tls/etcd-peer-ca.pem")):
        assert given[f"--{prefix}cert-file"] == f"/srv/box/tls/{name}.pem"
        assert given[f"--{prefix}key-file"] == f"/srv/box/tls/{name}.key"
        assert given[f"--{prefix}trusted-ca-file"] == ca
        assert given[f"--{prefix}client-cert-auth"] == ""


def test_the_replicas_name_only_the_trusted_sites_members():
    assert CLUSTER.client_endpoints == tuple(
        CLUSTER.member(site).client_url for site in (HOME, CONTROL))


def test_auth_gives_the_replicas_user_the_federation_prefix_alone():
    steps = [args for args, _ in CLUSTER.auth_steps("/slurm-geo/federation")]
    assert ["role", "grant-permission", etcd_members.REPLICA_ROLE, "readwrite",
            "/slurm-geo/federation/", "--prefix=true"] in steps
    assert ["user", "grant-role", etcd_members.REPLICA_USER, etcd_members.REPLICA_ROLE] in steps
    assert not [a for a in steps if "grant-role" in a and a[2] == etcd_members.REPLICA_USER
                and a[3] == "root"]
    assert steps[-1] == ["auth", "enable"]  # last: root exists with its role by then
    assert [reads for args, reads in CLUSTER.auth_steps("/p") if reads] == [True, True]
    assert CLUSTER.ctl_flags()[-4:] == ["--cert", "/srv/box/tls/etcd-root.pem",
                                        "--key", "/srv/box/tls/etcd-root.key"]


def test_two_sandboxes_clusters_never_share_a_token():
    other = SandboxLayout(Path("/srv/other"), 20000).etcd_cluster
    assert other.token != CLUSTER.token


@pytest.mark.parametrize("machine, env", [
    ("x86_64", {}),
    ("ppc64le", {}),
    ("aarch64", {"ETCD_UNSUPPORTED_ARCH": "arm64"}),
    ("s390x", {"ETCD_UNSUPPORTED_ARCH": "s390x"}),
    ("riscv64", {"ETCD_UNSUPPORTED_ARCH": "riscv64"}),
])
def test_etcd_is_told_it_may_run_where_3_4_does_not_support_the_architecture(machine, env):
    assert etcd_members.unsupported_arch_env(machine) == env


@pytest.mark.parametrize("body, healthy", [
    ('{"health":"true"}', True),
    ('{"health":"true","reason":""}', True),
    ('{"health":"false"}', False),
    ('{"health":true}', False),
    ("[]", False),
    ("not json", False),
    ("", False),
])
def test_parse_health(body, healthy):
    assert etcd_members.parse_health(body) is healthy


def test_the_stage_of_munge_mariadb_and_s3_starts_the_members_in_their_sites():
    first = stages.daemons_by_stage(LAYOUT, None, {})[0]
    members = [daemon for daemon in first if daemon.name.startswith(stages.ETCD_DAEMON_PREFIX)]
    assert [daemon.name for daemon in members] == ["etcd-home", "etcd-control", "etcd-remote"]
    for daemon, member in zip(members, CLUSTER.members, strict=True):
        assert (daemon.namespace, daemon.host) == (member.namespace, member.address)
        assert (daemon.port, daemon.extra_ports) == (20060, (20061,))   # both checked free
        assert daemon.health_check is not None                           # up: a quorum
        assert daemon.url == member.client_url
        assert daemon.command[:2] == ["nsenter", f"--net=/run/netns/{member.namespace}"]
        assert flags(daemon.argv)["--name"] == member.name


def test_status_shows_each_members_client_url(tmp_path):
    from slurm_geo.sandbox.lifecycle import Sandbox

    box = Sandbox(tmp_path / "box")
    rows = {row.name: row for row in box.status()}
    assert [rows[f"etcd-{site.value}"].endpoint for site in (HOME, CONTROL, REMOTE)] == list(
        box.layout.etcd_endpoints)
    assert not any(rows[f"etcd-{site.value}"].up for site in (HOME, CONTROL, REMOTE))


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
        body = b'{"health":"true"}' if self.path == "/good/health" else b'{"health":"false"}'
        self.send_response(200 if self.path == "/good/health" else 503)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_is_healthy_asks_the_members_health_url():
    server = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert etcd_members.is_healthy(f"{base}/good/health")
        assert not etcd_members.is_healthy(f"{base}/bad/health")
    finally:
        server.shutdown()
        server.server_close()
    assert not etcd_members.is_healthy(f"{base}/good/health", timeout_s=0.5)  # nobody there
