"""The sandbox's daemons, stage by stage, and the site each runs in: pure, from the layout.

Each stage waits for the one before (munge, MariaDB, the S3 server and the etcd members;
the slurmdbds; the slurmctlds; the slurmds, slurmrestd behind its TLS relay and
checkpoint-sync; the federation daemon). A daemon of a site runs in its network namespace
and listens on its address (sandbox.sites); munged and MariaDB stay in the machine's
namespace, reached by their unix sockets, which no network namespace hides.
"""

from __future__ import annotations

import functools
import platform
import shutil
import sys
from pathlib import Path

from slurm_geo.sandbox import etcd_members, remote_site, render, seaweed, service_account
from slurm_geo.sandbox.etcd_members import EtcdCluster
from slurm_geo.sandbox.layout import (
    REPLICA_NAMES,
    RESTD_OS_GROUP,
    RESTD_OS_USER,
    ClusterLayout,
    SandboxLayout,
)
from slurm_geo.sandbox.processes import Daemon
from slurm_geo.sandbox.sites import Site

S3_DAEMON = "s3"
# The accounts of the daemons that stand for a site's own services, as Debian's packages
# make them (docs/security.md, "Who runs with which rights"): none of them is root.
MUNGE_USER = "munge"
MARIADB_USER = "mysql"
RELAY_USER = "www-data"  # the rented provider's TLS proxy in front of slurmrestd
ETCD_USER = "etcd"
ETCD_DAEMON_PREFIX = "etcd-"  # and the member's site: etcd-home, etcd-control, etcd-remote


def daemons_by_stage(layout: SandboxLayout, version: tuple[int, int] | None,
                     s3_env: dict[str, str]) -> list[list[Daemon]]:
    """Every daemon, in start order; `version` the installed Slurm's (None: only named,
    for `down` and `status`), `s3_env` the daemons' key to the S3 server."""
    infra = [_munged(layout), _mariadb(layout), _s3(layout),
             *etcd_daemons(layout.etcd_cluster, user=ETCD_USER)]
    # MariaDB stands for each site's own database server: both slurmdbds reach it by
    # its unix socket (StorageHost=localhost in slurmdbd.conf).
    # The provider's machine (remote_site) runs rented's Slurm itself, not from here.
    dbds = [_slurm_daemon(c, "slurmdbd", ["slurmdbd", "-D"], c.dbd_port,
                          {"MYSQL_UNIX_PORT": str(layout.mariadb_socket)})
            for c in layout.host_clusters]
    ctlds = [_slurm_daemon(c, "slurmctld", ["slurmctld", "-D", "-i"], c.ctld_port)
             for c in layout.host_clusters]
    nodes = [_slurm_daemon(c, node, ["slurmd", "-D", "-N", node], port)
             for c in layout.host_clusters
             for node, port in zip(c.node_names, c.node_ports, strict=True)]
    return [infra, dbds, ctlds,
            [*nodes, *_rest_daemons(layout, version), _sync_daemon(layout, s3_env)],
            [_federation_daemon(layout, s3_env, site) for site in layout.federation_sites]]


def program(name: str) -> str:
    """The installed console script, next to this Python's executable if it is there."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    return shutil.which(name) or name


def _munged(layout: SandboxLayout) -> Daemon:
    munge = layout.munge_dir
    return Daemon("munged",
                  ["munged", "--foreground", f"--socket={layout.munge_socket}",
                   f"--key-file={munge / 'munge.key'}", f"--pid-file={munge / 'munged.pid'}",
                   f"--log-file={munge / 'munged.log'}", f"--seed-file={munge / 'munged.seed'}"],
                  user=MUNGE_USER, group=MUNGE_USER, ready_path=layout.munge_socket)


def _mariadb(layout: SandboxLayout) -> Daemon:
    db = layout.mariadb_dir
    return Daemon("mariadb",
                  ["mariadbd", "--no-defaults", f"--datadir={db / 'data'}",
                   f"--socket={layout.mariadb_socket}", f"--port={layout.mariadb_port}",
                   "--bind-address=127.0.0.1", "--skip-name-resolve", f"--user={MARIADB_USER}",
                   f"--pid-file={db / 'mariadbd.pid'}", f"--log-error={db / 'error.log'}",
                   "--innodb-buffer-pool-size=64M", "--innodb-lock-wait-timeout=900"],
                  port=layout.mariadb_port)


def _s3(layout: SandboxLayout) -> Daemon:
    """The offsite store's S3 server, at the remote site, as its own account (its files
    are that account's: seaweed.hand_over), with a /tmp of its own for its sockets, from
    the copy of weed in the site's software tree (seaweed.installed_program)."""
    server = seaweed.SeaweedServer.of_sandbox(layout)
    return Daemon(S3_DAEMON, server.argv(str(seaweed.installed_program(layout))),
                  user=service_account.S3_NAME, group=service_account.S3_NAME,
                  private_tmp=seaweed.private_tmp(layout),
                  port=layout.s3_port, extra_ports=layout.s3_internal_ports,
                  namespace=layout.namespace(Site.REMOTE), host=layout.address(Site.REMOTE))


