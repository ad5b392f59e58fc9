"""Which pieces `slurm-geo doctor` looks at on this host, by role, and in what order.

Roles (docs/install.md, "Checking a deployment"): `login` (users submit: slurm.conf's
PlugStackConfig, the SPANK plugin, munge, CA files, the daemon's clock), `compute` (the
same: slurmd loads the plugin), `controller` (also the hook and Lua lines of slurm.conf),
`daemon` (a federation or checkpoint-sync host: the master key and every secret, the
units, TLS certificates and keys, tokens, etcd, the stores). A compute node is never failed
for lacking a daemon's key.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from slurm_geo.accounts import SERVICE_ACCOUNT
from slurm_geo.config.model import ClusterConfig, SiteConfig
from slurm_geo.config.paths import master_key_path
from slurm_geo.doctor import ROLES, checks, gather
from slurm_geo.doctor.checks import Finding

__all__ = ["ROLES", "Options", "detect_roles", "examine"]
SECRET_OWNERS = ("root", SERVICE_ACCOUNT)


@dataclass(frozen=True)
class Options:
    roles: tuple[str, ...]
    systemd_root: Path = Path("/")
    munge_socket: Path | None = None
    clock_offset_s: float = 0.0  # added to this host's clock (tests: a skewed host)
    stores: bool = True
    link_rate: bool = False  # time a transfer of a few MB to each store (report only)
    roles_given: bool = True  # False: detect_roles found them


def detect_roles(site: SiteConfig, systemd_root: Path,
                 env: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """What this host is, from the config and what is installed: daemon where a daemon's
    unit is enabled or the master key is (site install puts the units on every host, and
    only the daemons' hosts enable them), controller where slurmctld is, compute where
    slurmd is; login always (every host with slurm-geo submits)."""
    roles = ["login"]
    if shutil.which("slurmd"):
        roles.append("compute")
    if shutil.which("slurmctld"):
        roles.append("controller")
    key = master_key_path(_key_file(site), env)
    units = [gather.unit_fact(unit, systemd_root) for unit in daemon_units(site)]
    if (site.federation is not None or site.sync is not None) and \
            (key.exists() or any(unit.path and unit.enabled for unit in units)):
        roles.append("daemon")
    return tuple(roles)


def daemon_units(site: SiteConfig) -> list[str]:
    units = []
    if site.federation is not None:
        units.append("slurm-geo-federation.service")
    if site.sync is not None:
        units.append("slurm-geo-checkpoint-sync.service")
    return units


def examine(site: SiteConfig, options: Options, env: Mapping[str, str] = os.environ,
            clock: Callable[[], float] = time.time) -> list[Finding]:
    roles = set(options.roles)
    findings: list[Finding] = []
    if "daemon" in roles and not _privileged():
        # A user on a daemon host: the daemon's files are not theirs to read.
        roles.discard("daemon")
        findings.append(checks.daemon_checks_skipped(options.roles_given))
    daemon = "daemon" in roles
    findings += _slurm(site, roles, options)
    findings += checks.check_munge(gather.munge_fact(_munge_socket(site, options)))
    if daemon or "daemon" not in options.roles:
        findings += _secrets(site, roles, env)
    findings += _certificates(site, daemon, clock())
    if daemon:
        findings += _daemon_host(site, options, clock())
    if site.federation is not None:
        findings += checks.check_clock(
            [gather.clock_fact(url, site.federation.ca_file) for url in site.federation.job_urls],
            options.clock_offset_s)
    return findings


def _daemon_host(site: SiteConfig, options: Options, now: float) -> list[Finding]:
    """What only a daemon host holds or does: tokens, units, the Slurm operator account,
    etcd, the stores with the daemons' credentials."""
    findings = _tokens(site, now)
    for unit in daemon_units(site):
        findings += checks.check_unit(gather.unit_fact(unit, options.systemd_root))
    fed = site.federation
    if fed is not None:
        for cluster in _cli_clusters_here(site):
            assert cluster.slurm_conf is not None
            findings += checks.check_operator(gather.operator_fact(
                cluster.name, cluster.slurm_conf, SERVICE_ACCOUNT))
        if fed.replicated:
            findings += checks.check_etcd(gather.etcd_fact(fed))
    if options.stores:
        for store in site.stores.values():
            findings += checks.check_store(gather.store_fact(
                store.name, store.url, store.endpoint_url, store.ca_file))
            if options.link_rate:
                findings += checks.check_link(gather.link_fact(
                    store.name, store.url, store.endpoint_url, store.ca_file))
    return findings


def _privileged() -> bool:
    """root, or the daemons' own account: who may read what the daemon checks look at."""
    import pwd

    uid = os.geteuid()
    try:
        return uid == 0 or pwd.getpwuid(uid).pw_name == SERVICE_ACCOUNT
    except KeyError:
        return False


def _slurm(site: SiteConfig, roles: set[str], options: Options) -> list[Finding]:
    """slurm.conf's lines and the SPANK plugin, for the home cluster and every CLI cluster
    whose slurm.conf is on this host."""
    if not roles & {"login", "compute", "controller"}:
        return []
    findings: list[Finding] = []
    for cluster in _cli_clusters_here(site):
        assert cluster.slurm_conf is not None
        conf = gather.slurm_conf_fact(cluster.name, cluster.slurm_conf)
        findings += checks.check_slurm_conf(conf, controller="controller" in roles)
        version, version_error = gather.slurm_version(cluster.slurm_conf)
        findings += checks.check_spank(gather.spank_fact(conf, version, version_error))
    return findings


def _cli_clusters_here(site: SiteConfig) -> list[ClusterConfig]:
    """The home cluster if reached by CLI, and every CLI cluster whose slurm.conf is here."""
    return [c for c in site.clusters.values() if c.access == "cli" and c.slurm_conf is not None
            and (c.name == site.home_cluster or c.slurm_conf.exists())]


def _munge_socket(site: SiteConfig, options: Options) -> Path | None:
    from slurm_geo.lease.munge import munge_socket

    if options.munge_socket is not None:
        return options.munge_socket
    home = site.clusters.get(site.home_cluster)
    configured = site.federation.munge_socket if site.federation is not None else None
    return munge_socket(configured, home.slurm_conf if home is not None else None)


def _key_file(site: SiteConfig) -> Path | None:
    if site.federation is not None and site.federation.key_file is not None:
        return site.federation.key_file
    return site.sync.key_file if site.sync is not None else None


def _secrets(site: SiteConfig, roles: set[str], env: Mapping[str, str]) -> list[Finding]:
    """The master key and the daemon's other secrets on a daemon host; on any other, the
    master key's absence."""
    daemon = "daemon" in roles
    key = master_key_path(_key_file(site), env)
    found = gather.secret_file_fact(
        "master key", key, required=daemon, owners=SECRET_OWNERS,
        create_fix=f"`slurm-geo keys init {key}` on the first daemon host, a copy (0600) "
                   "at the control site's (docs/install.md, section 5)")
    if not daemon:
        return checks.check_not_held(found, "/".join(sorted(roles)))
    findings = checks.check_secret_file(found)
    fed = site.federation
    named: list[tuple[str, Path | None]] = []
    if fed is not None:
        named += [("[federation] tls_key", fed.tls_key), ("[federation] etcd_key", fed.etcd_key),
                  ("[federation] etcd_password_file", fed.etcd_password_file)]
    for cluster in site.clusters.values():
        named.append((f"[clusters.{cluster.name}] token_file", cluster.token_file))
        named += [(f"[clusters.{cluster.name}.users.{user}] token_file", account.token_file)
                  for user, account in cluster.users.items()]
    for store in site.stores.values():
        named.append((f"[stores.{store.name}] job_credentials", store.job_credentials))
    for what, path in named:
        if path is not None:
            findings += checks.check_secret_file(gather.secret_file_fact(
                f"secret {what}", path, owners=SECRET_OWNERS))
    return findings


def _tokens(site: SiteConfig, now: float) -> list[Finding]:
    findings: list[Finding] = []
    for cluster in site.clusters.values():
        if cluster.token_file is not None:
            findings += checks.check_jwt(gather.jwt_fact(
                f"[clusters.{cluster.name}] token_file", cluster.token_file,
                cluster.rest_user), now)
        for user, account in cluster.users.items():
            findings += checks.check_jwt(gather.jwt_fact(
                f"[clusters.{cluster.name}.users.{user}]", account.token_file,
                account.account), now)
    return findings


def _certificates(site: SiteConfig, daemon: bool, now: float) -> list[Finding]:
    """The daemon's own certificates (with their keys and CAs) on a daemon host; every CA
    file the config names, on every host (jobs and commands verify against them)."""
    findings: list[Finding] = []
    fed = site.federation
    leaves: list[Path] = []
    if daemon and fed is not None:
        if fed.tls_cert is not None:
            leaves.append(fed.tls_cert)
            findings += checks.check_tls(gather.tls_fact(
                "[federation] tls_cert", fed.tls_cert, fed.ca_file, fed.tls_key), now)
        if fed.etcd_cert is not None:
            leaves.append(fed.etcd_cert)
            findings += checks.check_tls(gather.tls_fact(
                "[federation] etcd_cert", fed.etcd_cert, fed.etcd_ca_file, fed.etcd_key), now)
    authorities = gather.existing([
        *([fed.ca_file, fed.etcd_ca_file if daemon else None] if fed is not None else []),
        *(c.ca_file for c in site.clusters.values()),
        *(s.ca_file for s in site.stores.values())])
    for ca in authorities:
        if ca not in leaves:
            findings += checks.check_tls(gather.tls_fact(
                f"CA {ca.name}", ca, renew=f"replace {ca} with the current CA certificate"),
                now)
    return findings
