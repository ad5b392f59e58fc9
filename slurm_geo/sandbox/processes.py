"""Start daemons detached, track them by pid file, and stop exactly what was started.

A pid file holds the daemon's pid and its start time, which together survive pid reuse
and the execs of the daemon's command (nsenter, setpriv, the daemon). Everything our
daemons spawn (slurmstepd and job steps) carries the sandbox's marker in its environment,
so `stop_all` never has to look processes up by name. The marker alone cannot name a
daemon: while a process execs, its /proc environ reads empty or as its parent's (seen
about once in 3,000 reads), and a daemon just started read as one already dead.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil

MARKER_ENV = "SLURM_GEO_SANDBOX"


@dataclass(frozen=True)
class Daemon:
    """A long-running process of the sandbox and how to tell it is ready: the port it
    answers on at `host`, from the machine's namespace, a path it creates, or its
    `health_check` saying so (etcd's: its /health says it serves). With a `namespace` it
    runs in that network namespace (a site's). `url`, if any, is what clients name it
    by, which `status` shows."""

    name: str
    argv: list[str]
    env: Mapping[str, str] = field(default_factory=dict)
    user: str | None = None
    group: str | None = None
    port: int | None = None
    ready_path: Path | None = None
    extra_ports: tuple[int, ...] = ()  # others it listens on, checked free before it starts
    namespace: str | None = None
    host: str = "127.0.0.1"
    health_check: Callable[[], bool] | None = None
    url: str | None = None
    # Capabilities it keeps after dropping to `user` (setpriv's ambient set), e.g.
    # ("dac_read_search",) for checkpoint-sync; none else.
    capabilities: tuple[str, ...] = ()
    # A directory mounted over /tmp for it alone (systemd's PrivateTmp), in a mount
    # namespace of its own: where a daemon makes fixed names in /tmp (SeaweedFS's unix
    # sockets), no other account can take, block or reach them. Only with a namespace.
    private_tmp: Path | None = None

    @property
    def command(self) -> list[str]:
        """What is run: `nsenter` joins the namespace (as root: it needs the privilege)
        and execs, then `setpriv` drops to the daemon's user; each execs the next, so the
        pid the pid file records is the daemon's. Not `ip netns exec`, which also mounts
        a sysfs of its own over /sys, hiding /sys/fs/cgroup from slurmd. With a
        `private_tmp`, `unshare` and a fixed `sh` script (root's, naming no path the
        daemon's user controls but the directory itself) bind it over /tmp, then exec on."""
        if self.namespace is None:  # ProcessTable.start drops to `user` itself
            if self.private_tmp is not None:
                raise ValueError(f"{self.name}: a private /tmp needs a namespace")
            return self.argv
        drop = [] if self.user is None else \
            ["setpriv", "--reuid", self.user, "--regid", self.group or self.user,
             "--clear-groups"]
        if self.user is not None and self.capabilities:
            caps = ",".join(f"+{cap}" for cap in self.capabilities)
            drop += [f"--inh-caps={caps}", f"--ambient-caps={caps}"]
        tmp = [] if self.private_tmp is None else \
            ["unshare", "--mount", "--propagation", "private", "sh", "-c",
             'mount --bind -- "$0" /tmp && exec "$@"', str(self.private_tmp)]
        return ["nsenter", f"--net=/run/netns/{self.namespace}", *tmp, *drop, *self.argv]


class ProcessTable:
    """The pid files of one sandbox, under `run_dir`, with logs under `log_dir`."""

    def __init__(self, root: Path):
        self.root = root
        self.run_dir = root / "run"
        self.log_dir = root / "log"

    def pid_file(self, name: str) -> Path:
        return self.run_dir / f"{name}.pid"

    def log_file(self, name: str) -> Path:
        return self.log_dir / f"{name}.out"

    def running_pid(self, name: str) -> int | None:
        """The pid of daemon `name` if it is alive and ours, else None."""
        try:
            written, *rest = self.pid_file(name).read_text().split()
            pid, started = int(written), [float(value) for value in rest[:1]]
            ticks = [int(value) for value in rest[1:2]]
        except (FileNotFoundError, ValueError):
            return None
        if ticks:  # the kernel's own start time, in ticks since boot: no clock moves it
            return pid if start_ticks(pid) == ticks[0] and self._alive(pid) else None
        if not started:  # a pid file of an older slurm-geo, without the start time
            return pid if self._is_ours(pid) else None
        return pid if _alive_since(pid, started[0]) else None

    def start(self, daemon: Daemon) -> int:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if daemon.ready_path is not None:
            daemon.ready_path.unlink(missing_ok=True)  # a last run's must not read as ready
        env = {**daemon_environment(), **daemon.env, MARKER_ENV: str(self.root)}
        in_site = daemon.namespace is not None  # its command drops privileges itself
        with open(self.log_file(daemon.name), "ab") as log:
            proc = subprocess.Popen(
                daemon.command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                user=None if in_site else daemon.user,
                group=None if in_site else daemon.group,
                extra_groups=[] if daemon.user and not in_site else None,
                cwd=self.root,
            )
        # Our child cannot be reaped before we wait for it, so its start time is there.
        # The wall-clock start is for people; the start in ticks since boot names the process:
        # the wall clock (and with it psutil's create_time) moves when NTP steps it.
        started = psutil.Process(proc.pid).create_time()
        self.pid_file(daemon.name).write_text(
            f"{proc.pid} {started!r} {start_ticks(proc.pid)}\n")
        return proc.pid

    def stop(self, name: str, grace_s: float = 10.0) -> None:
        self.stop_together([name], grace_s)

    def stop_together(self, names: Iterable[str], grace_s: float = 10.0) -> None:
        """SIGTERM the named daemons (and what they spawned) at once; SIGKILL after grace."""
        names = list(names)
        pids = [pid for pid in map(self.running_pid, names) if pid is not None]
        _terminate(_with_descendants(_processes(pids)), grace_s)
        for name in names:
            self.pid_file(name).unlink(missing_ok=True)

    def stop_all(self, groups_in_stop_order: Iterable[list[str]], grace_s: float = 10.0) -> None:
        """Stop each group of daemons in turn, then anything else carrying our marker."""
        for group in groups_in_stop_order:
            self.stop_together(group, grace_s)
        _terminate(_with_descendants(self.marked_processes()), grace_s)

    def marked_processes(self) -> list[psutil.Process]:
        return [proc for proc in psutil.process_iter() if self._is_ours(proc.pid)]

    def _is_ours(self, pid: int) -> bool:
        return self._alive(pid) and has_marker(pid, self.root)

    @staticmethod
    def _alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False


def start_ticks(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (field 22 of /proc/PID/stat):
    fixed for the life of the process, whatever the wall clock does."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or parentheses.
    return int(stat.rsplit(")", 1)[1].split()[19])


def has_marker(pid: int, root: Path) -> bool:
    """Whether process `pid` carries the marker of the sandbox at `root`.

    Reads /proc directly: slurmstepd overwrites the start of its environment with its
    process title, and psutil stops parsing at the first empty entry.
    """
    try:
        entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"{MARKER_ENV}={root}".encode() in entries


def _alive_since(pid: int, started: float) -> bool:
    try:
        proc = psutil.Process(pid)
        # Within a second: the kernel's boot time, which start times count from, is
        # known to move by one now and then.
        return proc.status() != psutil.STATUS_ZOMBIE and abs(proc.create_time() - started) < 1

    except psutil.Error:
        return False


def _processes(pids: Iterable[int]) -> list[psutil.Process]:
    found = []
    for pid in pids:
        try:
            found.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    return found


def _with_descendants(procs: Iterable[psutil.Process]) -> list[psutil.Process]:
    seen: dict[int, psutil.Process] = {}
    for proc in procs:
        try:
            for member in [proc, *proc.children(recursive=True)]:
                seen[member.pid] = member
        except psutil.NoSuchProcess:
            continue
    return list(seen.values())


def _terminate(procs: list[psutil.Process], grace_s: float) -> None:
    for proc in procs:
        _send(proc, signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        _send(proc, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=5)


def _send(proc: psutil.Process, sig: signal.Signals) -> None:
    try:
        proc.send_signal(sig)
    except psutil.NoSuchProcess:
        pass


def port_is_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def wait_until(check: Callable[[], bool], timeout_s: float, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(interval_s)
    return check()


# What a daemon inherits of whoever ran `sandbox up`, as a systemd unit would give it: the
# search path and the locale; nothing else (PWD, a shell's AWS_* or PYTHON* variables).
INHERITED = ("PATH", "LANG", "LC_ALL", "TZ")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def daemon_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment every sandbox daemon starts from (its own `env` is added)."""
    source = os.environ if environ is None else environ
    env = {key: source[key] for key in INHERITED if source.get(key)}
    env.setdefault("PATH", DEFAULT_PATH)
    return env
