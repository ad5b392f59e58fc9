"""The sandbox's rented cluster as the provider's machine (`sandbox up --remote-slurm
provider`, sandbox.remote_site): a stock Slurm 26.05 on a root of its own, reached only
through slurmrestd behind the TLS relay. Pure checks first, then the live sandbox's (they
run only when the sandbox under test has the provider remote)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from slurm_geo.config import load_config
from slurm_geo.federation.decide.owners import own_dir
from slurm_geo.sandbox import provider, remote_site, stages
from slurm_geo.sandbox import provider_render as prender
from slurm_geo.sandbox.layout import SandboxLayout
from slurm_geo.sandbox.users import ALICE
from slurm_geo.slurm import JobSpec, connect
from slurm_geo.slurm.rest_backend import RestSlurmClient
from tests.provider_sites import free_base, running

LAYOUT = SandboxLayout(Path("/var/tmp/sgX"), 25000, remote_slurm="provider")
# What of slurm-geo's a slurm.conf could name: its plugin stack, Lua, hooks, the sandbox.
GEO_SETTINGS = ("PlugStackConfig", "JobSubmitPlugins", "CliFilterPlugins", "Prolog",
                "Epilog", "slurm-geo", "slurm_geo", "geo-", "geo_directives")


def test_the_provider_site_is_rented_at_the_remote_site_on_its_ports() -> None:
    site, rented = remote_site.site(LAYOUT), LAYOUT.rented
    assert (site.address, site.netns, site.cluster) == (rented.address, rented.namespace,
                                                        "rented")
    assert site.nodes == tuple(zip(rented.node_names, rented.node_ports, strict=True))
    assert (site.ports.ctld, site.ports.dbd) == (rented.ctld_port, rented.dbd_port)
    assert site.root == LAYOUT.root / "provider" and site.rest_socket and site.accounting


def test_the_remote_slurm_conf_names_nothing_of_slurm_geos() -> None:
    site = remote_site.site(LAYOUT)
    conf = prender.slurm_conf(site.cluster, site.address, site.ports, site.nodes,
                              site.accounting)
    dbd = prender.slurmdbd_conf(site.address, site.ports)
    for text in (conf, dbd):
        for setting in GEO_SETTINGS:
            assert setting not in text
        assert str(LAYOUT.root) not in text
    assert "NodeName=rented-n2 " in conf and "AccountingStoreFlags=job_env" in conf


def test_the_host_runs_none_of_renteds_slurm_but_the_relay_in_front_of_its_socket() -> None:
    names = [d.name for stage in stages.daemons_by_stage(LAYOUT, (22, 5), {})
             for d in stage]
    assert "onprem-slurmctld" in names and "rented-rest-tls" in names
    assert not [n for n in names if n.startswith("rented-") and n != "rented-rest-tls"]
    relay = next(d for stage in stages.daemons_by_stage(LAYOUT, (22, 5), {}) for d in stage
                 if d.name == "rented-rest-tls")
    assert f"unix:{remote_site.site(LAYOUT).restd_socket}" in relay.argv
    host = SandboxLayout(Path("/var/tmp/sgX"), 25000)
    assert "rented-slurmctld" in [d.name for stage in stages.daemons_by_stage(
        host, (22, 5), {}) for d in stage]


def test_the_site_config_maps_users_to_the_providers_accounts_and_homes() -> None:
    import tomllib

    from slurm_geo.config.model import parse_config
    from slurm_geo.sandbox import render
    site = parse_config(tomllib.loads(render.site_config(LAYOUT)), source="x")
    rented = site.clusters["rented"]
    assert rented.users["alice"].account == "geo-alice"
    assert own_dir(rented, ALICE.owner) == "/home/geo-alice"
    assert own_dir(site.clusters["onprem"], ALICE.owner) is None


# --- the live sandbox's ---------------------------------------------------------------


@pytest.fixture(scope="module")
def live(sandbox):
    if not remote_site.is_provider(sandbox.layout):
        pytest.skip("the sandbox under test runs rented from the host (--remote-slurm host)")
    return sandbox


@pytest.mark.sandbox
@pytest.mark.slow
def test_rented_is_slurm_26_05_with_no_plugin_of_ours(live) -> None:
    site = remote_site.site(live.layout)
    assert provider.exec_in(site, ["slurmctld", "-V"]).stdout.split()[-1].startswith("26.05")
    conf = (site.dirs.etc / "slurm.conf").read_text()
    for setting in GEO_SETTINGS:
        assert setting not in conf
    client = connect(load_config(live.layout.site_config).clusters["rented"])
    assert isinstance(client, RestSlurmClient)
    assert client.api_version == "0.0.45"


@pytest.mark.sandbox
@pytest.mark.slow
def test_a_job_there_sees_none_of_homes_files(live) -> None:
    """As alice's account there, through slurmrestd: home's pfs and alice's home are not
    there, its /home/geo-alice is the provider's."""
    layout = live.layout
    site = load_config(layout.site_config)
    client = connect(site.clusters["rented"])
    marker = f"probe-{time.time_ns()}"
    script = "\n".join([
        "#!/bin/bash",
        f"for p in {layout.pfs_dir} {ALICE.home} {layout.root} /work; do",
        '  if [ -e "$p" ]; then echo "seen $p"; else echo "absent $p"; fi',
        "done",
        'echo "home $HOME pwd $PWD uid $(id -u)"', ""])
    job = client.submit(JobSpec(script=script, name=marker, owner=ALICE.owner,
                                working_dir=remote_site.work_dir(ALICE.name),
                                output=f"{marker}.out", environment={"PATH": "/usr/bin:/bin"}))
    out = remote_site.operator_path(layout, ALICE.name,
                                    remote_site.work_dir(ALICE.name) / f"{marker}.out")
    deadline = time.time() + 60
    while time.time() < deadline and not (out.exists() and "pwd" in out.read_text()):
        time.sleep(0.5)
    text = out.read_text()
    assert "seen" not in text, text
    assert f"pwd /home/geo-alice uid {prender.ACCOUNTS[0].uid}" in text
    assert client.job(job).state is not None


