"""The sandbox's Slurm config files, rendered from its layout without running anything."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from slurm_geo.config.model import RemoteAccount, parse_config
from slurm_geo.sandbox.layout import REST_USER, SandboxLayout
from slurm_geo.sandbox.render import restd_plugins, site_config, slurm_conf, slurmdbd_conf
from slurm_geo.sandbox.sites import Site

LAYOUT = SandboxLayout(Path("/srv/box"), 20000)


def settings(text: str) -> list[tuple[str, str]]:
    return [tuple(line.split("=", 1)) for line in text.splitlines() if "=" in line]


def test_two_nodes_on_one_host_get_their_own_ports_and_paths():
    conf = slurm_conf(LAYOUT, LAYOUT.onprem, "host1")
    nodes = [line for line in conf.splitlines() if line.startswith("NodeName=")]
    assert [n.split()[0] for n in nodes] == ["NodeName=onprem-n1", "NodeName=onprem-n2"]
    assert "Port=20012" in nodes[0] and "Port=20013" in nodes[1]
    assert all("NodeHostname=host1" in n for n in nodes)
    assert "SlurmdSpoolDir=/srv/box/onprem/spool/%n" in conf
    assert "SlurmdPidFile=/srv/box/onprem/run/slurmd-%n.pid" in conf


def test_clusters_do_not_share_ports_state_or_accounting():
    onprem = dict(settings(slurm_conf(LAYOUT, LAYOUT.onprem, "h")))
    rented = dict(settings(slurm_conf(LAYOUT, LAYOUT.rented, "h")))
    for key in ("ClusterName", "SlurmctldPort", "StateSaveLocation", "AccountingStoragePort"):
        assert onprem[key] != rented[key], key
    assert "AuthAltTypes" not in onprem
    assert rented["AuthAltTypes"] == "auth/jwt"


@pytest.mark.parametrize("cluster", LAYOUT.clusters, ids=lambda c: c.name)
def test_slurmdbd_keeps_each_batch_jobs_environment(cluster):
    """The federation daemon reads a job owner's environment with sacct --env-vars."""
    assert dict(settings(slurm_conf(LAYOUT, cluster, "h")))["AccountingStoreFlags"] == \
        "job_env"


def test_the_sandbox_site_maps_alice_and_bob_each_to_their_own_rest_account_and_not_root():
    site = parse_config(tomllib.loads(site_config(LAYOUT)))
    rented = site.cluster(LAYOUT.rented.name)
    assert rented.users == {
        name: RemoteAccount(name, LAYOUT.rented.user_token_file(name)) for name in ("alice", "bob")}
    assert rented.rest_user == REST_USER  # the daemon's own account, for probes and cancels
    assert site.cluster(LAYOUT.onprem.name).users == {}


def test_each_slurmdbd_has_its_own_database_and_only_rented_takes_jwt():
    onprem = dict(settings(slurmdbd_conf(LAYOUT, LAYOUT.onprem, "pw")))
    rented = dict(settings(slurmdbd_conf(LAYOUT, LAYOUT.rented, "pw")))
    assert onprem["StorageLoc"] == "slurm_acct_onprem"
    assert rented["StorageLoc"] == "slurm_acct_rented"
    assert "AuthAltParameters" not in onprem
    assert rented["AuthAltParameters"] == "jwt_key=/srv/box/rented/etc/jwt.key"


def test_every_port_is_distinct():
    ports = [LAYOUT.mariadb_port, LAYOUT.s3_port]
    for cluster in LAYOUT.clusters:
        ports += [cluster.ctld_port, cluster.dbd_port, *cluster.node_ports]
    ports.append(LAYOUT.rented.rest_port)
    assert len(ports) == len(set(ports))


@pytest.mark.parametrize("version, expected", [
    ((22, 5), ["-s", "openapi/v0.0.38,openapi/dbv0.0.38"]),
    ((23, 2), ["-s", "openapi/v0.0.39,openapi/dbv0.0.39"]),
    ((23, 11), []),
    ((24, 11), []),
])
def test_restd_plugins_by_release(version, expected):
    assert restd_plugins(version) == expected


def test_the_sandbox_bills_into_a_database_inside_its_own_root():
    """Not the site default /var/lib/slurm-geo/billing.db, which every sandbox would share."""
    from slurm_geo.billing.config import DEFAULT_DATABASE, billing_config

    config = billing_config(parse_config(tomllib.loads(site_config(LAYOUT))))
    assert config.database == LAYOUT.root / "billing" / "billing.db"
    assert config.database.is_relative_to(LAYOUT.root) and config.database != DEFAULT_DATABASE
    other = SandboxLayout(Path("/srv/other"), 21000)
    assert billing_config(parse_config(tomllib.loads(site_config(other)))).database != \
        config.database


def federation_of(layout: SandboxLayout, site: Site):
    return parse_config(tomllib.loads(site_config(layout, site))).federation


def test_a_sandbox_alone_on_sqlite_has_one_daemon_at_home_and_no_etcd():
    assert LAYOUT.federation_sites == (Site.HOME,)
    config = federation_of(LAYOUT, Site.HOME)
    assert not config.replicated and config.replicas == ()
    assert config.listen_address == LAYOUT.address(Site.HOME)


def test_a_replicated_sandbox_has_replicas_at_home_and_control_on_the_three_sites_etcd():
    layout = SandboxLayout(Path("/srv/box"), 20000, replicated=True)
    assert layout.federation_sites == (Site.HOME, Site.CONTROL)
    home, control = (federation_of(layout, site) for site in layout.federation_sites)
    files = layout.etcd_cluster.files
    for config in (home, control):
        # the trusted sites' members: the rented one serves no client
        assert config.etcd_endpoints == layout.etcd_endpoints[:2]
        assert (config.etcd_user, config.etcd_password_file) == ("slurm-geo-replica",
                                                                 files.password)
        assert [(r.name, r.site) for r in config.replicas] == [("home", "home"),
                                                               ("control", "control")]
    assert (home.replica, control.replica) == ("home", "control")
    assert home.listen_address == layout.address(Site.HOME)
    assert control.listen_address == layout.address(Site.CONTROL)
    assert home.url != control.url and set(home.job_urls) == set(control.job_urls) == \
        {home.url, control.url}
    assert layout.federation_config(Site.HOME) == layout.site_config
    assert layout.federation_config(Site.CONTROL) != layout.site_config


@pytest.mark.parametrize("created, asked, refused", [
    ({"port_base": 20000}, {"replicated": True}, "created without --replicated"),
    ({"port_base": 20000, "replicated": True}, {"replicated": False},
     "created with --replicated"),
    ({"port_base": 20000}, {"port_base": 21000}, "created with --port-base 20000"),
])
def test_a_sandbox_keeps_what_it_was_created_with(tmp_path, created, asked, refused):
    import json

    from slurm_geo.errors import SandboxError
    from slurm_geo.sandbox.lifecycle import Sandbox

    (tmp_path / "sandbox.json").write_text(json.dumps(created))
    with pytest.raises(SandboxError, match=refused) as caught:
        Sandbox(tmp_path, **asked)
    assert "--purge" in str(caught.value) and "\n" not in str(caught.value)
    kept = Sandbox(tmp_path)  # asking nothing: what it was created with
    assert kept.layout.replicated is bool(created.get("replicated"))
    assert kept.layout.port_base == 20000
