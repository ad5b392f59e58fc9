"""Administrative Slurm commands used to provision a cluster (sacctmgr, scontrol token).

Kept apart from the job-facing client: these need the cluster's own slurm.conf and root,
as an admin on that site would have.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from slurm_geo.slurm.errors import SlurmCommandError

_VERSION = re.compile(r"(\d+)\.(\d+)")


def installed_slurm_version() -> tuple[int, int]:
    """(major, minor) of the installed Slurm, e.g. (22, 5) for 22.05.8."""
    out = _run(["slurmctld", "-V"], timeout_s=10).strip()
    match = _VERSION.search(out)
    if not match:
        raise SlurmCommandError("slurmctld -V", f"cannot read a version from {out!r}")
    return int(match.group(1)), int(match.group(2))


def client_slurm_version(slurm_conf: Path | None = None) -> tuple[int, int]:
    """(major, minor) of the Slurm commands of this host (`scontrol -V`, which reads
    `slurm_conf` first): a login or a compute node has no slurmctld, and its sbatch and
    slurmd load the SPANK plugins."""
    out = _run(["scontrol", "-V"], timeout_s=10, slurm_conf=slurm_conf).strip()
    match = _VERSION.search(out)
    if not match:
        raise SlurmCommandError("scontrol -V", f"cannot read a version from {out!r}")
    return int(match.group(1)), int(match.group(2))


def registered_clusters(slurm_conf: Path, timeout_s: float = 20) -> set[str]:
    out = _run(
        ["sacctmgr", "--noheader", "--parsable2", "list", "cluster", "format=cluster"],
        timeout_s,
        slurm_conf,
    )
    return {line for line in out.splitlines() if line}


def register_cluster(slurm_conf: Path, name: str, timeout_s: float = 20) -> None:
    if name not in registered_clusters(slurm_conf, timeout_s):
        _run(["sacctmgr", "-i", "add", "cluster", name], timeout_s, slurm_conf)


def associated_users(slurm_conf: Path, cluster: str, timeout_s: float = 20) -> set[str]:
    out = _run(["sacctmgr", "--noheader", "--parsable2", "show", "assoc", f"cluster={cluster}",
                "format=user"], timeout_s, slurm_conf)
    return {line for line in out.splitlines() if line}


def add_users(slurm_conf: Path, cluster: str, account: str, users: list[str],
              timeout_s: float = 20) -> None:
    """Give each user an association under `account` (created if need be), as a site's
    accounting does: without one, slurmdbd's JSON records name no user for their jobs."""
    missing = sorted(set(users) - associated_users(slurm_conf, cluster, timeout_s))
    if not missing:
        return
    out = _run(["sacctmgr", "--noheader", "--parsable2", "show", "account", account,
                "format=account"], timeout_s, slurm_conf)
    if account not in out.split():
        _run(["sacctmgr", "-i", "add", "account", account, f"cluster={cluster}"],
             timeout_s, slurm_conf)
    _run(["sacctmgr", "-i", "add", "user", ",".join(missing), f"account={account}",
          f"cluster={cluster}"], timeout_s, slurm_conf)


def admin_level(slurm_conf: Path, user: str, timeout_s: float = 20) -> str:
    """`user`'s AdminLevel in the cluster's accounting (None, Operator, Administrator); ""
    when accounting knows no such user."""
    out = _run(["sacctmgr", "--noheader", "--parsable2", "show", "user", user,
                "format=adminlevel"], timeout_s, slurm_conf)
    return out.strip().splitlines()[0] if out.strip() else ""


def set_admin_level(slurm_conf: Path, user: str, level: str, timeout_s: float = 20) -> None:
    """Give `user` Slurm's AdminLevel `level` (None, Operator, Administrator) if it has
    another: an Operator holds, releases, requeues and cancels any job and reads its
    batch script and environment."""
    out = _run(["sacctmgr", "--noheader", "--parsable2", "show", "user", user,
                "format=adminlevel"], timeout_s, slurm_conf)
    if out.strip() != level:
        _run(["sacctmgr", "-i", "modify", "user", user, "set", f"adminlevel={level}"],
             timeout_s, slurm_conf)


def issue_token(slurm_conf: Path, username: str, lifespan_s: int, timeout_s: float = 20) -> str:
    """A JWT for `username` from the cluster's slurmctld (needs root or SlurmUser)."""
    out = _run(token_argv(username, lifespan_s), timeout_s, slurm_conf)
    match = re.search(r"SLURM_JWT=(\S+)", out)
    if not match:
        raise SlurmCommandError("scontrol token", f"no SLURM_JWT in output {out!r}")
    return match.group(1)


def _run(argv: list[str], timeout_s: float, slurm_conf: Path | None = None) -> str:
    env = {**os.environ, "SLURM_CONF": str(slurm_conf)} if slurm_conf else None
    try:
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout_s, env=env, check=False
        )
    except subprocess.TimeoutExpired:
        raise SlurmCommandError(" ".join(argv[:3]), f"no answer within {timeout_s:g} s") from None
    except FileNotFoundError:
        raise SlurmCommandError(argv[0], "not found; install Slurm's client tools") from None
    if proc.returncode != 0:
        raise SlurmCommandError(" ".join(argv[:3]), (proc.stderr or proc.stdout).strip())
    return proc.stdout


def reconfigure(slurm_conf: Path, timeout_s: float = 30) -> None:
    """`scontrol reconfigure`: slurmctld and every slurmd read slurm.conf again."""
    _run(["scontrol", "reconfigure"], timeout_s, slurm_conf)


def drain_node(slurm_conf: Path, node: str, reason: str, timeout_s: float = 20) -> None:
    """Take no new job on `node` (its running jobs go on): a site with fewer nodes free."""
    _run(["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"],
         timeout_s, slurm_conf)


def resume_node(slurm_conf: Path, node: str, timeout_s: float = 20) -> None:
    _run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], timeout_s, slurm_conf)


# --- the same commands for a site reached another way ---------------------------------
# The sandbox's provider site runs its Slurm in its own namespaces: its administration
# (sandbox.provider, sandbox.remote_site) runs these there, as that site's root.

def scontrol_argv(*args: str) -> list[str]:
    """An operator's `scontrol ARGS...` (`update NodeName=... State=DRAIN`, ...)."""
    return ["scontrol", *args]


def ping_argv() -> list[str]:
    """`scontrol ping`: prints "UP" for a controller that answers."""
    return scontrol_argv("ping")


def token_argv(username: str, lifespan_s: int) -> list[str]:
    """`scontrol token`: prints SLURM_JWT=... for `username` (root or SlurmUser only)."""
    return scontrol_argv("token", f"username={username}", f"lifespan={lifespan_s}")


def node_state_argv(node: str) -> list[str]:
    """`sinfo`: one node's state(s), one word each ("idle", "down*", ...)."""
    return ["sinfo", "-h", "-n", node, "-o", "%T"]


def list_users_argv() -> list[str]:
    """`sacctmgr`: the users the accounting knows, one a line."""
    return ["sacctmgr", "-n", "-P", "list", "user", "format=user"]


def sacctmgr_change_argv(*args: str) -> list[str]:
    """`sacctmgr -i ARGS...`: a change to the accounting, without asking to confirm."""
    return ["sacctmgr", "-i", *args]
