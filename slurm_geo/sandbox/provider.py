"""The rented provider's site: a stock Slurm of today on a machine of its own.

Its slurmctld, slurmd and slurmrestd run from the image of sandbox.rootfs (Debian's
newest Slurm, 26.05) in a mount and UTS namespace of their own, and in a network namespace
when given one (a sandbox site's). Nothing of the host's disk is visible there but the
host's Python, read-only (provider_render.PYTHON_BINDS says why); the site's /home, /tmp,
/scratch, state and logs are directories under `root` on the host, bound in.

The mount namespace outlives its processes: it is kept by a bind mount of its nsfs file
(`unshare --mount=FILE`), under a private mount of `root/ns`, so every daemon and every
command `exec_in` runs enter the same site. `down` stops the daemons and unmounts both, and
the namespace goes with its last process.

The REST API is plain http on `address`:`ports.restd`, or on a unix socket of the site's
(`rest_socket`: a TLS proxy of the provider's in front of it), with JWTs minted by
slurmctld (`scontrol token`) for the tenants' accounts (provider_render.ACCOUNTS) and their
service account. With `accounting` the site keeps its own: a MariaDB and slurmdbd in the
root, the service account a Slurm operator there.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from slurm_geo.atomic import write_if_changed
from slurm_geo.errors import SandboxError
from slurm_geo.sandbox import provider_render as render
from slurm_geo.sandbox import rootfs
from slurm_geo.sandbox.processes import Daemon, ProcessTable, wait_until
from slurm_geo.sandbox.provider_render import ACCOUNTS, Account, Ports, SiteDirs
from slurm_geo.slurm import admin

COMMAND_TIMEOUT_S = 30
START_TIMEOUT_S = 60
TOKEN_LIFESPAN_S = 24 * 3600
DB_DAEMONS = ("mariadb", "slurmdbd")  # with accounting, before the others


@dataclass(frozen=True)
class ProviderSite:
    """One provider site: its directory on the host, ports, address and network."""

    root: Path
    port_base: int
    address: str = "127.0.0.1"
    netns: str | None = None  # a sandbox site's network namespace, else the host's
    cluster: str = "provider"
    image: Path = rootfs.IMAGE_DIR
    fixed_ports: Ports | None = None  # else from port_base
    node_ports: tuple[int, ...] = ()  # a slurmd on each; none: one at ports.slurmd
    rest_socket: bool = False  # slurmrestd on a unix socket (host path: restd_socket)
    accounting: bool = False  # MariaDB and slurmdbd in the root
    # The image's recipe (a home cluster of Slurm 24.11: rootfs.HOME_2411), the site's
    # users (their own ids), and whether it serves REST (a home cluster reached by CLI not).
    recipe: rootfs.Recipe = rootfs.Recipe()
    accounts: tuple[Account, ...] = ACCOUNTS
    rest: bool = True

    @property
    def ports(self) -> Ports:
        return self.fixed_ports or Ports.from_base(self.port_base)

    @property
    def node(self) -> str:
        return f"{self.cluster}-n1"

    @property
    def nodes(self) -> tuple[tuple[str, int], ...]:
        """(name, slurmd port) of each node: slurmds of one machine."""
        if not self.node_ports:
            return ((self.node, self.ports.slurmd),)
        return tuple((f"{self.cluster}-n{i}", port)
                     for i, port in enumerate(self.node_ports, start=1))

    @property
    def restd_socket(self) -> Path:
        """slurmrestd's unix socket (rest_socket), as the host sees it."""
        return self.dirs.var / render.RESTD_SOCKET.relative_to("/var/lib/slurm")

    def home_of(self, account: str) -> Path:
        """An account's home inside the site, as the host sees it (the operator's view)."""
        return self.dirs.home / account

    @property
    def rest_url(self) -> str:
        return f"http://{self.address}:{self.ports.restd}"

    @property
    def dirs(self) -> SiteDirs:
        r = self.root
        return SiteDirs(self.image, r / "mnt", r / "etc", r / "var", r / "log", r / "home",
                        r / "tmp", r / "scratch", r / "accounts")

    @property
    def ns_dir(self) -> Path:
        return self.root / "ns"

    @property
    def mount_ns(self) -> Path:
        return self.ns_dir / "mnt"

    @property
    def uts_ns(self) -> Path:
        return self.ns_dir / "uts"

    @property
    def table(self) -> ProcessTable:
        return ProcessTable(self.root / "host")

    def token_file(self, account: str) -> Path:
        return self.root / "tokens" / f"{account}.jwt"

    def enter(self) -> list[str]:
        """The command prefix that runs what follows inside the site (as root)."""
        net = [f"--net=/run/netns/{self.netns}"] if self.netns else []
        return ["nsenter", f"--mount={self.mount_ns}", f"--uts={self.uts_ns}", *net, "--"]

    @property
    def daemon_names(self) -> list[str]:
        """In start order."""
        return [daemon.name for daemon in self.daemons()]

    def daemons(self) -> list[Daemon]:
        inside = self.enter()
        ports = self.ports
        listen = (f"unix:{render.RESTD_SOCKET}" if self.rest_socket
                  else f"{self.address}:{ports.restd}")
        restd = [*inside, "/usr/sbin/slurmrestd", "-a", "rest_auth/jwt",
                 "-u", render.RESTD_USER[0], "-g", render.RESTD_USER[0], listen]
        database = [
            Daemon("mariadb", [*inside, "/usr/sbin/mariadbd", "--no-defaults",
                               f"--datadir={render.MYSQL_DATA}",
                               f"--socket={render.MYSQL_SOCKET}", "--skip-networking",
                               f"--user={render.MYSQL_USER}",
                               f"--pid-file={render.MYSQL_SOCKET.parent}/mariadbd.pid",
                               f"--log-error={render.MYSQL_DATA}/error.log",
                               "--innodb-buffer-pool-size=32M"],
                   health_check=lambda: self._answers(
                       ["mariadb-admin", "--no-defaults", f"--socket={render.MYSQL_SOCKET}",
                        "ping"], "alive")),
            Daemon("slurmdbd", [*inside, "/usr/sbin/slurmdbd", "-D"],
                   health_check=lambda: self._port_open(ports.dbd)),
        ] if self.accounting else []
        rest_up = ((lambda: self.restd_socket.exists()) if self.rest_socket
                   else (lambda: self._port_open(ports.restd)))
        rest = [Daemon("slurmrestd", restd, env={"SLURM_JWT": "daemon"},
                       health_check=rest_up)] if self.rest else []
        return [
            *database,
            Daemon("slurmctld", [*inside, "/usr/sbin/slurmctld", "-D"],
                   health_check=lambda: self._answers(admin.ping_argv(), "UP")),
            *(Daemon(name, [*inside, "/usr/sbin/slurmd", "-D", "-N", name],
                     health_check=lambda name=name: self._node_up(name))  # type: ignore[misc]
              for name, _port in self.nodes),
            # SLURM_JWT=daemon (above): slurmrestd passes each request's JWT on to
            # slurmctld as its credential (auth/jwt), not its own (auth/slurm: "Rejecting
            # thread config token").
            *rest,
        ]

    # --- checks run inside -------------------------------------------------------------

    def _answers(self, argv: list[str], needle: str) -> bool:
        done = exec_in(self, argv, check=False)
        return done.returncode == 0 and needle in done.stdout

    def _node_up(self, node: str) -> bool:
        done = exec_in(self, admin.node_state_argv(node), check=False)
        return done.returncode == 0 and any(
            state.rstrip("*") in {"idle", "mixed", "allocated", "drained", "draining"}
            for state in done.stdout.split())

    def _port_open(self, port: int) -> bool:
        probe = f"exec 3<>/dev/tcp/{self.address}/{port}"
        return exec_in(self, ["bash", "-c", probe], check=False).returncode == 0


