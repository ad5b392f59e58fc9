"""Bring the two-cluster sandbox up, report on it, and take it down.

`up` is idempotent: every step checks before it acts, and a daemon already running from
this sandbox is left alone. Daemons start in stages, each stage waiting for its
dependencies (munge and MariaDB, then slurmdbd, then slurmctld, then slurmd/slurmrestd).
"""

from __future__ import annotations

import functools
import json
import os
import pwd
import secrets
import shlex
import shutil
import socket
import subprocess
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil

from slurm_geo.atomic import write_if_changed
from slurm_geo.ckpt.format.keys import create_master_key_file
from slurm_geo.config import load_config
from slurm_geo.config.daemons import DEFAULT_ETCD_PREFIX
from slurm_geo.errors import SandboxError
from slurm_geo.sandbox import (
    certs,
    etcd_members,
    geo,
    login,
    netns,
    remote_site,
    render,
    requirements,
    seaweed,
    service_account,
    stages,
    users,
)
from slurm_geo.sandbox.layout import (
    DEFAULT_PORT_BASE,
    REST_USER,
    RESTD_OS_GROUP,
    RESTD_OS_USER,
    S3_BUCKET,
    S3_PREFIX,
    S3_REGION,
    ClusterLayout,
    SandboxLayout,
)
from slurm_geo.sandbox.processes import Daemon, ProcessTable, port_is_open, wait_until
from slurm_geo.sandbox.sites import Site
from slurm_geo.slurm import admin

TOKEN_LIFESPAN_S = remote_site.TOKEN_LIFESPAN_S
STAGE_TIMEOUT_S = 45
S3_STOP_GRACE_S = 1.0


@dataclass(frozen=True)
class ComponentStatus:
    name: str
    up: bool
    pid: int | None
    endpoint: str


