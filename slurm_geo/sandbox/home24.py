"""A home cluster on Debian 13's Slurm (24.11), reached by Slurm's own commands.

Home supports the Slurm of Debian 12 (22.05: the host's, which the sandbox runs) and of
Debian 13 (24.11). This is the second: slurmctld, a slurmd and slurmdbd with its MariaDB
from a trixie root filesystem (sandbox.rootfs.HOME_2411, kept at HOME_2411_IMAGE_DIR),
started as sandbox.provider starts a provider's site (a mount and UTS namespace, the image
as its root), with auth/slurm and home's users (alice, bob) at home's uids.

The CLI backend reaches it through `client`: every Slurm command runs inside the site
behind `nsenter` (the root's 24.11 binaries, the site's slurm.conf), as the service account
`slurm-geo` (a Slurm operator there), and a submission for an owner goes to the setuid
helper slurm-geo-submit-as, built from slurm_geo/share/libexec/submit_as.c and installed in
the site at HELPER (root:slurm-geo 4750, as `slurm-geo site install` does at home), which
drops to the owner and runs the root's /usr/bin/sbatch. No `sbatch --uid`.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

from slurm_geo.errors import SandboxError
from slurm_geo.sandbox import provider, rootfs
from slurm_geo.sandbox import provider_render as render
from slurm_geo.sandbox.provider_render import Account
from slurm_geo.site import SUBMIT_AS_SOURCE
from slurm_geo.slurm.cli_backend import CliSlurmClient

CLUSTER = "home24"
# Home's users at home's uids (sandbox.users: alice 2001, bob 2002).
ACCOUNTS = (Account("alice", 2001, "alice"), Account("bob", 2002, "bob"))
SLURM_CONF = render.SLURM_ETC / "slurm.conf"  # inside the site
HELPER = Path("/var/lib/slurm/libexec/submit-as")  # inside the site
SBATCH = "/usr/bin/sbatch"  # the root's
HELPER_SOURCE = SUBMIT_AS_SOURCE
HELPER_CFLAGS = ("-O2", "-Wall", "-Wextra", "-Werror", "-std=gnu11", "-fPIE", "-pie")


def site(root: Path, port_base: int) -> provider.ProviderSite:
    return provider.ProviderSite(root=root, port_base=port_base, cluster=CLUSTER,
                                 image=rootfs.HOME_2411_IMAGE_DIR, recipe=rootfs.HOME_2411,
                                 accounts=ACCOUNTS, accounting=True, rest=False,
                                 # two slurmds: sinfo groups nodes alike (parse.nodes)
                                 node_ports=(port_base + 1, port_base + 5))


def up(home: provider.ProviderSite,
       progress: Callable[[str], None] = lambda _line: None) -> dict:
    """The site up (its image built first if need be) and the helper installed in it.
    Returns the image's stamp. Needs root and a C compiler."""
    stamp = provider.up(home, progress)
    install_helper(home)
    return stamp


def install_helper(home: provider.ProviderSite) -> Path:
    """slurm-geo-submit-as, built for the site (its sbatch, its service group), at HELPER
    inside it: root's, setuid, runnable by the service account's group only."""
    target = home.dirs.var / HELPER.relative_to("/var/lib/slurm")
    target.parent.mkdir(mode=0o755, exist_ok=True)
    building = target.with_name(".submit-as.new")
    done = subprocess.run(
        ["cc", *HELPER_CFLAGS, f'-DSBATCH_PATH="{SBATCH}"',
         f'-DSERVICE_GROUP="{render.SERVICE_ACCOUNT.name}"', "-o", str(building),
         str(HELPER_SOURCE)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SandboxError(f"building {HELPER_SOURCE} failed: {done.stderr.strip()[-300:]}")
    os.chown(building, 0, render.SERVICE_ACCOUNT.uid)
    building.chmod(0o4750)  # after chown, which clears the setuid bit
    building.rename(target)
    return target


def command_prefix(home: provider.ProviderSite, as_root: bool = False) -> list[str]:
    """What runs a command inside the site as its service account (or as root)."""
    account = render.SERVICE_ACCOUNT.name
    drop = [] if as_root else ["/usr/bin/setpriv", f"--reuid={account}",
                               f"--regid={account}", "--init-groups"]
    return ["/usr/bin/nsenter", *home.enter()[1:], *drop]


def client(home: provider.ProviderSite, timeout_s: float = 20,
           as_root: bool = False) -> CliSlurmClient:
    """The CLI backend for the site, its commands the root's (24.11)."""
    return CliSlurmClient(CLUSTER, SLURM_CONF, timeout_s, submit_as=HELPER,
                          command_prefix=command_prefix(home, as_root), sbatch=SBATCH)
