"""Config files of the sandbox, rendered from its layout: pure text, tested without Slurm."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from slurm_geo.sandbox import remote_site
from slurm_geo.sandbox.etcd_members import REPLICA_USER
from slurm_geo.sandbox.layout import (
    REPLICA_NAMES,
    REST_USER,
    S3_BUCKET,
    S3_PREFIX,
    ClusterLayout,
    SandboxLayout,
)
from slurm_geo.sandbox.sites import Site
from slurm_geo.sandbox.users import SANDBOX_USERS
from slurm_geo.site import plan as site_plan

# Prices the sandbox advertises so cost-aware code has something realistic to weigh.
SANDBOX_PRICES = {
    "onprem": {"gpu_hour": 0.0, "cpu_hour": 0.01, "egress_per_gb": 0.0,
               "marketplace_fee_pct": 0.0},
    "rented": {"gpu_hour": 2.5, "cpu_hour": 0.04, "egress_per_gb": 0.09,
               "marketplace_fee_pct": 5.0},
}
CPUS_PER_NODE = 2
MEMORY_MB_PER_NODE = 2000
SYNC_METRICS_PORT_OFFSET = 45  # checkpoint-sync's Prometheus endpoint: port base + 45
SYNC_PROGRAM = "slurm-geo-checkpoint-sync"
FEDERATION_PORT_OFFSET = 50  # the federation daemon's lease/key service and /metrics
FEDERATION_PROGRAM = "slurm-geo-federation"
# Quick detection in the sandbox: an outage after 3 missed 1-s probes; a 4-s lease. The
# jobs of each cluster reach the daemon from one address (home's own, the WAN's end), so
# refusals are audited each second (not each minute): one job's must not hide another's.
SANDBOX_FEDERATION = {"probe_interval_s": 1, "outage_after": 3, "lease_ttl_s": 4,
                      "margin_s": 30, "failback_stable_s": 10,
                      "refusal_audit_interval_s": 1}

# --geo-* directives (docs/admin-slurm.md), installed on both clusters.
GEO_HOOKS = ("prolog", "epilog", "prolog_slurmctld", "epilog_slurmctld")
GEO_VALIDATOR = "check_directives"
SPANK_PLUGIN = "geo_directives.so"
# A requeued job waits cred_expire + 1 s before it may start again (Slurm's default is
# 120 s); the backfill pass every bf_interval then starts it. Both kept short here.
CRED_EXPIRE_S = 10
BF_INTERVAL_S = 5
SANDBOX_POLICY = {"require_cost_center": "true", "signal_lead_s": "15", "max_restarts": "2"}
SANDBOX_DATA_CLASSES = {"restricted": ["home"]}
SANDBOX_BUDGETS = {"ml-research": 500, "ops": 50}


def sync_metrics_port(layout: SandboxLayout) -> int:
    return layout.port_base + SYNC_METRICS_PORT_OFFSET


def sync_state_path(layout: SandboxLayout) -> Path:
    return layout.root / "sync" / "checkpoint-sync.db"


def billing_database_path(layout: SandboxLayout) -> Path:
    """Inside the sandbox root: every sandbox bills into its own database, never the
    site's default /var/lib/slurm-geo/billing.db (which a second sandbox would share)."""
    return layout.root / "billing" / "billing.db"


def federation_port(layout: SandboxLayout) -> int:
    return layout.port_base + FEDERATION_PORT_OFFSET


def federation_url(layout: SandboxLayout, site: Site = Site.HOME) -> str:
    """Where the sandbox's jobs reach the daemon at `site`: https, with the sandbox's
    site CA. Jobs moved to rented reach it across the WAN."""
    return f"https://{layout.address(site)}:{federation_port(layout)}"


def federation_dir(layout: SandboxLayout) -> Path:
    return layout.root / "federation"


def sync_argv(program: str, config: Path) -> list[str]:
    """checkpoint-sync's command line: the systemd unit's ExecStart, with the sandbox's
    program path and config."""
    return [program, "--config", str(config)]