class Sandbox:
    def __init__(self, root: Path, port_base: int | None = None,
                 replicated: bool | None = None, remote_slurm: str | None = None):
        remembered = _remembered(root)
        self.layout = SandboxLayout(
            root, _as_remembered(root, "--port-base", port_base,
                                 remembered.get("port_base"), DEFAULT_PORT_BASE),
            # A sandbox made before `--replicated` existed was made without it.
            _as_remembered(root, "--replicated", replicated,
                           remembered.get("replicated", False if remembered else None), False),
            # and one made before `--remote-slurm` ran the host's Slurm at remote.
            _as_remembered(root, "--remote-slurm", remote_slurm, remembered.get(
                "remote_slurm", remote_site.HOST if remembered else None),
                remote_site.DEFAULT_REMOTE_SLURM))
        self.processes = ProcessTable(root)

    # --- public operations -------------------------------------------------------------

    def up(self, progress=print, wan_mbit: int | None = None) -> None:
        """Bring every site and daemon up; `wan_mbit` sets every WAN link's rate (else
        each link's the sites remember, else 200 Mbit/s)."""
        requirements.require_root()
        requirements.install_missing_packages(progress)
        requirements.require_weed()
        requirements.require_sync_program()
        version = admin.installed_slurm_version()
        s3_account = service_account.ensure(service_account.S3_NAME)
        _stop_stale_s3(self.layout, self.processes, s3_account.uid, progress)
        netns.up_sites(self.layout, wan_mbit)  # before any daemon: they run in the sites
        to_reconfigure = self._prepare_files(version, progress)
        made = users.ensure_accounts(self.layout)
        if made:
            progress(f"created the sandbox's users: {', '.join(made)}")
        users.share_home_store(self.layout)
        if users.ensure_site_python(self.layout, progress):
            _stop_old_code(self.layout, self.processes, self._stages(version), progress)
        seaweed.install_program(Path(stages.program(seaweed.WEED_PROGRAM)),
                                seaweed.installed_program(self.layout))
        # The users' login shells: slurm-geo on PATH, the home cluster and the config.
        login.ensure_profile(self.layout, self.env_lines(self.layout.onprem.name, False))
        by_stage = self._stages(version)
        self._check_ports(daemon for stage in by_stage for daemon in stage)
        remote = self.layout.address(Site.REMOTE)
        certs.ensure_rest_tls(self.layout, [remote])  # the relay's in front of slurmrestd
        shutil.chown(self.layout.rest_key, stages.RELAY_USER, stages.RELAY_USER)
        # The federation daemons', for their https at home (and control), where jobs of
        # both sites reach them.
        replicas = [self.layout.address(site) for site in self.layout.federation_sites]
        if certs.ensure_site_tls(self.layout, hosts=(*certs.SERVER_HOSTS, *replicas)):
            progress(f"made the sandbox's site CA and the federation daemon's certificate "
                     f"in {self.layout.tls_dir}")

        certs.ensure_etcd_tls(self.layout)
        _own_etcd(self.layout)
        self._stop_etcd_for_restart(progress)
        service = service_account.ensure()
        with ThreadPoolExecutor(max_workers=1) as beside:
            # The provider's machine needs nothing of home's: its Slurm comes up while
            # home's database and etcd do (about 3 s of an `up`'s 10), before the relay in
            # front of its REST (stage 2).
            provider = beside.submit(remote_site.up, self.layout, (service.uid, service.gid),
                                     progress) if remote_site.is_provider(self.layout) \
                else None
            self._start_stage(by_stage[0], progress)
            etcd_members.ensure_auth(self.layout.etcd_cluster, DEFAULT_ETCD_PREFIX)
            self._create_databases()
            self._start_stage(by_stage[1], progress)
            if provider is not None:
                provider.result()
        for cluster in self.layout.host_clusters:
            admin.register_cluster(cluster.slurm_conf, cluster.name)
            users.associate(cluster)
            # an operator on each: on rented it is REST_USER, whose JWT the daemon holds
            service_account.make_operator(cluster.slurm_conf, cluster.name, users.ACCOUNT)
        # What the daemons read and write (the tokens `write_rented_tokens` writes as theirs),
        # before stage 3 starts checkpoint-sync.
        _hand_over(self.layout, service)
        self._start_stage(by_stage[2], progress)
        self._start_stage(by_stage[3], progress)
        for cluster in self.layout.host_clusters:
            if cluster.name in to_reconfigure:
                progress(f"reconfiguring {cluster.name} (its configuration changed)")
                admin.reconfigure(cluster.slurm_conf)
        remote_site.write_rented_tokens(self.layout, (service.uid, service.gid))
        self._create_bucket()
        self._start_stage(by_stage[4], progress)  # it needs the token and the bucket
        progress(f"sandbox up: config {self.layout.site_config}")

    def down(self, purge: bool = False) -> None:
        names = [[d.name for d in stage] for stage in self._stages(None)]
        for group in reversed(names[1:]):
            self.processes.stop_together(group)
        # SeaweedFS spends 15 s stopping on SIGTERM (its filer drains its gRPC), past the
        # grace; what it acknowledged is on disk already (tests/test_seaweed.py kills it).
        self.processes.stop_together([stages.S3_DAEMON], grace_s=S3_STOP_GRACE_S)
        # etcd members one at a time: the leader hands its leadership to a member still
        # running and is gone in 0.1 s; stopped together, it waited 7 s (its request
        # timeout) on a member that was stopping as well.
        etcd = [name for name in names[0] if name.startswith(stages.ETCD_DAEMON_PREFIX)]
        for name in etcd:
            self.processes.stop(name)
        self.processes.stop_all([[name for name in names[0]
                                  if name != stages.S3_DAEMON and name not in etcd]])
        remote_site.down(self.layout)
        netns.down_sites(self.layout)
        if purge:
            login.remove_profile(self.layout)
            shutil.rmtree(self.layout.root, ignore_errors=True)

    def status(self) -> list[ComponentStatus]:
        rows = []
        for stage in self._stages(None):
            for daemon in stage:
                pid = self.processes.running_pid(daemon.name)
                up = pid is not None and _is_ready(daemon)
                rows.append(ComponentStatus(daemon.name, up, pid, _endpoint(daemon)))
        if remote_site.is_provider(self.layout):
            rows += [ComponentStatus(*row) for row in remote_site.daemon_states(self.layout)]
        return rows

    def env_lines(self, cluster_name: str, as_root: bool = True) -> list[str]:
        """`export` lines for a shell on `cluster_name` (`shell_env`)."""
        return shell_env(self.layout, cluster_name, as_root, self.s3_env)

    def s3_env(self) -> dict[str, str]:
        """The daemons' key to the sandbox's S3 server, and its region, as variables."""
        return {**self.daemons_s3_key().env(), "AWS_DEFAULT_REGION": S3_REGION,
                "AWS_CA_BUNDLE": str(self.layout.ca_cert)}  # its https is the site CA's

    def daemons_s3_key(self) -> seaweed.S3Credentials:
        """The daemons' key to the sandbox's S3 server (root's commands use it too)."""
        path = self.layout.s3_daemon_credentials
        return seaweed.S3Credentials.parse(_read_or_fail(path, "sandbox is not up"), str(path))

    # --- stages --------------------------------------------------------------------------

    def _stages(self, version: tuple[int, int] | None) -> list[list[Daemon]]:
        render.federation_dir(self.layout).mkdir(parents=True, exist_ok=True)
        # `down` and `status` only name the daemons: before the first `up` there is no key.
        s3_env = self.s3_env() if self.layout.s3_daemon_credentials.exists() else {}
        return stages.daemons_by_stage(self.layout, version, s3_env)

    def _start_stage(self, daemons: list[Daemon], progress) -> None:
        for daemon in daemons:
            if self.processes.running_pid(daemon.name) is None:
                progress(f"starting {daemon.name}")
                self.processes.start(daemon)
        for daemon in daemons:
            restarted = not self._wait_ready(daemon) and self._restart_hung(daemon, progress)
            if restarted:
                self._wait_ready(daemon)
            if not _is_ready(daemon):
                log = self.processes.log_file(daemon.name)
                what = ("exited before it answered"
                        if self.processes.running_pid(daemon.name) is None
                        else f"did not come up within {STAGE_TIMEOUT_S} s")
                raise SandboxError(
                    f"{daemon.name} {what}{', started twice' if restarted else ''}; "
                    f"its last output: {_tail(log)!r} (full log: {log})"
                )

    def _wait_ready(self, daemon: Daemon) -> bool:
        wait_until(functools.partial(self._ready_or_dead, daemon), STAGE_TIMEOUT_S)
        return _is_ready(daemon)

    def _restart_hung(self, daemon: Daemon, progress) -> bool:
        """A daemon alive but not answering gets one fresh start.

        slurmctld 22.05 now and then stalls at start, before it opens its port, on a
        loaded machine (seen once in CI after a stop and start); a second start comes up.
        What each of its threads waited in goes to its log, for whoever looks next.
        """
        pid = self.processes.running_pid(daemon.name)
        if pid is None:
            return False
        progress(f"{daemon.name} is running but not answering after {STAGE_TIMEOUT_S} s; "
                 "starting it again")
        with open(self.processes.log_file(daemon.name), "a") as log:
            log.write(f"slurm-geo sandbox: pid {pid} hung at start; its threads wait in: "
                      f"{_thread_waits(pid)}; starting it again\n")
        self.processes.stop(daemon.name)
        self.processes.start(daemon)
        return True

    def _ready_or_dead(self, daemon: Daemon) -> bool:
        return _is_ready(daemon) or self.processes.running_pid(daemon.name) is None

    def _check_ports(self, daemons: Iterable[Daemon]) -> None:
        for daemon in daemons:
            if daemon.port is None or self.processes.running_pid(daemon.name) is not None:
                continue
            busy = [port for port in (daemon.port, *daemon.extra_ports)
                    if port_is_open(port, daemon.host)]
            if busy:
                raise SandboxError(
                    f"port {busy[0]} (for {daemon.name}) is in use by another process; "
                    "stop it, or pick free ports with `slurm-geo sandbox up --port-base N` "
                    "on a fresh --dir"
                )

    # --- files ---------------------------------------------------------------------------

    def _prepare_files(self, version: tuple[int, int], progress) -> set[str]:
        """Write every file; the clusters whose running daemons must reconfigure."""
        layout = self.layout
        layout.root.mkdir(parents=True, exist_ok=True)
        # slurmrestd runs unprivileged and must traverse to slurm.conf.
        layout.root.chmod(0o755)
        layout.state_file.write_text(json.dumps(
            {"port_base": layout.port_base, "replicated": layout.replicated,
             "remote_slurm": layout.remote_slurm, "slurm_version": list(version)}) + "\n")
        layout.pfs_dir.mkdir(exist_ok=True)
        if not layout.master_key.exists():
            create_master_key_file(layout.master_key)
        seaweed.prepare_sandbox_files(layout)
        s3_account = service_account.ensure(service_account.S3_NAME)
        seaweed.hand_over(layout, s3_account.uid, s3_account.gid)
        layout.etcd_dir.mkdir(mode=0o700, exist_ok=True)
        for member in layout.etcd_cluster.members:  # etcd warns of a data dir others read
            member.data_dir.mkdir(mode=0o700, exist_ok=True)
        layout.munge_dir.mkdir(exist_ok=True)
        layout.munge_dir.chmod(0o755)  # munged insists clients can reach its socket
        _write_secret(layout.munge_dir / "munge.key", lambda: secrets.token_bytes(1024))
        _own_tree(layout.munge_dir, stages.MUNGE_USER)
        layout.mariadb_dir.mkdir(mode=0o700, exist_ok=True)
        password = _write_secret(layout.db_password_file, lambda: secrets.token_hex(16).encode())
        # The server's, but not the password file root uses to make Slurm's database user.
        _own_tree(layout.mariadb_dir, stages.MARIADB_USER, keep=(layout.db_password_file,))
        if not (layout.mariadb_dir / "data" / "mysql").is_dir():
            _run_checked(["mariadb-install-db", "--no-defaults",
                          f"--datadir={layout.mariadb_dir / 'data'}",
                          f"--user={stages.MARIADB_USER}",
                          "--auth-root-authentication-method=socket", "--skip-test-db"],
                         "initialising MariaDB")  # its files the server's (--user)
        hostname = socket.gethostname()
        changed = set()
        for cluster in layout.host_clusters:
            for sub in ("etc", "state", "spool", "run", "log"):
                (cluster.root / sub).mkdir(parents=True, exist_ok=True)
            cluster.root.chmod(0o755)
            cluster.etc.chmod(0o755)
            if cluster.uses_rest:
                _write_secret(cluster.jwt_key, lambda: secrets.token_bytes(32))
                # slurmrestd, unprivileged, makes its socket here.
                cluster.restd_socket.parent.mkdir(exist_ok=True)
                shutil.chown(cluster.restd_socket.parent, RESTD_OS_USER, RESTD_OS_GROUP)
            old = cluster.slurm_conf.read_text() if cluster.slurm_conf.exists() else None
            new = render.slurm_conf(layout, cluster, hostname)
            if write_if_changed(cluster.slurm_conf, new, 0o644) and old is not None:
                changed.add(cluster.name)
                if geo.needs_restart(old, new):
                    self._stop_for_restart(cluster, progress)
            write_if_changed(cluster.slurmdbd_conf,
                        render.slurmdbd_conf(layout, cluster, password.decode().strip()), 0o600)
        for site in layout.federation_sites:  # home's is the site config
            write_if_changed(layout.federation_config(site), render.site_config(layout, site),
                             0o644)
        changed |= geo.install(layout, write_if_changed)
        return {name for name in changed if self.processes.running_pid(f"{name}-slurmctld")}

    def _stop_etcd_for_restart(self, progress) -> None:
        """Stop the members running with another command line than theirs now (other
        certificates, flags an older slurm-geo gave), one at a time as `down` does; `up`
        starts them again. etcd reads its flags only at start."""
        stale = [daemon.name for daemon in stages.etcd_daemons(self.layout.etcd_cluster)
                 if _runs_otherwise(self.processes.running_pid(daemon.name), daemon.argv)]
        if stale:
            progress(f"restarting {', '.join(stale)} (their command line changed)")
        for name in stale:
            self.processes.stop(name)

    def _stop_for_restart(self, cluster: ClusterLayout, progress) -> None:
        """Settings read only at start changed: stop slurmctld and slurmd (jobs keep
        running, slurmstepd is no child of slurmd); `up` starts them again."""
        names = [f"{cluster.name}-slurmctld", *cluster.node_names]
        if any(self.processes.running_pid(name) for name in names):
            progress(f"restarting {cluster.name}'s slurmctld and slurmd (slurm.conf changed "
                     "where Slurm reads it only at start)")
            self.processes.stop_together(names)

    def _create_databases(self) -> None:
        password = self.layout.db_password_file.read_text().strip()
        # slurmdbd comes by the unix socket: as 'slurm'@'localhost'.
        statements = [f"CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '{password}'"]
        for cluster in self.layout.clusters:
            statements += [
                f"CREATE DATABASE IF NOT EXISTS {cluster.database}",
                f"GRANT ALL ON {cluster.database}.* TO 'slurm'@'localhost'",
            ]
        _run_checked(["mariadb", "--no-defaults", f"--socket={self.layout.mariadb_socket}",
                      "-u", "root", "-e", "; ".join(statements)], "creating Slurm's databases")

    def _create_bucket(self) -> None:
        seaweed.ensure_bucket(self.layout.s3_endpoint, self.daemons_s3_key(), S3_BUCKET,
                              seaweed.bucket_policy(S3_BUCKET, S3_PREFIX),
                              ca_file=self.layout.ca_cert)


