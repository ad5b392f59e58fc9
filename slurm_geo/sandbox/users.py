"""The sandbox's users and the software they run, as a site of many users has them.

Two unprivileged accounts, alice and bob, who do not trust each other: each has a home, a
project directory only they can enter (0700), and on the rented cluster (slurmrestd) an
account mapping with a short-lived JWT of their own, minted again at every `up`. Nothing
the suite submits runs as root.

Jobs run a Python every user can execute, with this checkout's slurm_geo and the suite's
torch: the "site software tree" a real site provides with modules or a shared venv. The
interpreter running the suite may live where only root can read (pyenv under /root), so
the sandbox builds a venv from the system's python3 once per machine, and publishes the
checkout's slurm_geo into it at each `up` whenever the source changed.
"""

from __future__ import annotations

import grp
import hashlib
import importlib.metadata
import os
import pwd
import re
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import slurm_geo
from slurm_geo.atomic import write_if_changed
from slurm_geo.errors import SandboxError
from slurm_geo.sandbox.layout import ClusterLayout, SandboxLayout
from slurm_geo.slurm import Owner, admin
from slurm_geo.slurm.errors import SlurmError

SYSTEM_PYTHON = Path("/usr/bin/python3")
ACCOUNT = "users"  # the Slurm account alice and bob are associated with, on both clusters
USER_TOKEN_LIFESPAN_S = 24 * 3600  # short-lived: `up` mints them again
PACKAGE = Path(slurm_geo.__file__).resolve().parent


@dataclass(frozen=True)
class SandboxUser:
    name: str
    uid: int  # its group has the same id and name

    @property
    def owner(self) -> Owner:
        return Owner(self.name, self.uid, self.uid)

    @property
    def home(self) -> Path:
        return Path("/home") / self.name


ALICE = SandboxUser("alice", 2001)
BOB = SandboxUser("bob", 2002)
SANDBOX_USERS = (ALICE, BOB)


def ensure_accounts(layout: SandboxLayout) -> list[str]:
    """Create the accounts and their project directories; what was created, for `up`."""
    made = []
    for person in SANDBOX_USERS:
        if _create_account(person):
            made.append(person.name)
        person.home.chmod(0o700)
        project = layout.project_dir(person.name)
        project.mkdir(parents=True, exist_ok=True)
        os.chown(project, person.uid, person.uid)
        project.chmod(0o700)
    layout.projects_dir.chmod(0o755)
    return made


def share_home_store(layout: SandboxLayout) -> None:
    """pfs stands for the site filesystem every user's jobs checkpoint into: world-writable
    and sticky, as /tmp, so no user removes another's files (a LocalDirStore keeps the
    root's bits on the directories it makes). What each user writes there is sealed
    under their run's own key."""
    if stat.S_IMODE(layout.pfs_dir.stat().st_mode) != 0o1777:
        for directory, _subdirs, _files in os.walk(layout.pfs_dir):  # a sandbox from before
            os.chmod(directory, 0o1777)
    from slurm_geo.ckpt.stores.store import LocalDirStore

    LocalDirStore(layout.pfs_dir)  # root makes the directories every run shares, not a user


def _create_account(person: SandboxUser) -> bool:
    try:
        existing = pwd.getpwnam(person.name)
    except KeyError:
        existing = None
    if existing is not None:
        if existing.pw_uid != person.uid:
            raise SandboxError(f"account '{person.name}' exists with uid {existing.pw_uid}, "
                               f"not the sandbox's {person.uid}; remove it with: "
                               f"userdel -r {person.name}")
        return False
    for taken in (_uid_owner(person.uid), _gid_owner(person.uid)):
        if taken is not None:
            raise SandboxError(f"uid/gid {person.uid} (for sandbox user '{person.name}') "
                               f"belongs to '{taken}'; free it, or remove that account")
    _run(["groupadd", "--gid", str(person.uid), person.name], f"creating group {person.name}")
    _run(["useradd", "--uid", str(person.uid), "--gid", str(person.uid), "--create-home",
          "--home-dir", str(person.home), "--shell", "/bin/bash", person.name],
         f"creating user {person.name}")
    return True


def _uid_owner(uid: int) -> str | None:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


def _gid_owner(gid: int) -> str | None:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return None


def associate(cluster: ClusterLayout) -> None:
    """alice and bob in the cluster's accounting, under ACCOUNT."""
    admin.add_users(cluster.slurm_conf, cluster.name, ACCOUNT,
                    [person.name for person in SANDBOX_USERS])


def mint_tokens(cluster: ClusterLayout, owner: tuple[int, int] | None = None) -> None:
    """A fresh JWT for each user's account on a slurmrestd cluster, valid for a day, owned
    by `owner` (the service account, which reads them) when given."""
    cluster.user_token_file("").parent.mkdir(mode=0o700, exist_ok=True)
    for person in SANDBOX_USERS:
        try:
            token = admin.issue_token(cluster.slurm_conf, person.name, USER_TOKEN_LIFESPAN_S)
        except SlurmError as exc:
            raise SandboxError(f"cannot issue {person.name}'s JWT for {cluster.name}: "
                               f"{exc}") from None
        write_if_changed(cluster.user_token_file(person.name), token + "\n", 0o600, owner)