def slurm_conf(layout: SandboxLayout, cluster: ClusterLayout, hostname: str) -> str:
    state = cluster.root / "state"
    lines = [
        f"ClusterName={cluster.name}",
        f"SlurmctldHost={hostname}({cluster.address})",
        f"SlurmctldPort={cluster.ctld_port}",
        f"SlurmdPort={cluster.node_ports[0]}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={layout.munge_socket},cred_expire={CRED_EXPIRE_S}",
        f"StateSaveLocation={state}",
        f"SlurmdSpoolDir={cluster.root}/spool/%n",
        f"SlurmctldPidFile={cluster.root}/run/slurmctld.pid",
        f"SlurmdPidFile={cluster.root}/run/slurmd-%n.pid",
        f"SlurmctldLogFile={cluster.root}/log/slurmctld.log",
        f"SlurmdLogFile={cluster.root}/log/slurmd-%n.log",
        # No cgroups: the sandbox shares one host and needs no resource enforcement.
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "MpiDefault=none",
        "SchedulerType=sched/backfill",
        f"SchedulerParameters=bf_interval={BF_INTERVAL_S}",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "ReturnToService=2",
        "JobRequeue=1",
        # Finished jobs stay visible to squeue/scontrol for ten minutes.
        "MinJobAge=600",
        "MessageTimeout=5",
        # A dead node is declared down (and its jobs requeued) this long after its last
        # answer; Slurm's default is 300 s.
        "SlurmdTimeout=20",
        "InactiveLimit=0",
        "KillWait=5",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/slurmdbd",
        f"AccountingStorageHost={cluster.address}",
        f"AccountingStoragePort={cluster.dbd_port}",
        # Clients reach slurmdbd through this munge socket, not through AuthInfo.
        f"AccountingStoragePass={layout.munge_socket}",
        # slurmdbd keeps each batch job's environment: the federation daemon reads the
        # owner's with `sacct --env-vars` when it registers a job.
        "AccountingStoreFlags=job_env",
    ]
    if cluster.uses_rest:
        lines += ["AuthAltTypes=auth/jwt", f"AuthAltParameters=jwt_key={cluster.jwt_key}"]
    lines += geo_slurm_conf_lines(cluster)
    for name, port in zip(cluster.node_names, cluster.node_ports, strict=True):
        lines.append(
            f"NodeName={name} NodeHostname={hostname} NodeAddr={cluster.address} Port={port} "
            f"CPUs={CPUS_PER_NODE} RealMemory={MEMORY_MB_PER_NODE} State=UNKNOWN"
        )
    lines.append(
        f"PartitionName=batch Nodes={','.join(cluster.node_names)} Default=YES "
        "MaxTime=INFINITE State=UP"
    )
    return "\n".join(lines) + "\n"


def geo_slurm_conf_lines(cluster: ClusterLayout) -> list[str]:
    """The slurm.conf lines of the --geo-* integration: plugin stack, Lua, hooks."""
    return [
        f"PlugStackConfig={cluster.etc / 'plugstack.conf'}",
        "JobSubmitPlugins=lua",  # job_submit.lua next to slurm.conf
        "CliFilterPlugins=cli_filter/lua",  # cli_filter.lua next to slurm.conf
        *(f"{_hook_setting(hook)}={geo_hook_path(cluster, hook)}" for hook in GEO_HOOKS),
    ]


def _hook_setting(hook: str) -> str:
    return {"prolog": "Prolog", "epilog": "Epilog", "prolog_slurmctld": "PrologSlurmctld",
            "epilog_slurmctld": "EpilogSlurmctld"}[hook]


def geo_hook_path(cluster: ClusterLayout, hook: str) -> Path:
    """The wrapper slurm.conf names for `hook` (or for the validator)."""
    return cluster.etc / f"geo-{hook}"


def spank_plugin_path(layout: SandboxLayout) -> Path:
    return layout.root / "lib" / SPANK_PLUGIN


def spank_build_argv(compiler: str, source: Path, output: Path,
                     include: Path = Path("/usr/include")) -> list[str]:
    """`slurm-geo site install`'s build of the plugin, into the sandbox."""
    return site_plan.spank_build_argv(compiler, str(source), str(output), str(include))


def plugstack_conf(layout: SandboxLayout, cluster: ClusterLayout) -> str:
    return (f"required {spank_plugin_path(layout)} "
            f"validator={geo_hook_path(cluster, GEO_VALIDATOR)} "
            f"config={layout.site_config} cluster={cluster.name}\n")


def hook_wrapper(layout: SandboxLayout, cluster: ClusterLayout, python: str,
                 script: Path, package_root: Path | None = None) -> str:
    """A shell wrapper running a hook script (slurm_geo/share/hooks/) with the sandbox's
    config. No key: a hook opens neither the master key nor a store's credentials
    (docs/security.md, "Where each secret lives"). With `package_root`, the script
    imports slurm_geo from there: the checkout the sandbox was brought up from, whatever
    else `python` has installed.

    Slurm runs hooks with an almost empty environment and no arguments; a site installs
    the scripts themselves with their first line pointing at its Python instead.
    """
    env = {
        "SLURM_GEO_CONFIG": str(layout.site_config),
        "SLURM_GEO_HOOK_LOG": str(layout.root / "log" / "geo-hooks.log"),
        "SLURM_CONF": str(cluster.slurm_conf),
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        **({"PYTHONPATH": str(package_root)} if package_root else {}),
    }
    exports = " ".join(f"{key}={shlex.quote(value)}" for key, value in env.items())
    return ("#!/bin/sh\n# slurm-geo hook of the sandbox (generated by `slurm-geo sandbox up`)\n"
            f"export {exports}\n"
            f"exec {shlex.quote(python)} {shlex.quote(str(script))} \"$@\"\n")


