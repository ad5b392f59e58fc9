"""The sandbox's rented cluster when it is the provider's machine (`sandbox up
--remote-slurm provider`): sandbox.provider's stock Slurm 26.05, on a root filesystem of
its own, in the remote network namespace at the remote site's address and the ports the
layout gives rented; its slurmrestd on a unix socket of the site's, behind the sandbox's
TLS relay (stages); its own MariaDB and slurmdbd. Nothing of home's disk is there, and its
slurm.conf names no file of slurm-geo's.

`host` is the older remote site: Debian's Slurm from the host's disk, with slurm-geo's
plugins (sandbox.render); a sandbox made before `--remote-slurm` existed keeps it. The
drill and the chaos harness read a moved job's outputs at the provider (operator_path)
until they come home (issue 31).

The federation daemon reaches the provider as its tenants' service account
(provider_render.SERVICE_ACCOUNT, a Slurm operator there), and submits each sandbox user's
jobs as their account there (geo-alice, geo-bob), with JWTs the provider's slurmctld mints:
written where the site config names them, the service account's, mode 0600.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from slurm_geo.atomic import write_if_changed
from slurm_geo.errors import SandboxError
from slurm_geo.sandbox import provider, rootfs, users
from slurm_geo.sandbox import provider_render as prender
from slurm_geo.sandbox.layout import REST_USER, SandboxLayout
from slurm_geo.sandbox.provider import ProviderSite
from slurm_geo.sandbox.provider_render import ACCOUNTS, Account, Ports
from slurm_geo.slurm import admin
from slurm_geo.slurm.errors import SlurmError

HOST, PROVIDER = "host", "provider"
REMOTE_SLURM = (HOST, PROVIDER)
DEFAULT_REMOTE_SLURM = PROVIDER  # a sandbox made before the option keeps host
# REST_USER's JWT on the rented cluster: short-lived, as alice's and bob's; every `up`
# mints it again (docs/sandbox.md).
TOKEN_LIFESPAN_S = 24 * 3600


def is_provider(layout: SandboxLayout) -> bool:
    return layout.remote_slurm == PROVIDER


def site(layout: SandboxLayout) -> ProviderSite:
    """The provider's site of this sandbox: under its directory, at rented's address and
    ports, in the remote namespace; slurmrestd on a unix socket, accounting kept."""
    rented = layout.rented
    base = layout.port_base
    ports = Ports(ctld=rented.ctld_port, slurmd=rented.node_ports[0], restd=base + 24,
                  dbd=rented.dbd_port, mariadb=base + 26)
    return ProviderSite(layout.provider_dir, base, address=rented.address,
                        netns=rented.namespace, cluster=rented.name, fixed_ports=ports,
                        node_ports=rented.node_ports, rest_socket=True, accounting=True,
                        image=rootfs.provider_image_dir())


def account_for(home_user: str) -> Account:
    """The provider's account of a sandbox user."""
    return next(account for account in ACCOUNTS if account.home_user == home_user)


def work_dir(home_user: str) -> Path:
    """Where that user's moved jobs run at the provider: their account's home there."""
    return account_for(home_user).home


def up(layout: SandboxLayout, owner: tuple[int, int],
       progress: Callable[[str], None] = lambda _line: None) -> None:
    """The provider's site up (its image built first if missing), and the JWTs the
    federation daemon uses there written as `owner`'s (the service account's)."""
    where = site(layout)
    stamp = provider.up(where, progress=progress)
    progress(f"the provider's Slurm {stamp.get('slurm_version', '?')} is up at "
             f"{where.address} (its own root, {where.root})")
    write_tokens(layout, owner)


def write_rented_tokens(layout: SandboxLayout, owner: tuple[int, int]) -> None:
    """The tokens the federation daemon reads, its account's from the start: a running
    daemon never meets one it cannot read."""
    rented = layout.rented
    if is_provider(layout):  # the provider minted them at its up
        write_tokens(layout, owner)
        return
    try:
        token = admin.issue_token(rented.slurm_conf, REST_USER, TOKEN_LIFESPAN_S)
    except SlurmError as exc:
        raise SandboxError(f"cannot issue a JWT for {rented.name}: {exc}") from None
    write_if_changed(rented.token_file, token + "\n", 0o600, owner)
    users.mint_tokens(rented, owner)


def write_tokens(layout: SandboxLayout, owner: tuple[int, int]) -> None:
    """The provider's tokens where the site config names them, `owner`'s."""
    where, rented = site(layout), layout.rented
    service = where.token_file(prender.SERVICE_ACCOUNT.name)
    write_if_changed(rented.token_file, service.read_text(), 0o600, owner)
    rented.user_token_file("").parent.mkdir(mode=0o700, exist_ok=True)
    for account in ACCOUNTS:
        write_if_changed(rented.user_token_file(account.home_user),
                         where.token_file(account.name).read_text(), 0o600, owner)


def down(layout: SandboxLayout) -> None:
    """Its daemons and jobs stopped, its namespaces unmounted (nothing if never up)."""
    if layout.provider_dir.exists():
        provider.down(site(layout))


def daemon_states(layout: SandboxLayout) -> list[tuple[str, bool, int | None, str]]:
    """(name, up, pid, where) of each of the provider's daemons, for `sandbox status`."""
    where = site(layout)
    rows = []
    for daemon in where.daemons():
        pid = where.table.running_pid(daemon.name)
        check = daemon.health_check
        up = pid is not None and check is not None and check()
        name = daemon.name if daemon.name.startswith(f"{where.cluster}-") \
            else f"{where.cluster}-{daemon.name}"
        rows.append((name, up, pid, f"provider {where.root}"))
    return rows


def provider_daemon(layout: SandboxLayout, name: str) -> str | None:
    """The provider's own name of the sandbox daemon `name` ("rented-slurmctld" is its
    "slurmctld"; nodes keep theirs), None when the provider does not run it."""
    if not is_provider(layout):
        return None
    names = site(layout).daemon_names
    inner = name if name in names else name.removeprefix(f"{layout.rented.name}-")
    return inner if inner in names else None


def running_pid(layout: SandboxLayout, name: str) -> int | None:
    inner = provider_daemon(layout, name)
    return None if inner is None else site(layout).table.running_pid(inner)


def stop_daemon(layout: SandboxLayout, name: str) -> None:
    """Stop one of the provider's daemons (a test's outage); `up` starts it again."""
    inner = provider_daemon(layout, name)
    if inner is not None:
        site(layout).table.stop(inner)


def scontrol(layout: SandboxLayout, args: list[str]) -> None:
    """An operator's `scontrol` at the provider (root there: the drill's own hand)."""
    provider.exec_in(site(layout), admin.scontrol_argv(*args))


def admin_output(layout: SandboxLayout, argv: list[str]) -> str:
    """What one of the provider's admin commands prints (sacct, scontrol), run there as
    root: its own hand, as a test's oracle."""
    return provider.exec_in(site(layout), argv).stdout


def issue_token(layout: SandboxLayout, user: str, lifespan_s: int) -> str:
    """A JWT for `user` from the provider's slurmctld (a test's expired token)."""
    printed = admin_output(layout, admin.token_argv(user, lifespan_s))
    return printed.strip().removeprefix("SLURM_JWT=")


def operator_path(layout: SandboxLayout, home_user: str, inside: Path) -> Path:
    """A path inside the provider's site, for a user's files there, as the sandbox's
    operator reads it from the host (a test oracle; bringing outputs home is the
    federation's, issue 31)."""
    home = work_dir(home_user)
    return site(layout).home_of(account_for(home_user).name) / inside.relative_to(home)