def _runs_otherwise(pid: int | None, argv: list[str]) -> bool:
    """Whether process `pid` runs with another command line than `argv`."""
    if pid is None:
        return False
    try:
        running = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
    except OSError:
        return False
    return [part.decode(errors="replace") for part in running] != argv


def _is_ready(daemon: Daemon) -> bool:
    if daemon.ready_path is not None:
        return daemon.ready_path.exists()
    if daemon.health_check is not None:
        return daemon.health_check()
    return daemon.port is None or port_is_open(daemon.port, daemon.host)


def _endpoint(daemon: Daemon) -> str:
    if daemon.url is not None:
        return daemon.url
    if daemon.port is not None:
        return f"{daemon.host}:{daemon.port}"
    return str(daemon.ready_path or "")


def _remembered(root: Path) -> dict:
    """What the sandbox at `root` was created with (sandbox.json), {} before its `up`."""
    try:
        stored = json.loads((root / "sandbox.json").read_text())
    except (FileNotFoundError, ValueError):
        return {}
    return stored if isinstance(stored, dict) else {}


def _as_remembered(root: Path, option: str, requested, stored, default):
    """A setting a sandbox keeps for its life: the one it was created with, else the one
    asked for, else `default`; asking another of a sandbox that exists is refused."""
    if stored is None:
        return default if requested is None else requested
    if requested is not None and requested != stored:
        created = f"with {option} {stored}" if not isinstance(stored, bool) else \
            f"{'with' if stored else 'without'} {option}"
        raise SandboxError(f"sandbox {root} was created {created}; "
                           "take it down with --purge first, or use another --dir")
    return stored


