"""The rented provider's site, as text: its slurm.conf, its accounts, and the shell that
lays its filesystem out in a mount namespace of its own. Pure; sandbox.provider runs it.

What a provider is here: another organisation's machine running a stock Slurm of today
(the image of sandbox.rootfs), reached only through slurmrestd with a JWT. Its
slurm.conf names no file of slurm-geo's: no SPANK plugin, no job_submit or cli_filter Lua,
no prolog or epilog. Its accounts are its own (`geo-alice`, `geo-bob`, with ids unlike
home's and nothing in their homes), and so are /home, /tmp and /scratch.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

# Inside the site (its root is the image).
SLURM_ETC = Path("/etc/slurm")
STATE_DIR = Path("/var/lib/slurm/slurmctld")
SPOOL_DIR = Path("/var/lib/slurm/slurmd")
LOG_DIR = Path("/var/log/slurm")
JWT_KEY = SLURM_ETC / "jwt.key"
SLURM_KEY = SLURM_ETC / "slurm.key"
SLURM_USER = ("slurm", 64030)  # the image's (Debian's fixed id for slurm)
RESTD_USER = ("slurmrestd", 64031)  # slurmrestd must run as neither root nor SlurmUser
MYSQL_USER = "mysql"  # the image's MariaDB account
# slurmrestd's unix socket (when the site serves REST on no network: a TLS proxy of the
# provider's in front of it) and MariaDB's, and its data: under /var/lib/slurm, the site's.
RESTD_SOCKET = Path("/var/lib/slurm/restd/slurmrestd.socket")
MYSQL_DATA = Path("/var/lib/slurm/mysql")
MYSQL_SOCKET = Path("/run/mariadbd/mysqld.sock")  # where its clients look by default
DATABASE = "slurm_acct_db"
HOSTNAME = "provider"
CPUS_PER_NODE = 2
MEMORY_MB_PER_NODE = 2000
CRED_EXPIRE_S = 10
# The host's Python, bound read-only into the site at the same paths. It stands for the
# provider's machine image, which offers its tenants a Python 3 with what a training job
# needs (torch): the interpreter, its standard library and the site venv's packages.
# Nothing else of the host's disk is visible in the site.
PYTHON_BINDS = (Path("/usr/bin/python3.11"), Path("/usr/lib/python3.11"),
                Path("/var/lib/slurm-geo/site-python"))
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")


@dataclass(frozen=True)
class Account:
    """A tenant's account at the provider, for home user `home_user`."""

    name: str
    uid: int
    home_user: str

    @property
    def home(self) -> Path:
        return Path("/home") / self.name


# The provider's accounts of the sandbox's users: their own names and ids (home's alice is
# 2001), nothing shared with home but the person.
ACCOUNTS = (Account("geo-alice", 3101, "alice"), Account("geo-bob", 3102, "bob"))
# The account a tenant's automation (slurm-geo's federation daemon) calls slurmrestd as: a
# Slurm operator of the site (when it keeps accounting), no home user's, no home of its own.
SERVICE_ACCOUNT = Account("slurm-geo", 3100, "")


@dataclass(frozen=True)
class Ports:
    ctld: int
    slurmd: int
    restd: int
    dbd: int
    mariadb: int

    @classmethod
    def from_base(cls, base: int) -> Ports:
        return cls(base, base + 1, base + 2, base + 3, base + 4)