def etcd_daemons(cluster: EtcdCluster, user: str | None = None) -> list[Daemon]:
    """A member in each site, `etcd-<site>`, as `user` (the sandbox's: ETCD_USER): up once
    its /health says it serves with a quorum, so the stage waits for two of them to elect
    a leader."""
    program_path = program(etcd_members.ETCD_PROGRAM)
    env = etcd_members.unsupported_arch_env(platform.machine())
    return [Daemon(f"{ETCD_DAEMON_PREFIX}{member.name}", cluster.argv(member, program_path), env,
                   port=member.client_port, extra_ports=(member.peer_port,),
                   namespace=member.namespace, host=member.address, user=user, group=user,
                   health_check=functools.partial(cluster.is_healthy, member),
                   url=member.client_url)
            for member in cluster.members]


def _slurm_daemon(cluster: ClusterLayout, name: str, argv: list[str], port: int,
                  env: dict[str, str] | None = None) -> Daemon:
    """A Slurm daemon of `cluster`, in its site."""
    name = name if name.startswith(f"{cluster.name}-") else f"{cluster.name}-{name}"
    return Daemon(name, argv, {"SLURM_CONF": str(cluster.slurm_conf), **(env or {})},
                  port=port, namespace=cluster.namespace, host=cluster.address)


def _rest_daemons(layout: SandboxLayout, version: tuple[int, int] | None) -> list[Daemon]:
    """slurmrestd on a unix socket of its site, and the TLS relay in front of it at the
    site's address: a JWT never crosses the WAN in clear. The relay stands for the
    provider's own TLS proxy: it runs as RELAY_USER, who alone reads its key."""
    rented = layout.rented
    if remote_site.is_provider(layout):  # its slurmrestd is the provider's, in its root
        return [_relay(layout, remote_site.site(layout).restd_socket)]
    restd_argv = ["slurmrestd", "-a", "rest_auth/jwt"]
    restd_argv += render.restd_plugins(version) if version else []
    restd_argv.append(f"unix:{rented.restd_socket}")
    restd = Daemon(f"{rented.name}-slurmrestd", restd_argv,
                   env={"SLURM_CONF": str(rented.slurm_conf), "SLURM_JWT": "daemon"},
                   user=RESTD_OS_USER, group=RESTD_OS_GROUP, ready_path=rented.restd_socket,
                   namespace=rented.namespace)
    return [restd, _relay(layout, rented.restd_socket)]


def _relay(layout: SandboxLayout, upstream: Path) -> Daemon:
    rented = layout.rented
    return Daemon(f"{rented.name}-rest-tls",
                  [str(layout.site_python), "-I", "-m", "slurm_geo.sandbox.tls_relay",
                   "--listen", f"{rented.address}:{rented.rest_port}",
                   "--to", f"unix:{upstream}",
                   "--cert", str(layout.rest_cert), "--key", str(layout.rest_key)],
                  user=RELAY_USER, group=RELAY_USER,
                  port=rented.rest_port, namespace=rented.namespace, host=rented.address)


def _sync_daemon(layout: SandboxLayout, s3_env: dict[str, str]) -> Daemon:
    """checkpoint-sync at home, run as its systemd unit runs it: pfs to offsite, as the
    service account with CAP_DAC_READ_SEARCH alone, from the site Python."""
    argv = render.sync_argv(program(render.SYNC_PROGRAM), layout.site_config)
    return Daemon("checkpoint-sync",
                  [str(layout.site_python), "-I", "-m", "slurm_geo.sync.entry", *argv[1:]],
                  env=s3_env, port=render.sync_metrics_port(layout),
                  user=service_account.NAME, group=service_account.NAME,
                  capabilities=("dac_read_search",),
                  namespace=layout.namespace(Site.HOME), host=layout.address(Site.HOME))


def federation_daemon_name(site: Site) -> str:
    """`federation` at home (the only one unless replicated), `federation-control`."""
    return "federation" if site is Site.HOME else f"federation-{REPLICA_NAMES[site]}"


def _federation_daemon(layout: SandboxLayout, s3_env: dict[str, str], site: Site) -> Daemon:
    """The federation daemon at `site`, run as its systemd unit runs it: as the service
    account (sandbox.service_account), from the site Python every account can run."""
    return Daemon(federation_daemon_name(site),
                  [str(layout.site_python), "-I", "-m", "slurm_geo.federation.daemon.entry",
                   "--config", str(layout.federation_config(site))],
                  env=s3_env, port=render.federation_port(layout),
                  user=service_account.NAME, group=service_account.NAME,
                  namespace=layout.namespace(site), host=layout.address(site))