def _stop_old_code(layout: SandboxLayout, processes: ProcessTable,
                   by_stage: list[list[Daemon]], progress) -> None:
    """The daemons running from the site Python (the federation daemon, checkpoint-sync,
    the TLS relay) still run the slurm_geo it held before `up` copied a new one: stopped,
    so their stages start them on the new code (a drill after a code change otherwise
    met a checkpoint-sync that could not read the new format)."""
    for stage in reversed(by_stage):
        for daemon in stage:
            if daemon.argv[:1] == [str(layout.site_python)] and \
                    processes.running_pid(daemon.name) is not None:
                progress(f"restarting {daemon.name} (slurm_geo changed)")
                processes.stop(daemon.name)


def _stop_stale_s3(layout: SandboxLayout, processes: ProcessTable, uid: int,
                   progress) -> None:
    """An S3 server running as another account (root, in a sandbox brought up before it
    had its own) or from another weed than the one `up` installs is stopped before its
    files are handed over, so stage 1 starts it as its account."""
    pid = processes.running_pid(stages.S3_DAEMON)
    if pid is None:
        return
    program = seaweed.installed_program(layout)
    if psutil.Process(pid).uids().real != uid or seaweed.program_differs(
            Path(stages.program(seaweed.WEED_PROGRAM)), program):
        progress(f"restarting {stages.S3_DAEMON} as {service_account.S3_NAME}, from {program}")
        processes.stop(stages.S3_DAEMON, grace_s=S3_STOP_GRACE_S)