def slurmdbd_conf(layout: SandboxLayout, cluster: ClusterLayout, db_password: str) -> str:
    lines = [
        "AuthType=auth/munge",
        f"AuthInfo=socket={layout.munge_socket}",
        "DbdHost=localhost",
        f"DbdAddr={cluster.address}",
        f"DbdPort={cluster.dbd_port}",
        "SlurmUser=root",
        f"PidFile={cluster.root}/run/slurmdbd.pid",
        f"LogFile={cluster.root}/log/slurmdbd.log",
        "StorageType=accounting_storage/mysql",
        # The unix socket (MYSQL_UNIX_PORT in slurmdbd's environment): MariaDB serves
        # both sites from the machine's namespace, where no site's network reaches.
        "StorageHost=localhost",
        "StorageUser=slurm",
        f"StoragePass={db_password}",
        f"StorageLoc={cluster.database}",
    ]
    if cluster.uses_rest:
        # slurmrestd's /slurmdb/ endpoints authenticate to slurmdbd with the JWT as well.
        lines += ["AuthAltTypes=auth/jwt", f"AuthAltParameters=jwt_key={cluster.jwt_key}"]
    return "\n".join(lines) + "\n"


def restd_plugins(slurm_version: tuple[int, int]) -> list[str]:
    """slurmrestd `-s` arguments for this Slurm release; empty means load them all.

    Up to 23.02 the plugins are named by API version and must be listed; from 23.11 on
    slurmrestd loads every data parser and serves each API version it knows.
    """
    legacy = {(22, 5): "0.0.38", (23, 2): "0.0.39"}
    if slurm_version in legacy:
        api = legacy[slurm_version]
        return ["-s", f"openapi/v{api},openapi/dbv{api}"]
    return []


