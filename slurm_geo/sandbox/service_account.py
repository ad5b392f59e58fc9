"""The daemons' own account, as docs/install.md has a site make it: `slurm-geo`, a system
user and group with no login shell, a Slurm operator on the CLI clusters (it reads other
users' batch scripts and environments, holds, releases, requeues and cancels their jobs),
and the only account besides root that may run slurm-geo-submit-as.

The federation daemon runs as it. What it reads or writes is handed to it at each `up`:
its state and audit directories (0700, its own), the secrets it alone uses (the master
key, its TLS key, the rented clusters' token files, the etcd client key: 0600, its own),
and the registry of the home controller, which root's PrologSlurmctld writes and the
daemon reads through the registry directory's group (0750/0640, group slurm-geo).
"""

from __future__ import annotations

import grp
import os
import pwd
import subprocess
from dataclasses import dataclass
from pathlib import Path

from slurm_geo.accounts import SERVICE_ACCOUNT
from slurm_geo.config import SiteConfig
from slurm_geo.errors import SandboxError

NAME = SERVICE_ACCOUNT  # user and group, as the Makefile's service-account target makes them
# The sandbox's S3 server (sandbox.seaweed) runs as an account of its own: the object
# store is a service of the remote site, not the daemons', and holds none of their secrets
# but the S3 identities it checks.
S3_NAME = "slurm-geo-s3"


@dataclass(frozen=True)
class ServiceAccount:
    uid: int
    gid: int


def ensure(name: str = NAME) -> ServiceAccount:
    """The account `name` and its group, created as system ones (no login shell, no home
    of their own) if missing: the daemons' (NAME), or the sandbox's S3 server's (S3_NAME)."""
    try:
        gid = grp.getgrnam(name).gr_gid
    except KeyError:
        _run(["groupadd", "--system", name])
        gid = grp.getgrnam(name).gr_gid
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        home = "/var/lib/slurm-geo" if name == NAME else "/nonexistent"
        _run(["useradd", "--system", "--gid", name, "--home-dir", home, "--no-create-home",
              "--shell", "/usr/sbin/nologin", name])
        entry = pwd.getpwnam(name)
    if entry.pw_uid == 0 or entry.pw_gid != gid:
        raise SandboxError(f"account {name} exists with uid {entry.pw_uid}, gid "
                           f"{entry.pw_gid}; it must be a system account in group {name}: "
                           f"userdel {name} and run `slurm-geo sandbox up` again")
    return ServiceAccount(entry.pw_uid, gid)


def federation_paths(site: SiteConfig) -> tuple[list[Path], list[Path]]:
    """(directories, files) the federation daemon owns: its state and audit directories,
    and every secret its config names."""
    fed = site.federation
    if fed is None:
        return [], []
    # Replicas keep their state and audit log in etcd: those paths are defaults, not theirs.
    directories = [] if fed.replicated else [fed.state.parent, fed.audit_path.parent]
    files = [path for path in (fed.key_file, fed.tls_key, fed.etcd_key,
                                  fed.etcd_password_file) if path is not None]
    for cluster in site.clusters.values():
        if cluster.token_file:
            files.append(Path(cluster.token_file))
        for user in cluster.users.values():
            files.append(Path(user.token_file))
            directories.append(Path(user.token_file).parent)  # the mapped accounts' own
    return directories, files


def sync_paths(site: SiteConfig) -> tuple[list[Path], list[Path]]:
    """(directories, files) checkpoint-sync owns: its state directory and its key."""
    if site.sync is None:
        return [], []
    files = [] if site.sync.key_file is None else [site.sync.key_file]
    return [site.sync.state.parent], files


def hand_over(site: SiteConfig, account: ServiceAccount, inside: Path) -> None:
    """Give the daemons what they read and write, and let them read the registry: only
    paths strictly inside the sandbox's root `inside` (a default path elsewhere is never
    touched), directories with the regular files directly in them."""
    directories, files = federation_paths(site)
    more_directories, more_files = sync_paths(site)
    directories, files = directories + more_directories, files + more_files
    for directory in dict.fromkeys(d for d in directories if _strictly_inside(d, inside)):
        directory.mkdir(mode=0o700, exist_ok=True)
        _own(directory, account.uid, account.gid, 0o700)
        for path in _files_in(directory):
            _own(path, account.uid, account.gid, 0o600)
    for path in files:
        if _strictly_inside(path, inside) and path.is_file():
            _own(path, account.uid, account.gid, 0o600)
    registry = Path(site.registry_path).parent
    if _strictly_inside(registry, inside):
        registry.mkdir(mode=0o750, exist_ok=True)
        _own(registry, 0, account.gid, 0o2750)  # setgid: new files take its group
        for path in _files_in(registry):
            _own(path, 0, account.gid, 0o640)


def _strictly_inside(path: Path, top: Path) -> bool:
    return path.resolve() != top.resolve() and path.resolve().is_relative_to(top.resolve())


def _files_in(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if p.is_file() and not p.is_symlink()]


def _own(path: Path, uid: int, gid: int, mode: int) -> None:
    os.chown(path, uid, gid)
    path.chmod(mode)


def make_operator(slurm_conf: Path, cluster: str, account: str, timeout_s: float = 20) -> None:
    """The account as a Slurm operator of `cluster`, under `account`."""
    from slurm_geo.slurm import admin

    admin.add_users(slurm_conf, cluster, account, [NAME], timeout_s)
    admin.set_admin_level(slurm_conf, NAME, "Operator", timeout_s)


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SandboxError(f"{' '.join(argv)}: {(done.stderr or done.stdout).strip()}")