def _write_secret(path: Path, make) -> bytes:
    if not path.exists():
        write_if_changed(path, make(), 0o600)
    return path.read_bytes()




def shell_env(layout: SandboxLayout, cluster_name: str, as_root: bool,
              s3_env: Callable[[], dict[str, str]]) -> list[str]:
    """`export` lines for a shell on `cluster_name`. A user's (`as_root` False) get what
    every user may know: the cluster, the config, the CAs and URLs; the daemons' S3 key,
    the master key and the daemon's JWT are root's, and a comment line says so."""
    cluster = layout.cluster(cluster_name)
    if cluster is None:
        names = ", ".join(c.name for c in layout.clusters)
        raise SandboxError(f"no sandbox cluster '{cluster_name}'; choose one of: {names}")
    values = {
        "SLURM_CONF": str(cluster.slurm_conf),
        "SLURM_GEO_CONFIG": str(layout.site_config),
        "SLURM_GEO_SANDBOX_DIR": str(layout.root),
        "AWS_ENDPOINT_URL": layout.s3_endpoint,
        # The sandbox's site CA signs its S3 server and slurmrestd's TLS relay: boto3
        # and curl trust it through these.
        "AWS_CA_BUNDLE": str(layout.ca_cert),
    }
    if cluster.uses_rest:
        values["SLURMRESTD_URL"] = cluster.rest_url
        values["CURL_CA_BUNDLE"] = str(layout.ca_cert)
    if as_root:
        values |= {"SLURM_GEO_KEY_FILE": str(layout.master_key), **s3_env()}
        if cluster.uses_rest:
            values["SLURMRESTD_USER"] = REST_USER  # whose JWT SLURM_JWT is
            values["SLURM_JWT"] = _read_or_fail(cluster.token_file, "sandbox is not up")
    lines = [f"export {key}={shlex.quote(value)}" for key, value in values.items()]
    if not as_root:
        lines.append("# the daemons' S3 key, the master key and the daemon's JWT are "
                     "root's: run `slurm-geo sandbox env` as root for those")
    return lines


