"""What a drill takes away (`--lose`), and how it watches the federation meanwhile.

- `cluster`: home's controller, nodes and job are SIGKILLed; everything else stays.
- `site`: the whole home site: its WAN links are cut first (nothing there says goodbye),
  then every process of the sandbox running in it is SIGKILLed (onprem's controller,
  slurmdbd and nodes, the job, checkpoint-sync, the home federation replica, home's etcd
  member). MUNGE and MariaDB stay: they run in the login host's namespace, standing for
  each site's own. The drill then watches from the control site, as the organisation's
  on-call would from its DR room: the login host is at home and reaches no other site
  while home is cut off (sandbox.sites).
- `leader`: home's cluster, as for `cluster`, and then the leading federation replica,
  in the middle of the move it decided, so that its successor finishes it.

`site` and `leader` need a replicated sandbox (`sandbox up --replicated`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import psutil

from slurm_geo.config.model import SiteConfig
from slurm_geo.federation.state.audit import AuditLog, Entry
from slurm_geo.federation.state.interface import Audit
from slurm_geo.sandbox import Sandbox, netns, stages
from slurm_geo.sandbox.layout import REPLICA_NAMES
from slurm_geo.sandbox.sites import Site

LOSSES = ("cluster", "site", "leader")
ALONE = "federation"  # the leader of a federation of one daemon (no [[federation.replicas]])
ETCD_PATIENCE_S = 15.0  # an election after a member's loss takes about 1 s; a quorum back
_CLONE_NEWNET = 0x40000000


class FederationView:
    """What the drill reads of the federation: the audit log, the state, and who leads;
    from SQLite for a daemon alone, else from etcd (read-only: a person's view)."""

    def __init__(self, site: SiteConfig):
        from slurm_geo.federation.state.open import federation_config, open_replicas_to_read

        config = federation_config(site)
        self.replicated = config.replicated
        if not self.replicated:
            self.audit: Audit = AuditLog(config.audit_path, readonly=True)
            self._state: Any = None  # the etcd state, whose kv names the leader
            self._config = config
            return
        opened = open_replicas_to_read(config, os.environ)
        self.audit, self._state, self._config = opened.audit, opened.state, config

    def entries(self, logical_job: str | None = None) -> list[Entry]:
        """The audit log's entries (only `logical_job`'s, when given). etcd electing a
        leader of its own, or a member cut off, is waited out for up to ETCD_PATIENCE_S:
        the drill strikes exactly such losses."""
        if not self.replicated:
            return self.audit.entries(logical_job=logical_job)
        from slurm_geo.federation.model import StateUnavailable

        deadline = time.monotonic() + ETCD_PATIENCE_S
        while True:
            try:
                return self.audit.entries(logical_job=logical_job)
            except StateUnavailable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def leader(self) -> str | None:
        """The name of the replica that leads now, as etcd says (None: nobody; for a
        daemon alone, itself, named ALONE: it has no replica name, and "" would read as
        nobody to the drill's waits)."""
        if not self.replicated:
            return self._config.this_replica.name or ALONE
        from slurm_geo.federation.model import StateUnavailable
        from slurm_geo.federation.state.etcd.layout import Layout
        from slurm_geo.federation.state.etcd.leadership import replica_from_json

        try:
            found = self._state.kv.get(Layout(self._config.etcd_prefix).leader)
        except StateUnavailable:
            return None
        return None if found is None else replica_from_json(found.value).name

    def leading_replica(self, besides: str | None) -> str | None:
        """The first replica other than `besides` that says (GET /v1/leader) it leads
        now: what its jobs and peers see, the moment it can act."""
        import ssl

        from slurm_geo.federation.operator.replication import ask_replica

        ca = self._config.ca_file
        tls = ssl.create_default_context(cafile=None if ca is None else str(ca))
        for replica in self._config.replicas:
            if replica.name != besides and ask_replica(replica.name, replica.site,
                                                       replica.url, tls).leading:
                return replica.name
        return None

    def bandwidth_snapshot(self) -> Any:
        return self._read(lambda state: state.bandwidth_snapshot())

    def health(self) -> Any:
        """Each cluster's health as the federation last recorded it."""
        return self._read(lambda state: state.health())

    def _read(self, what: Any) -> Any:
        if self.replicated:
            return what(self._state)
        from slurm_geo.federation.state.sqlite import FederationState

        state = FederationState(self._config.state, readonly=True)
        try:
            return what(state)
        finally:
            state.close()

    def verify_audit(self) -> bool:
        return bool(self.audit.verify().ok)


def site_pids(sandbox: Sandbox, site: Site) -> set[int]:
    """Every process of the sandbox running in `site`: its daemons (found by their pid
    files), the jobs and steps of the clusters there (by their SLURM_CONF), and all they
    spawned."""
    namespace = sandbox.layout.namespace(site)
    daemons = [daemon.name for stage in stages.daemons_by_stage(sandbox.layout, None, {})
               for daemon in stage if daemon.namespace == namespace]
    pids = {pid for pid in map(sandbox.processes.running_pid, daemons) if pid is not None}
    for cluster in sandbox.layout.clusters:
        if cluster.site is site:
            pids |= cluster_processes(sandbox, cluster.name)
    return with_descendants(pids)


def cluster_processes(sandbox: Sandbox, cluster: str) -> set[int]:
    """The processes of the sandbox whose SLURM_CONF is `cluster`'s: its jobs' steps."""
    from slurm_geo.sandbox.processes import has_marker

    conf_path = sandbox.layout.cluster(cluster)
    assert conf_path is not None
    conf = f"SLURM_CONF={conf_path.slurm_conf}".encode()
    found = set()
    for proc in psutil.process_iter():
        try:
            with open(f"/proc/{proc.pid}/environ", "rb") as environ:
                if conf in environ.read() and has_marker(proc.pid, sandbox.layout.root):
                    found.add(proc.pid)
        except OSError:
            continue
    return found


def with_descendants(pids: set[int]) -> set[int]:
    found = set(pids)
    for pid in pids:
        try:
            found.update(child.pid for child in psutil.Process(pid).children(recursive=True))
        except psutil.NoSuchProcess:
            continue
    return found


def lose_site(sandbox: Sandbox, site: Site) -> set[int]:
    """Cut `site` off, then SIGKILL every process of the sandbox in it; their pids."""
    netns.isolate_site(sandbox.layout.topology, site)
    victims = site_pids(sandbox, site)
    signal_pids(victims, signal.SIGKILL)
    return victims


def hand_lead_to(sandbox: Sandbox, view: FederationView, site: Site,
                 wait: Any) -> str | None:
    """Make `site`'s replica the leader, as an operator does by hand: restart the one
    that leads (on SIGTERM it resigns, and the other leads at its next campaign). The
    name of the replica that led before, when it was another; `wait(check, what)` waits."""
    wanted, leader = REPLICA_NAMES[site], view.leader()
    if leader is None or leader == wanted:
        return None
    leading_site = next(s for s, n in REPLICA_NAMES.items() if n == leader)
    sandbox.processes.stop(stages.federation_daemon_name(leading_site))
    wait(lambda: view.leader() == wanted, f"the {wanted} replica to lead")
    sandbox.up(progress=lambda _msg: None)  # the other back, following
    return leader


def kill_replica(sandbox: Sandbox, name: str) -> set[int]:
    """SIGKILL the federation replica `name` (no resignation: its lease runs out)."""
    site = next(s for s, n in REPLICA_NAMES.items() if n == name)
    pid = sandbox.processes.running_pid(stages.federation_daemon_name(site))
    victims = set() if pid is None else with_descendants({pid})
    signal_pids(victims, signal.SIGKILL)
    return victims


def secrets_found(directories: Iterable[Path], secrets: Mapping[str, bytes],
                  chunk: int = 1 << 22) -> list[str]:
    """Which of `secrets` (a name -> its raw bytes) any file under `directories` holds,
    raw, as hex or as base64: 'NAME in PATH' for each. What a site that must never hold a
    secret (the rented provider's disks) is scanned with."""
    import base64

    forms = {name: (raw, raw.hex().encode(), base64.b64encode(raw),
                    base64.urlsafe_b64encode(raw), base64.b64encode(raw).rstrip(b"="))
             for name, raw in secrets.items()}
    overlap = max((len(f) for group in forms.values() for f in group), default=0)
    found = []
    for directory in directories:
        for path in sorted(p for p in directory.rglob("*") if p.is_file()):
            with open(path, "rb") as data:
                tail = b""
                while block := data.read(chunk):
                    window, tail = tail + block, (tail + block)[-overlap:]
                    for name, group in forms.items():
                        if any(form in window for form in group) and \
                                f"{name} in {path}" not in found:
                            found.append(f"{name} in {path}")
    return found


def signal_pids(pids: set[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            continue


class InSite:
    """The calling thread in `site`'s network namespace from `enter` to `leave`: what it
    connects to, and the threads and processes it starts meanwhile, are there (network
    namespaces are a thread's, so other threads stay where they are)."""

    def __init__(self, sandbox: Sandbox, site: Site):
        self._path = f"/run/netns/{sandbox.layout.namespace(site)}"
        self._back: int | None = None

    def enter(self) -> None:
        back = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        there = os.open(self._path, os.O_RDONLY)
        try:
            _setns(there)
        except OSError:
            os.close(back)
            raise
        finally:
            os.close(there)
        self._back = back

    def leave(self) -> None:
        """Back where `enter` was called; nothing when already there."""
        if self._back is None:
            return
        try:
            _setns(self._back)
        finally:
            os.close(self._back)
            self._back = None


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns: {os.strerror(errno)}")