def slurm_conf(cluster: str, address: str, ports: Ports,
               nodes: tuple[tuple[str, int], ...], accounting: bool = False) -> str:
    """A stock slurm.conf: auth/slurm (no MUNGE), JWT for slurmrestd, nothing of ours;
    `nodes` (name, slurmd port) on this one machine; with `accounting`, slurmdbd's."""
    lines = [
        f"ClusterName={cluster}",
        f"SlurmctldHost={HOSTNAME}({address})",
        f"SlurmctldPort={ports.ctld}",
        f"SlurmdPort={nodes[0][1]}",
        f"SlurmUser={SLURM_USER[0]}",
        "SlurmdUser=root",
        "AuthType=auth/slurm",
        "CredType=cred/slurm",
        f"AuthInfo=cred_expire={CRED_EXPIRE_S}",
        "AuthAltTypes=auth/jwt",
        f"AuthAltParameters=jwt_key={JWT_KEY}",
        f"StateSaveLocation={STATE_DIR}",
        f"SlurmdSpoolDir={SPOOL_DIR}/%n",
        "SlurmctldPidFile=/run/slurmctld.pid",
        "SlurmdPidFile=/run/slurmd-%n.pid",
        f"SlurmctldLogFile={LOG_DIR}/slurmctld.log",
        f"SlurmdLogFile={LOG_DIR}/slurmd-%n.log",
        # One machine stands for the cluster: no cgroups to enforce with.
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "MpiDefault=none",
        "SchedulerType=sched/backfill",
        "SelectType=select/cons_tres",
        "ReturnToService=2",
        "JobRequeue=1",
        "MinJobAge=600",
        "MessageTimeout=5",
        "SlurmdTimeout=20",
        "InactiveLimit=0",
        "KillWait=5",
        # A requeued job may start again this soon (the default waits 120 s).
        "SchedulerParameters=bf_interval=5",
    ]
    if accounting:
        lines += ["AccountingStorageType=accounting_storage/slurmdbd",
                  f"AccountingStorageHost={HOSTNAME}", f"AccountingStoragePort={ports.dbd}",
                  # slurmrestd's job endpoint gives the batch environment from it
                  "AccountingStoreFlags=job_env"]
    lines += [f"NodeName={name} NodeHostname={HOSTNAME} NodeAddr={address} Port={port} "
              f"CPUs={CPUS_PER_NODE} RealMemory={MEMORY_MB_PER_NODE} State=UNKNOWN"
              for name, port in nodes]
    lines.append(f"PartitionName=gpu Nodes={','.join(name for name, _ in nodes)} "
                 "Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def slurmdbd_conf(address: str, ports: Ports) -> str:
    """The site's slurmdbd: auth/slurm and JWT (slurmrestd's /slurmdb/ endpoints), its
    MariaDB by the unix socket, as the slurm account (unix_socket authentication)."""
    lines = ["AuthType=auth/slurm", "AuthAltTypes=auth/jwt",
             f"AuthAltParameters=jwt_key={JWT_KEY}", f"DbdHost={HOSTNAME}",
             f"DbdAddr={address}", f"DbdPort={ports.dbd}", f"SlurmUser={SLURM_USER[0]}",
             "PidFile=/run/slurmdbd.pid", f"LogFile={LOG_DIR}/slurmdbd.log",
             "StorageType=accounting_storage/mysql", "StorageHost=localhost",
             f"StorageUser={SLURM_USER[0]}", f"StorageLoc={DATABASE}"]
    return "\n".join(lines) + "\n"


def database_sql() -> str:
    """Slurm's database and its user, who logs in by its unix account (no password)."""
    return (f"CREATE DATABASE IF NOT EXISTS {DATABASE}; "
            f"CREATE USER IF NOT EXISTS '{SLURM_USER[0]}'@'localhost' IDENTIFIED VIA "
            f"unix_socket; GRANT ALL ON {DATABASE}.* TO '{SLURM_USER[0]}'@'localhost'")


def passwd(image_passwd: str, accounts: tuple[Account, ...] = ACCOUNTS) -> str:
    """The image's /etc/passwd with slurmrestd's account, the tenants' and the tenants'
    service account added. Pure."""
    names = {RESTD_USER[0], SERVICE_ACCOUNT.name, *(a.name for a in accounts)}
    kept = [line for line in image_passwd.splitlines()
            if line and line.split(":")[0] not in names]
    kept.append(f"{RESTD_USER[0]}:x:{RESTD_USER[1]}:{RESTD_USER[1]}::/nonexistent:"
                "/usr/sbin/nologin")
    service = SERVICE_ACCOUNT
    kept.append(f"{service.name}:x:{service.uid}:{service.uid}::/nonexistent:"
                "/usr/sbin/nologin")
    kept += [f"{a.name}:x:{a.uid}:{a.uid}::{a.home}:/bin/bash" for a in accounts]
    return "\n".join(kept) + "\n"


def group(image_group: str, accounts: tuple[Account, ...] = ACCOUNTS) -> str:
    names = {RESTD_USER[0], SERVICE_ACCOUNT.name, *(a.name for a in accounts)}
    kept = [line for line in image_group.splitlines()
            if line and line.split(":")[0] not in names]
    kept.append(f"{RESTD_USER[0]}:x:{RESTD_USER[1]}:")
    kept.append(f"{SERVICE_ACCOUNT.name}:x:{SERVICE_ACCOUNT.uid}:")
    kept += [f"{a.name}:x:{a.uid}:" for a in accounts]
    return "\n".join(kept) + "\n"


def hosts(address: str) -> str:
    lines = ["127.0.0.1 localhost"]
    if address != "127.0.0.1":
        lines.append(f"{address} {HOSTNAME}")
    else:
        lines[0] += f" {HOSTNAME}"
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class SiteDirs:
    """The host's directories the site is made of (under the sandbox's provider dir) and
    the image; each is bound at its place inside the site."""

    image: Path
    mnt: Path  # where the site's root is assembled before it becomes /
    etc: Path  # -> /etc/slurm
    var: Path  # -> /var/lib/slurm (state, spool)
    log: Path  # -> /var/log/slurm
    home: Path  # -> /home
    tmp: Path  # -> /tmp
    scratch: Path  # -> /scratch
    accounts: Path  # passwd, group, hosts, hostname -> /etc/


def setup_script(dirs: SiteDirs, python_binds: tuple[Path, ...] = PYTHON_BINDS) -> str:
    """The shell run in the site's new mount namespace: the image read-only as its root,
    the site's own writable directories over it, a /dev of a few devices, /proc, a /run of
    its own, the host's Python read-only, then pivot_root so nothing else of the host's
    disk stays reachable. Runs with the host's /bin/sh and tools until pivot_root. Pure."""
    q = shlex.quote
    m = dirs.mnt
    binds = [(dirs.etc, SLURM_ETC), (dirs.var, Path("/var/lib/slurm")),
             (dirs.log, LOG_DIR), (dirs.home, Path("/home")), (dirs.tmp, Path("/tmp")),
             (dirs.scratch, Path("/scratch"))]
    files = [(dirs.accounts / name, Path("/etc") / name)
             for name in ("passwd", "group", "hosts", "hostname")]
    lines = ["set -eu",
             f"mount --bind {q(str(dirs.image))} {q(str(m))}",
             f"mount -o remount,bind,ro {q(str(m))}"]
    for source, target in [*binds, *files]:
        lines.append(f"mount --bind {q(str(source))} {q(str(m) + str(target))}")
    for source in python_binds:
        inside = q(str(m) + str(source))
        lines += [f"mount --bind {q(str(source))} {inside}",
                  f"mount -o remount,bind,ro {inside}"]
    for name in ("passwd", "group", "hosts", "hostname"):
        lines.append(f"mount -o remount,bind,ro {q(f'{m}/etc/{name}')}")
    lines += [f"mount -t proc -o nosuid,nodev,noexec proc {q(f'{m}/proc')}",
              f"mount --rbind /sys {q(f'{m}/sys')}",
              f"mount -t tmpfs -o mode=0755,nosuid,size=64m run {q(f'{m}/run')}",
              f"mount -t tmpfs -o mode=0755,nosuid,size=1m dev {q(f'{m}/dev')}"]
    for device in DEVICES:
        lines += [f"touch {q(f'{m}/dev/{device}')}",
                  f"mount --bind /dev/{device} {q(f'{m}/dev/{device}')}"]
    lines += [f"mkdir -p {q(f'{m}/dev/pts')} {q(f'{m}/dev/shm')}",
              f"mount -t devpts -o newinstance,ptmxmode=0666 devpts {q(f'{m}/dev/pts')}",
              f"ln -s pts/ptmx {q(f'{m}/dev/ptmx')}",
              f"mount -t tmpfs -o mode=1777,nosuid,nodev shm {q(f'{m}/dev/shm')}",
              f"hostname {HOSTNAME}",
              f"cd {q(str(m))}",
              "pivot_root . .oldroot",
              "cd /",
              # The image's own umount from here on: the host's disk is gone after this.
              "umount -l /.oldroot"]
    return "\n".join(lines) + "\n"