def _hand_over(layout: SandboxLayout, service: service_account.ServiceAccount) -> None:
    for site in layout.federation_sites:
        service_account.hand_over(load_config(layout.federation_config(site)), service,
                                  inside=layout.root)


def _own_etcd(layout: SandboxLayout) -> None:
    """The members' data and their own keys (client port and peer) are etcd's."""
    cluster = layout.etcd_cluster
    _own_tree(layout.etcd_dir, stages.ETCD_USER)
    if cluster.files is not None:
        for member in cluster.members:
            for key in (cluster.files.member_key(member.site),
                        cluster.files.peer_key(member.site)):
                shutil.chown(key, stages.ETCD_USER, stages.ETCD_USER)


def _own_tree(top: Path, user: str, keep: Iterable[Path] = ()) -> None:
    """`top` and everything under it owned by `user` (and its group), but `keep`; a link
    is given over itself, never followed. Each directory is seen once (os.walk's own)."""
    entry = pwd.getpwnam(user)
    kept = set(keep)
    for directory, _subdirs, files in os.walk(top):
        for path in [Path(directory), *(Path(directory) / name for name in files)]:
            if path not in kept and os.lstat(path).st_uid != entry.pw_uid:
                os.lchown(path, entry.pw_uid, entry.pw_gid)


def _run_checked(argv: list[str], what: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=120)
    if proc.returncode != 0:
        raise SandboxError(f"{what} failed: {(proc.stderr or proc.stdout).strip()[-400:]}")


def _read_or_fail(path: Path, why: str) -> str:
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        raise SandboxError(f"{path} is missing ({why}); run `slurm-geo sandbox up`") from None


def _thread_waits(pid: int) -> str:
    waits = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        try:
            waits.append((task / "wchan").read_text().strip() or "running")
        except OSError:
            continue
    return ", ".join(waits) or "unknown"


def _tail(path: Path, lines: int = 3) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return ""