@pytest.mark.sandbox
@pytest.mark.slow
def test_tokens_are_the_daemons_alone(live) -> None:
    rented = live.layout.rented
    for path in (rented.token_file, *(rented.user_token_file(u) for u in ("alice", "bob"))):
        mode = path.stat()
        assert mode.st_mode & 0o077 == 0 and mode.st_uid != 0


@pytest.mark.slow
@pytest.mark.root(reason="namespaces and mounts need root")
def test_the_sandbox_provider_site_comes_up_and_down_leaves_nothing(tmp_path: Path) -> None:
    """The site as the sandbox makes it (its own MariaDB and slurmdbd, two slurmds,
    slurmrestd on a unix socket), on loopback ports of its own, without a sandbox: the
    service account is an operator there; `down` leaves no mount, namespace or process."""
    base = free_base(24600, 6)
    layout = SandboxLayout(tmp_path, base, remote_slurm="provider")
    made = dataclasses.replace(remote_site.site(layout), address="127.0.0.1", netns=None,
                               fixed_ports=prender.Ports(base, base + 1, base + 2, base + 3,
                                                         base + 4),
                               node_ports=(base + 1, base + 5))
    with running(made, watched=tmp_path):
        assert made.restd_socket.is_socket()
        admins = provider.exec_in(made, ["sacctmgr", "-n", "-P", "list", "user",
                                         "format=user,adminlevel"]).stdout
        assert f"{prender.SERVICE_ACCOUNT.name}|Operator" in admins.splitlines()
        nodes = provider.exec_in(made, ["sinfo", "-h", "-N", "-o", "%N"]).stdout.split()
        assert sorted(set(nodes)) == ["rented-n1", "rented-n2"]