def site_config(layout: SandboxLayout, replica_site: Site = Site.HOME) -> str:
    """The sandbox's slurm-geo config; `replica_site` the site whose federation daemon
    reads it (only [federation] differs between them)."""
    onprem, rented = layout.onprem, layout.rented
    parts = [
        "# slurm-geo configuration of the local sandbox (generated by `slurm-geo sandbox up`).",
        "[site]",
        f'home_cluster = {_q(onprem.name)}',
        "",
        f"[clusters.{onprem.name}]",
        f'region = {_q(onprem.region)}',
        'provider = "onprem"',
        'access = "cli"',
        f'slurm_conf = {_q(onprem.slurm_conf)}',
        "timeout_s = 10",
        'store = "pfs"',
        _prices_table(onprem.name),
        "",
        f"[clusters.{rented.name}]",
        f'region = {_q(rented.region)}',
        'provider = "sandbox-rental"',
        'access = "rest"',
        f'rest_url = {_q(rented.rest_url)}',
        f'rest_user = {_q(REST_USER)}',
        f'token_file = {_q(rented.token_file)}',
        f'ca_file = {_q(layout.ca_cert)}',  # the TLS relay's certificate is the site CA's
        "timeout_s = 10",
        'store = "offsite"',
        # The provider's image offers slurm-geo's Python at the host's path (PYTHON_BINDS):
        # a moved job's preamble runs it.
        *([f"python = {_q(layout.site_python)}"] if remote_site.is_provider(layout) else []),
        _prices_table(rented.name),
        "",
        # Each sandbox user's jobs run there as an account of their own, with its own
        # JWT: of the same name on the host's Slurm, the provider's (geo-alice) on its
        # machine, in that account's home there; root has no mapping, so no job of
        # root's can move there.
        *(line for person in SANDBOX_USERS for line in (
            f"[clusters.{rented.name}.users.{person.name}]",
            *_remote_account_lines(layout, person.name),
            f"token_file = {_q(rented.user_token_file(person.name))}",
            "")),
        "[stores.pfs]",
        f'url = {_q(f"file://{layout.pfs_dir}")}',
        f'region = {_q(onprem.region)}',
        "",
        "[stores.offsite]",
        f'url = {_q(f"s3://{S3_BUCKET}/{S3_PREFIX}")}',
        f'region = {_q(rented.region)}',
        f'endpoint_url = {_q(layout.s3_endpoint)}',
        f"ca_file = {_q(layout.ca_cert)}",  # the S3 server's certificate is the site CA's
        'job_keys = "per-run"  # each moved run its own key (docs/stores.md)',
        "",
        "[sync]  # checkpoint-sync: pfs -> offsite",
        'roots = ["pfs"]',
        'destination = "offsite"',
        f"state = {_q(sync_state_path(layout))}",
        f"key_file = {_q(layout.master_key)}",
        f"metrics_address = {_q(layout.address(Site.HOME))}",
        f"metrics_port = {sync_metrics_port(layout)}",
        # a checkpoint waits up to a poll to be found: its replication lag is that plus
        # one crossing (docs/checkpoint-sync.md); three listings a second cost nothing here
        "poll_interval_s = 1",
        'cpu_policy = "batch"  # it shares the host with the test suite: lag matters more',
        "retry_base_s = 5",
        "retry_max_s = 60",
        "",
        "[policy]  # what --geo-* directives may ask for (docs/admin-slurm.md)",
        *(f"{key} = {value}" for key, value in SANDBOX_POLICY.items()),
        "",
        "[policy.data_classes]",
        *(f"{name} = {json.dumps(regions)}" for name, regions in SANDBOX_DATA_CLASSES.items()),
        "",
        "[policy.budgets]",
        *(f"{name} = {usd}" for name, usd in SANDBOX_BUDGETS.items()),
        "",
        "[registry]",
        f"path = {_q(layout.root / 'registry' / 'registry.db')}",
        "",
        "[billing]  # chargeback (docs/billing.md)",
        f"database = {_q(billing_database_path(layout))}",
        "",
        "[federation]  # the federation daemon (docs/federation.md)",
        *([] if layout.replicated else [  # else the state and the audit log are in etcd
            f"state = {_q(federation_dir(layout) / 'federation.db')}",
            f"audit_path = {_q(federation_dir(layout) / 'audit.db')}"]),
        f"key_file = {_q(layout.master_key)}",
        f"listen_address = {_q(layout.address(replica_site))}",
        f"listen_port = {federation_port(layout)}",
        f"public_url = {_q(federation_url(layout, replica_site))}",
        f"tls_cert = {_q(layout.federation_cert)}",
        f"tls_key = {_q(layout.federation_key)}",
        f"ca_file = {_q(layout.ca_cert)}",
        f"munge_socket = {_q(layout.munge_socket)}",  # home jobs prove who they are by MUNGE
        *(f"{key} = {value}" for key, value in SANDBOX_FEDERATION.items()),
        *(_replicas_lines(layout, replica_site) if layout.replicated else []),
    ]
    return "\n".join(parts) + "\n"


def _remote_account_lines(layout: SandboxLayout, user: str) -> list[str]:
    if not remote_site.is_provider(layout):
        return [f"account = {_q(user)}"]
    account = remote_site.account_for(user)
    return [f"account = {_q(account.name)}", f"work_dir = {_q(account.home)}"]


def _replicas_lines(layout: SandboxLayout, replica_site: Site) -> list[str]:
    """[federation]'s replica settings: the state in the sites' etcd, this daemon
    the replica of `replica_site`, and every replica by name, site and URL."""
    files = layout.etcd_cluster.files
    assert files is not None  # a sandbox's members are always on TLS
    # the trusted sites' members only: the rented one serves no client (sandbox.etcd_members)
    endpoints = list(layout.etcd_cluster.client_endpoints)
    lines = [f"etcd_endpoints = {json.dumps(endpoints)}",
             f"etcd_ca_file = {_q(files.ca)}", f"etcd_cert = {_q(files.client_cert)}",
             f"etcd_key = {_q(files.client_key)}", f"etcd_user = {_q(REPLICA_USER)}",
             f"etcd_password_file = {_q(files.password)}",
             f"replica = {_q(REPLICA_NAMES[replica_site])}"]
    for site in layout.federation_sites:
        lines += ["", "[[federation.replicas]]", f"name = {_q(REPLICA_NAMES[site])}",
                  f"site = {_q(site.value)}", f"url = {_q(federation_url(layout, site))}"]
    return lines


def _q(value: object) -> str:
    """A TOML basic string: JSON's escaping is a subset TOML accepts."""
    return json.dumps(str(value))


def _prices_table(cluster: str) -> str:
    prices = SANDBOX_PRICES[cluster]
    body = "\n".join(f"{key} = {value}" for key, value in prices.items())
    return f"\n[clusters.{cluster}.prices]\n{body}"
