"""`slurm-geo-federation`: the federation daemon's command line and main loop.

Daemon manners, the same as checkpoint-sync's: signal handlers only enqueue the signal
(`slurm_geo.daemon.process.Wakeup`, whose wakeup fd ends the loop's wait at once);
`run_loop` drains the queue every turn and dispatches to `handle_term` (SIGTERM, SIGINT)
or `handle_hup` (reopen the logs, re-read the config). READY is sent once the lease
service listens, WATCHDOG on every turn, STOPPING on the way out. Health probes keep their
own rhythm on a thread beside the loop.

A replica of a federation on etcd also keeps its leadership on a thread of its own
(campaign, keepalive every third of leader_ttl_s, step down), and its rounds and probes
run only while it leads; on SIGTERM it resigns, so that the other replica leads at once.

The systemd unit (slurm_geo/share/systemd/slurm-geo-federation.service), the sandbox and
daemons/federation.py all run this `main`.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from slurm_geo.daemon.events import event
from slurm_geo.errors import SlurmGeoError
from slurm_geo.federation.model import NotLeader, StateUnavailable

if TYPE_CHECKING:
    from slurm_geo.config.model import SiteConfig, StoreConfig
    from slurm_geo.daemon.notify import Notifier
    from slurm_geo.daemon.process import Wakeup
    from slurm_geo.federation.daemon.service import Metrics
    from slurm_geo.federation.engine.core import Federation
    from slurm_geo.federation.state.etcd.leadership import Leadership

PROGRAM = "slurm-geo-federation"
log = logging.getLogger("slurm_geo.federation")

# [federation] settings bound or opened once, at the start: the lease service's socket,
# its TLS and refusal audit, the MUNGE socket, the state and audit databases, the master
# key, the leader key's lease, etcd and the replicas. A reload keeps their old values.
RESTART_SETTINGS = ("listen_address", "listen_port", "tls_cert", "tls_key",
                    "refusal_audit_interval_s", "munge_socket", "state", "audit_path",
                    "key_file", "leader_ttl_s", "etcd_endpoints", "etcd_prefix",
                    "etcd_ca_file", "etcd_cert", "etcd_key", "etcd_user",
                    "etcd_password_file", "replica", "replicas")


# Longest a campaign or a keepalive takes: etcd's timeout per endpoint, three endpoints.
RESIGN_WAIT_S = 10.0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROGRAM, description="Watch the clusters, move geo jobs away from a dead "
        "cluster or a hopeless queue and back (docs/federation.md).")
    parser.add_argument("--config", type=Path, default=None,
                        help="Site config (default: $SLURM_GEO_CONFIG or "
                             "/etc/slurm-geo/config.toml).")
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from slurm_geo.config.model import load_config
    from slurm_geo.daemon.events import configure_logging
    from slurm_geo.daemon.notify import Notifier
    from slurm_geo.daemon.process import Wakeup
    from slurm_geo.federation.access.tls import server_context
    from slurm_geo.federation.daemon.service import Metrics, serve
    from slurm_geo.federation.engine.runtime import build

    level = getattr(logging, args.log_level)
    configure_logging(os.environ, level)
    try:
        federation = build(args.config, daemon=True)
        config = federation.config
        tls = None if config.tls_cert is None or config.tls_key is None \
            else server_context(config.tls_cert, config.tls_key)
        metrics = Metrics()
        server = serve(federation, metrics, config.listen_address, config.listen_port,
                       tls=tls)
    except (SlurmGeoError, OSError) as exc:
        print(f"{PROGRAM}: error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 1)
    wakeup, stop_threads = Wakeup(), threading.Event()
    leadership = federation.wiring.leadership
    campaigner = None if leadership is None else threading.Thread(
        target=leadership.run, args=(stop_threads,), name="federation-leadership",
        daemon=True)
    try:
        with wakeup.signals_installed():
            if campaigner is not None:
                campaigner.start()
            threading.Thread(target=probe_forever, args=(federation, stop_threads),
                             name="federation-probes", daemon=True).start()
            return run_loop(federation, wakeup, Notifier(os.environ),
                            lambda: load_config(args.config), metrics=metrics,
                            reopen_logs=lambda: configure_logging(os.environ, level))
    finally:
        stop_threads.set()
        if leadership is not None and campaigner is not None:
            # Its last campaign done first: one after the resignation would lead again.
            campaigner.join(RESIGN_WAIT_S)
            resign(leadership)
        server.shutdown()
        server.server_close()
        wakeup.close()
        event(log, "stopped")


# --- the loop ---------------------------------------------------------------------------


def run_loop(federation: Federation, signals: Wakeup, notifier: Notifier,
             load_site: Callable[[], SiteConfig], *, metrics: Metrics | None = None,
             reopen_logs: Callable[[], None] = lambda: None,
             monotonic: Callable[[], float] = time.monotonic) -> int:
    """A round every probe_interval_s until SIGTERM or SIGINT, then 0. Signals are taken
    from `signals.signals`, whoever queued them; `load_site` re-reads the config on SIGHUP.
    The caller has the lease service listening: that is what READY announces."""
    notifier.ready(_status(federation))
    event(log, "started", pid=os.getpid(), clusters=",".join(federation.clients),
          url=federation.config.url)
    next_round = monotonic()
    try:
        while True:
            while signals.signals:
                signum = signals.signals.popleft()
                if signum != signal.SIGHUP:
                    handle_term(signum)
                    return 0
                handle_hup(federation, notifier, load_site, reopen_logs)
            notifier.watchdog()
            if monotonic() >= next_round:
                started = monotonic()
                run_round(federation, metrics)
                next_round = started + federation.config.probe_interval_s
            if not signals.signals:
                signals.wait(_wait_s(next_round - monotonic(), notifier))
    finally:
        notifier.stopping()


def run_round(federation: Federation, metrics: Metrics | None) -> None:
    """One round over every logical job, on the health the probe thread recorded, while
    this daemon leads; the first round of a term begins it (Federation.begin_term). A
    write refused because another replica leads ends the round, said once: from then on
    this replica follows, silently."""
    term = federation.leading_term()
    if metrics is not None:
        metrics.leading.set(term is not None)
    if term is None:
        if federation.term is not None:
            event(log, "following", term=federation.term, leader=_leader_name(federation))
            federation.term = None
        return
    try:
        if term != federation.term:
            federation.begin_term(term)
            event(log, "leading", term=term)
        federation.tick(federation.state.health())
        if metrics is not None:
            metrics.observe(federation)
    except NotLeader as exc:
        event(log, "not_leader", logging.WARNING, term=term, error=exc)
        federation.term = None
    except StateUnavailable as exc:
        event(log, "state_unavailable", logging.WARNING, error=exc)
    except Exception:  # a bug must cost one round, not the daemon
        log.exception("event=tick_crashed")


def _leader_name(federation: Federation) -> str:
    try:
        leader = federation.leader()
    except StateUnavailable:
        return "unknown"
    return "none" if leader is None else leader.name


def resign(leadership: Leadership) -> None:
    """Give the leader key up on the way out: the other replica need not wait a TTL."""
    try:
        leadership.resign()
    except StateUnavailable as exc:
        event(log, "resign_failed", logging.WARNING, error=exc,
              reason="the leader key goes when its lease runs out")


def _wait_s(until_next_round: float, notifier: Notifier) -> float:
    """Until the next round, but never past the next WATCHDOG that systemd expects."""
    interval = notifier.watchdog_interval_s
    return max(0.0, until_next_round if not interval else min(until_next_round, interval))


def _status(federation: Federation) -> str:
    return f"watching {len(federation.clients)} clusters"


def probe_forever(federation: Federation, stop: threading.Event) -> None:
    """Probes keep their own rhythm: a round of moves waiting on a slow controller must
    not delay noticing that another one died. The interval is re-read each probe, so a
    reload changes it."""
    while not stop.is_set():
        started = time.monotonic()
        try:
            if federation.leading_term() is not None:  # a follower's writes are refused
                federation.probe_all()
        except (NotLeader, StateUnavailable):
            pass  # the round says so, once
        except Exception:  # a bug must cost one probe, not the daemon
            log.exception("event=probe_crashed")
        stop.wait(max(0.0, federation.config.probe_interval_s - (time.monotonic() - started)))


# --- signals ------------------------------------------------------------------------------


def handle_term(signum: int) -> None:
    event(log, "stopping", signal=signal.Signals(signum).name)


def handle_hup(federation: Federation, notifier: Notifier,
               load_site: Callable[[], SiteConfig],
               reopen_logs: Callable[[], None]) -> None:
    notifier.reloading()
    reopen_logs()
    reload_config(federation, load_site)
    notifier.ready(_status(federation))


def reload_config(federation: Federation, load_site: Callable[[], SiteConfig]) -> bool:
    """Re-read the config and take what can change live (`live_site`); a config that does
    not load or validate is one warning line, and the one in force stays."""
    from slurm_geo.federation.engine.runtime import check_files_read_at_use
    from slurm_geo.federation.state.open import federation_config

    try:
        new = load_site()
        federation_config(new)
        site, restart_needed = live_site(federation.site, new)
        check_files_read_at_use(site)  # as at the start: a bad file is refused here
    except (SlurmGeoError, OSError) as exc:
        event(log, "reload_failed", logging.WARNING, error=exc,
              keeping="the configuration in force")
        return False
    for setting in restart_needed:
        event(log, "restart_needed", logging.WARNING, setting=setting,
              reason="takes effect at the next start")
    federation.reload(site)
    config = federation.config
    event(log, "reloaded", probe_interval_s=config.probe_interval_s,
          outage_after=config.outage_after, lease_ttl_s=config.lease_ttl_s,
          margin_s=config.margin_s, failback=config.failback,
          failback_stable_s=config.failback_stable_s,
          max_restarts=federation.site.policy.max_restarts)
    return True


def live_site(old: SiteConfig, new: SiteConfig) -> tuple[SiteConfig, list[str]]:
    """What a reload takes from `new`: its [federation] settings but RESTART_SETTINGS, its
    [policy], its stores' job_credentials. The rest keeps `old`'s values, which the clients,
    stores and databases were opened with; the settings among those that changed are
    named in the list, for a restart to take them."""
    assert old.federation is not None and new.federation is not None
    restart = [f"federation.{name}" for name in RESTART_SETTINGS
               if getattr(old.federation, name) != getattr(new.federation, name)]
    if old.home_cluster != new.home_cluster:
        restart.append("site.home_cluster")
    if old.clusters != new.clusters:
        restart.append("clusters")
    restart += [f"stores.{name}" for name in sorted(old.stores.keys() | new.stores.keys())
                if _opened_as(old.stores.get(name)) != _opened_as(new.stores.get(name))]
    # From [sync], the state it learns transfer rates from and the cap on its own copies.
    restart += [f"sync.{name}" for name in ("state", "bandwidth_mb_s")
                if getattr(old.sync, name, None) != getattr(new.sync, name, None)]
    federation = replace(new.federation, **{name: getattr(old.federation, name)
                                            for name in RESTART_SETTINGS})
    stores = {name: replace(store, job_credentials=new.stores[name].job_credentials)
              if name in new.stores else store for name, store in old.stores.items()}
    site = replace(new, home_cluster=old.home_cluster, clusters=old.clusters, stores=stores,
                   sync=old.sync, federation=federation)
    return site, restart


def _opened_as(store: StoreConfig | None) -> StoreConfig | None:
    """A store as the daemon opened it: all of it but job_credentials, read at each use."""
    return None if store is None else replace(store, job_credentials=None)


if __name__ == "__main__":
    sys.exit(main())