def exec_in(site: ProviderSite, argv: list[str], *, user: str | None = None,
            check: bool = True, timeout_s: float = COMMAND_TIMEOUT_S,
            input_text: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run `argv` inside the site, as root or as the site's account `user`."""
    drop = [] if user is None else ["setpriv", f"--reuid={user}", f"--regid={user}",
                                    "--init-groups", "--reset-env"]
    try:
        done = subprocess.run([*site.enter(), *drop, *argv], capture_output=True, text=True,
                              timeout=timeout_s, input=input_text, check=False,
                              env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"})
    except subprocess.TimeoutExpired:
        raise SandboxError(f"{' '.join(argv)} in the provider site timed out after "
                           f"{timeout_s:g} s") from None
    if check and done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-2:]
        raise SandboxError(f"{' '.join(argv)} in the provider site failed (exit "
                           f"{done.returncode}): {' | '.join(tail)}")
    return done


# --- up and down ---------------------------------------------------------------------------


def up(site: ProviderSite, progress: Callable[[str], None] = lambda _line: None) -> dict:
    """Build the image if needed, lay out the site, start its daemons, mint the tenants'
    tokens. Returns the image's stamp. Needs root."""
    if os.geteuid() != 0:
        raise SandboxError("the provider site needs root (namespaces, mounts): run as root")
    stamp = rootfs.ensure_image(site.image, site.recipe, progress=progress)
    prepare(site)
    if not namespace_alive(site):
        make_namespace(site)
    table = site.table
    for daemon in site.daemons():
        if table.running_pid(daemon.name) is not None:
            continue
        if daemon.name == "mariadb":
            _init_database(site)
        if daemon.name == "slurmdbd":  # its run directory, on the site's own /run
            exec_in(site, ["install", "-d", "-o", render.SLURM_USER[0], "-g",
                           render.SLURM_USER[0], "/run/slurmdbd"])
            # trixie's MariaDB client library looks for the server's socket under
            # /run/mysqld, sid's under /run/mariadbd (slurmdbd.conf cannot name it).
            exec_in(site, ["ln", "-sfn", str(render.MYSQL_SOCKET.parent), "/run/mysqld"])
        table.start(daemon)
        check = daemon.health_check
        assert check is not None
        if not wait_until(check, START_TIMEOUT_S, interval_s=0.5):
            raise SandboxError(f"the provider's {daemon.name} did not come up in "
                               f"{START_TIMEOUT_S} s; see {table.log_file(daemon.name)} and "
                               f"{site.dirs.log}")
        if daemon.name == "mariadb":
            exec_in(site, ["mariadb", "--no-defaults", f"--socket={render.MYSQL_SOCKET}",
                           "-u", "root", "-e", render.database_sql()])
        if daemon.name == "slurmdbd":
            _register(site)
    for account in (*site.accounts, render.SERVICE_ACCOUNT) if site.rest else ():
        mint_token(site, account)
    return stamp


def down(site: ProviderSite) -> None:
    """Stop the site's daemons (and the jobs they run), then unmount its namespaces."""
    site.table.stop_all([[name] for name in reversed(site.daemon_names)])
    for path in (site.mount_ns, site.uts_ns, site.ns_dir):
        if _mounted(path):
            _host(["umount", str(path)], f"unmount {path}")


def _init_database(site: ProviderSite) -> None:
    """MariaDB's system tables in the site's data directory, once; its socket's dir."""
    exec_in(site, ["install", "-d", "-o", render.MYSQL_USER, "-g", render.MYSQL_USER,
                   str(render.MYSQL_SOCKET.parent)])
    if (site.dirs.var / "mysql" / "mysql").is_dir():
        return
    exec_in(site, ["install", "-d", "-m", "0700", "-o", render.MYSQL_USER, "-g",
                   render.MYSQL_USER, str(render.MYSQL_DATA)])
    exec_in(site, ["mariadb-install-db", "--no-defaults", f"--datadir={render.MYSQL_DATA}",
                   f"--user={render.MYSQL_USER}", "--auth-root-authentication-method=socket",
                   "--skip-test-db"], timeout_s=120)


def _register(site: ProviderSite) -> None:
    """The cluster, an account, the tenants' users and their service account (a Slurm
    operator: it may cancel, hold and requeue its tenants' jobs) in slurmdbd, once."""
    listed = exec_in(site, admin.list_users_argv()).stdout
    if render.SERVICE_ACCOUNT.name in listed.split():
        return
    sacctmgr = admin.sacctmgr_change_argv
    exec_in(site, sacctmgr("add", "cluster", site.cluster), check=False)
    exec_in(site, sacctmgr("add", "account", "tenants", f"cluster={site.cluster}"),
            check=False)
    names = ",".join(a.name for a in (*site.accounts, render.SERVICE_ACCOUNT))
    exec_in(site, sacctmgr("add", "user", names, "account=tenants",
                           f"cluster={site.cluster}"))
    exec_in(site, sacctmgr("modify", "user", render.SERVICE_ACCOUNT.name, "set",
                           "adminlevel=operator"))


def namespace_alive(site: ProviderSite) -> bool:
    return _mounted(site.mount_ns) and _mounted(site.uts_ns)


def make_namespace(site: ProviderSite) -> None:
    site.ns_dir.mkdir(parents=True, exist_ok=True)
    if not _mounted(site.ns_dir):  # nsfs files may only be bound under a private one
        _host(["mount", "--bind", str(site.ns_dir), str(site.ns_dir)], "bind the ns dir")
        _host(["mount", "--make-private", str(site.ns_dir)], "make the ns dir private")
    for path in (site.mount_ns, site.uts_ns):
        if _mounted(path):
            _host(["umount", str(path)], f"unmount a stale {path}")
        path.touch()
    site.dirs.mnt.mkdir(exist_ok=True)
    _host(["unshare", f"--mount={site.mount_ns}", f"--uts={site.uts_ns}",
           "--propagation", "private", "/bin/sh", "-c", render.setup_script(site.dirs)],
          "lay out the provider site's filesystem")


def prepare(site: ProviderSite) -> None:
    """The site's directories and files on the host: config, keys, accounts, homes."""
    d = site.dirs
    slurm_uid = render.SLURM_USER[1]
    for path, mode, owner in [(site.root, 0o755, 0), (d.etc, 0o755, 0), (d.var, 0o755, 0),
                              (d.var / "slurmctld", 0o700, slurm_uid),
                              (d.var / "slurmd", 0o755, 0), (d.log, 0o755, slurm_uid),
                              (site.restd_socket.parent, 0o755, render.RESTD_USER[1]),
                              (d.home, 0o755, 0), (d.tmp, 0o1777, 0),
                              (d.scratch, 0o1777, 0), (d.accounts, 0o755, 0), (d.mnt, 0o755, 0),
                              (site.root / "tokens", 0o700, 0)]:
        path.mkdir(parents=True, exist_ok=True)
        os.chown(path, owner, owner)
        path.chmod(mode)
    for account in site.accounts:
        home = d.home / account.name
        home.mkdir(exist_ok=True)
        os.chown(home, account.uid, account.uid)
        home.chmod(0o700)
    image_etc = site.image / "etc"
    write_if_changed(d.accounts / "passwd", render.passwd((image_etc / "passwd").read_text(),
                                                           site.accounts))
    write_if_changed(d.accounts / "group", render.group((image_etc / "group").read_text(),
                                                         site.accounts))
    write_if_changed(d.accounts / "hosts", render.hosts(site.address))
    write_if_changed(d.accounts / "hostname", render.HOSTNAME + "\n")
    write_if_changed(d.etc / "slurm.conf",
                     render.slurm_conf(site.cluster, site.address, site.ports, site.nodes,
                                       site.accounting))
    if site.accounting:
        write_if_changed(d.etc / "slurmdbd.conf", render.slurmdbd_conf(site.address,
                                                                       site.ports),
                         0o600, (slurm_uid, slurm_uid))
    for key in (d.etc / "slurm.key", d.etc / "jwt.key"):
        if not key.exists():
            write_if_changed(key, secrets.token_bytes(64), 0o600, (slurm_uid, slurm_uid))


def mint_token(site: ProviderSite, account: Account) -> Path:
    """A fresh JWT for `account`, from the site's slurmctld, into its token file (0600,
    root's: whoever uses it gets a copy of their own)."""
    done = exec_in(site, admin.token_argv(account.name, TOKEN_LIFESPAN_S))
    found = re.search(r"SLURM_JWT=(\S+)", done.stdout)
    if not found:
        raise SandboxError(f"scontrol token for {account.name} in the provider site printed "
                           "no SLURM_JWT")
    path = site.token_file(account.name)
    write_if_changed(path, found.group(1) + "\n", 0o600)
    return path


def _mounted(path: Path) -> bool:
    """Whether something is mounted at `path` here (a bind of a directory onto itself
    included, which os.path.ismount cannot see)."""
    with open("/proc/self/mountinfo") as handle:
        points = {_unescape(line.split()[4]) for line in handle}
    return str(path) in points


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _host(argv: list[str], what: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False,
                          timeout=COMMAND_TIMEOUT_S)
    if done.returncode != 0:
        raise SandboxError(f"{what} failed: {(done.stderr or done.stdout).strip()}")