def job_environment(layout: SandboxLayout, person: SandboxUser) -> dict[str, str]:
    """What a login shell of that user would hand sbatch: the site Python first on PATH."""
    return {
        "HOME": str(person.home),
        "USER": person.name,
        "LOGNAME": person.name,
        "PATH": f"{layout.site_python.parent}:/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "SLURM_GEO_CONFIG": str(layout.site_config),
    }


def run_as(person: SandboxUser, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    """A command as that user would type it: their uid, gid and groups, nothing of root's."""
    env = kwargs.pop("env", None) or {}
    command = ["runuser", "-u", person.name, "--", "env", "-i",
               *(f"{key}={value}" for key, value in env.items()), *argv]
    return subprocess.run(command, **kwargs)


# --- the site Python ---------------------------------------------------------------------

def ensure_site_python(layout: SandboxLayout, progress) -> bool:
    """The venv jobs run, every user able to execute it, with this checkout's slurm_geo
    and its user command, `slurm-geo`; True when it got a new copy of slurm_geo (daemons
    running from it still run the old one)."""
    python = layout.site_python
    if not python.exists():
        _build_venv(layout.site_python_dir, progress)
    published = _publish_package(python)
    write_if_changed(python.parent / "slurm-geo", COMMAND_SCRIPT.format(python=python), 0o755)
    return published


# What pip's console script does, run as the package's own entry (`-m slurm_geo`); `-P`:
# the user's working directory is not on the path, as it is not for a console script. The
# daemons' programs are the service account's and root's, started from the suite's Python
# (sandbox.stages), so only the users' command.
COMMAND_SCRIPT = """#!/bin/sh
exec {python} -P -m slurm_geo "$@"
"""


def _build_venv(target: Path, progress) -> None:
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    system = _system_python_version()
    if system != version:
        raise SandboxError(f"jobs run the system's {SYSTEM_PYTHON} (Python {system or 'absent'})"
                           f" and need the suite's Python {version}, for its torch; install "
                           f"python{version} and python{version}-venv")
    progress(f"building the site Python every sandbox user runs, in {target} (once)")
    target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    temp = target.with_name(f".{target.name}.building")
    shutil.rmtree(temp, ignore_errors=True)
    _run([str(SYSTEM_PYTHON), "-m", "venv", str(temp)],
         "creating the site venv (apt-get install python3-venv)")
    _run([str(temp / "bin" / "python3"), "-m", "pip", "install", "-q",
          "--disable-pip-version-check", *_job_requirements()],
         "installing the site venv's packages", timeout_s=900)
    os.chmod(temp, 0o755)
    temp.replace(target)


def _system_python_version() -> str | None:
    if not SYSTEM_PYTHON.exists():
        return None
    proc = subprocess.run([str(SYSTEM_PYTHON), "-c", "import sys; print(*sys.version_info[:2],"
                           " sep='.')"], capture_output=True, text=True, check=False)
    return proc.stdout.strip() or None


def _job_requirements() -> list[str]:
    """slurm_geo's own dependencies at the versions installed here, and the same torch."""
    pins = []
    for requirement in importlib.metadata.requires("slurm-geo") or ():
        if "extra ==" in requirement:
            continue
        name = re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0]
        pins.append(f"{name}=={importlib.metadata.version(name)}")
    try:
        # Without its local label (+cpu), as `make install` asks for it: pip takes the
        # machine's CPU wheel where one lies on disk, else the registry's.
        pins.append(f"torch=={importlib.metadata.version('torch').split('+')[0]}")
    except importlib.metadata.PackageNotFoundError:
        pass
    return pins


def _publish_package(python: Path) -> bool:
    """Copy slurm_geo into the venv when the checkout's source differs from what is there
    (True when it did).

    A new copy is built beside the old and swapped in, so a job importing at that moment
    sees one whole tree or the other.
    """
    site_packages = _site_packages(python)
    target = site_packages / "slurm_geo"
    digest = _source_digest(PACKAGE)
    stamp = site_packages / "slurm_geo.source-digest"
    if target.is_dir() and stamp.exists() and stamp.read_text() == digest:
        return False
    fresh = site_packages / ".slurm_geo.new"
    old = site_packages / ".slurm_geo.old"
    for stale in (fresh, old):
        shutil.rmtree(stale, ignore_errors=True)
    shutil.copytree(PACKAGE, fresh, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for path in [fresh, *fresh.rglob("*")]:  # whatever the checkout's umask was
        path.chmod(0o755 if path.is_dir() else 0o644)
    if target.exists():
        target.replace(old)
    fresh.replace(target)
    shutil.rmtree(old, ignore_errors=True)
    stamp.write_text(digest)
    return True


def _site_packages(python: Path) -> Path:
    found = sorted((python.parent.parent / "lib").glob("python3*/site-packages"))
    if not found:
        raise SandboxError(f"the site venv {python.parent.parent} has no site-packages; "
                           f"remove it and run `slurm-geo sandbox up` again")
    return found[0]


def _source_digest(package: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(package)).encode() + b"\0")
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _run(argv: list[str], what: str, timeout_s: float = 120) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=timeout_s)
    if proc.returncode != 0:
        raise SandboxError(f"{what} failed: {(proc.stderr or proc.stdout).strip()[-400:]}")
