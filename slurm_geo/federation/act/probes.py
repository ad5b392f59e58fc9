"""What the federation daemon measures: whether each controller answers (health) and how
fast checkpoints move between stores (bandwidth)."""

from __future__ import annotations

import logging
import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor

from slurm_geo.ckpt.errors import CkptError
from slurm_geo.ckpt.stores.store import Store
from slurm_geo.daemon.events import event
from slurm_geo.federation.decide.bandwidth import BandwidthModel
from slurm_geo.federation.model import ClusterStatus, Health
from slurm_geo.federation.wiring import Wiring
from slurm_geo.slurm import CertificateRejected, SlurmClient, SlurmError, TokenRejected
from slurm_geo.sync.reader import SyncStateReader, SyncStateUnreadable

log = logging.getLogger("slurm_geo.federation")

PROBE_BYTES = 4 * 1024 * 1024
BANDWIDTH_PROBE_EVERY_S = 600.0


def track_health(previous: Health | None, cluster: str, error: str | None, now: float,
                 outage_after: int) -> Health:
    """A cluster's health after one probe (`error` None: it answered). Pure: out after
    `outage_after` failures in a row, up again at the first answer."""
    if previous is None:
        previous = Health(cluster, ClusterStatus.UP, 0, now, None, None)
    if error is None:
        since = previous.since if previous.status is ClusterStatus.UP else now
        return Health(cluster, ClusterStatus.UP, 0, since, now, None)
    failures = previous.failures + 1
    out = previous.status is ClusterStatus.OUT or failures >= outage_after
    since = now if out and previous.status is ClusterStatus.UP else previous.since
    return Health(cluster, ClusterStatus.OUT if out else ClusterStatus.UP, failures, since,
                  previous.last_ok, error)


def nodes_up(client: SlurmClient) -> int:
    """Nodes of the cluster that can take a job now or soon."""
    return sum(1 for node in client.nodes() if node.available)


class HealthProbes:
    """Pings every controller at once; a probe unanswered within the probe clients'
    timeout failed. Runs on its own thread beside the daemon loop."""

    def __init__(self, wiring: Wiring, probes: dict[str, SlurmClient]):
        self.wiring = wiring
        self.probes = probes
        self.state = wiring.state
        self.audit = wiring.audit
        self.outage_after = wiring.config.outage_after
        self.clock = wiring.clock
        self.nodes_available: dict[str, int] = {}  # from the last probe that answered

    def probe_all(self) -> dict[str, Health]:
        now = self.clock()
        known = self.state.health()
        with ThreadPoolExecutor(max_workers=max(1, len(self.probes))) as pool:
            errors = dict(zip(self.probes, pool.map(self._probe, self.probes.values()),
                              strict=True))
        return {name: self._record(known.get(name), name, error, now)
                for name, error in errors.items()}

    def _probe(self, client: SlurmClient) -> str | None:
        try:
            client.ping()
            self.nodes_available[client.cluster] = nodes_up(client)
        except TokenRejected as exc:
            # The cluster answered: an expired or revoked token is the operator's to mend,
            # said once, never an outage (which would move every job away from it).
            self._say_misconfigured("token_rejected", client.cluster, exc,
                                    f"cluster {client.cluster} refused the daemon's token")
        except CertificateRejected as exc:
            # Something answered at rest_url with a certificate the daemon does not trust:
            # a ca_file or rest_url to mend, as above, not an outage.
            self._say_misconfigured("certificate_rejected", client.cluster, exc,
                                    f"the daemon does not trust cluster {client.cluster}'s "
                                    "slurmrestd certificate")
        except SlurmError as exc:
            self.nodes_available.pop(client.cluster, None)
            return str(exc)
        return None

    def _say_misconfigured(self, kind: str, cluster: str, exc: SlurmError,
                           headline: str) -> None:
        self.nodes_available.pop(cluster, None)
        self.wiring.say_once((kind, cluster, str(exc)), "decision", None, headline, str(exc),
                             cluster=cluster)
        event(log, kind, logging.ERROR, cluster=cluster, error=exc)

    def _record(self, previous: Health | None, cluster: str, error: str | None,
                now: float) -> Health:
        health = track_health(previous, cluster, error, now, self.outage_after)
        was = previous.status if previous is not None else ClusterStatus.UP
        if was is ClusterStatus.OUT and health.status is ClusterStatus.UP:
            assert previous is not None
            self.audit.append("recovered", None, f"cluster {cluster} answers again",
                              "a probe succeeded", cluster=cluster,
                              out_for_s=round(now - previous.since, 3))
        elif was is ClusterStatus.UP and health.status is ClusterStatus.OUT:
            self.audit.append("outage", None, f"cluster {cluster} declared out",
                              f"{health.failures} probes failed in a row; last: {error}",
                              cluster=cluster, failures=health.failures,
                              last_ok=health.last_ok)
        self.state.put_health(health)
        return health


class BandwidthProbes:
    """Learns transfer rates between stores: from every replication checkpoint-sync
    finished, and from a probe object timed every BANDWIDTH_PROBE_EVERY_S (the planner
    needs a rate before any real move). Probes go through the paced stores, so the site's
    bandwidth cap holds for them too."""

    def __init__(self, wiring: Wiring, bandwidth: BandwidthModel):
        self.wiring = wiring
        self.bandwidth = bandwidth
        sync = wiring.site.sync
        self._sync = None if sync is None else SyncStateReader(sync.state, missing_ok=True)

    def learn_from_sync(self) -> None:
        if self._sync is None:
            return
        state = self.wiring.state
        try:
            samples = self._sync.replication_samples(state.sync_transfer_id())
        except SyncStateUnreadable as exc:
            event(log, "sync_state_unreadable", logging.WARNING, error=exc)
            return
        if not samples:
            return
        for sample in samples:
            if sample.finished_at > sample.started_at and sample.source != sample.destination:
                self.bandwidth.observe(sample.source, sample.destination, sample.bytes,
                                       sample.finished_at - sample.started_at)
        state.put_bandwidth_snapshot(self.bandwidth.snapshot())
        state.put_sync_transfer_id(max(s.last_id for s in samples))

    def probe(self) -> None:
        state = self.wiring.state
        now = self.wiring.clock()
        if now - state.bandwidth_probe_at() < BANDWIDTH_PROBE_EVERY_S:
            return
        state.put_bandwidth_probe_at(now)
        site = self.wiring.site
        names = sorted({c.store for c in site.clusters.values() if c.store})
        payload = os.urandom(PROBE_BYTES)
        stores = self.wiring.paced_stores
        for source in names:
            for destination in (n for n in names if n != source):
                self._probe_pair(stores[source], stores[destination], source, destination,
                                 payload)
        state.put_bandwidth_snapshot(self.bandwidth.snapshot())

    def _probe_pair(self, source: Store, destination: Store, source_name: str,
                    destination_name: str, payload: bytes) -> None:
        name = f"probes/{secrets.token_hex(8)}"
        try:
            source.put(name, payload)
            started = time.monotonic()
            destination.put(name, source.get(name))
            seconds = time.monotonic() - started
            self.bandwidth.observe(source_name, destination_name, PROBE_BYTES, seconds,
                                   probe=True)
        except CkptError as exc:
            event(log, "bandwidth_probe_failed", logging.WARNING, source=source_name,
                  destination=destination_name, error=exc)
        finally:
            for store in (source, destination):
                try:
                    store.delete(name)
                except CkptError:
                    continue
