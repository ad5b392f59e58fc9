"""The federation daemon's decisions applied: leases, health, moves, fencing, failback.

`Federation.tick()` runs once per probe interval; `lease()` and `key()` answer jobs (from
the HTTP service's threads). Everything the daemon knows is in FederationState, the
stores and Slurm, so a killed daemon picks up where it was (crash-only).

A move, in order (each step is safe to repeat if the daemon dies after it):
  1. the newest checkpoint of the run that verifies in the target cluster's store is
     chosen (copied there first when the current cluster is still up: a failback);
  2. the generation goes up: from now on the old incarnation gets no lease;
  3. the target store is fenced: only the new generation's cluster may commit past the
     resume step there (and the old store too, when it can be reached);
  4. the job is submitted on the target with its resume pointer and a one-time token
     for its run's data key.
"""

from __future__ import annotations

import logging
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from slurm_geo.ckpt import Repository
from slurm_geo.ckpt.errors import CkptError
from slurm_geo.ckpt.fence import Fence, unadmitted_steps, write_fence
from slurm_geo.ckpt.manifest import with_bases
from slurm_geo.ckpt.names import key_name
from slurm_geo.ckpt.replicate import copy_checkpoint
from slurm_geo.ckpt.runkey import unwrap_run_key
from slurm_geo.ckpt.store import Store
from slurm_geo.config.model import FederationConfig, SiteConfig
from slurm_geo.errors import ConfigError, SlurmGeoError
from slurm_geo.federation.audit import AuditLog
from slurm_geo.federation.bandwidth import BandwidthModel
from slurm_geo.federation.credentials import job_environment
from slurm_geo.federation.leases import Action, Answer, LeaseRequest, Verdict, decide
from slurm_geo.federation.planner import ClusterView, JobNeeds, Plan, plan
from slurm_geo.federation.resubmit import Incoming, ScriptOptions, resubmission, script_options
from slurm_geo.federation.state import (
    FederationState,
    Health,
    JobStatus,
    Lease,
    LogicalJob,
    token_digest,
)
from slurm_geo.policy.directives import DirectiveError
from slurm_geo.policy.geo import rules_for
from slurm_geo.slurm import JobInfo, JobState, SlurmClient, SlurmError
from slurm_geo.slurm.errors import JobNotFound

log = logging.getLogger("slurm_geo.federation")

UP, OUT = "up", "out"
WAIT_RETRY_S = 1.0
VERIFY_OLDER_LIMIT = 5  # checkpoints tried, newest first, before a move gives up
PROBE_BYTES = 4 * 1024 * 1024
BANDWIDTH_PROBE_EVERY_S = 600.0


@dataclass(frozen=True)
class Reply:
    status: int  # HTTP status
    body: dict[str, Any]


class Federation:
    def __init__(self, site: SiteConfig, config: FederationConfig, master_key: bytes,
                 clients: dict[str, SlurmClient], probes: dict[str, SlurmClient],
                 stores: dict[str, Store],
                 state: FederationState, audit: AuditLog, bandwidth: BandwidthModel,
                 clock: Callable[[], float] = time.time):
        self.site = site
        self.config = config
        self.home = site.home_cluster
        self._key = master_key
        self.clients = clients
        self.probes = probes
        self.stores = stores
        self.state = state
        self.audit = audit
        self.bandwidth = bandwidth
        self.clock = clock
        self._rules = rules_for(site)
        self._lock = threading.RLock()  # leases and moves never interleave
        self._announced: set[tuple[str, ...]] = set()  # audit lines not to repeat each tick
        self._seen_pending: set[tuple[str, int]] = set()
        # Per job away from home: the (checkpoint step, home up since) its failback was last
        # planned for. Planning asks both clusters for a start estimate; a failback happens
        # at a checkpoint anyway, so one plan per checkpoint (or per change of home's
        # health) is enough, rather than one every probe interval.
        self._failback_planned: dict[str, tuple[int | None, float]] = {}
        self.nodes_available: dict[str, int] = {}  # from the last probe that answered

    # --- the lease service ----------------------------------------------------------------

    def lease(self, request: LeaseRequest) -> Reply:
        with self._lock:
            now = self.clock()
            job = self.state.find_job(request.cluster, request.job_id)
            lease = None if job is None else self.state.lease(job.logical_job)
            answer = decide(job, lease, request, self.home, now, self.config.lease_ttl_s)
            if answer.verdict is Verdict.REGISTER:
                job = self._register(request, now)
                lease = None
                answer = Answer(Verdict.GRANT, "registered")
            if answer.verdict is Verdict.FENCED:
                self._say_once(("fenced", request.cluster, str(request.job_id),
                                str(request.generation)), "fence",
                               None if job is None else job.logical_job,
                               f"refused a lease to {request.cluster}:{request.job_id} "
                               f"generation {request.generation}", answer.reason)
                return Reply(409, {"verdict": "fenced", "reason": answer.reason})
            if answer.verdict is Verdict.WAIT:
                return Reply(200, {"verdict": "wait", "reason": answer.reason,
                                   "retry_s": WAIT_RETRY_S})
            assert job is not None
            if not job.run:  # discovered while pending: the job names its run now
                job = self.state.update_job(job.logical_job, now, run=request.run)
            first = lease is None or lease.generation != job.generation
            released = answer.action is Action.RELEASE and request.release
            self.state.put_lease(Lease(job.logical_job, job.generation, request.cluster,
                                       request.job_id, request.restart, now,
                                       request.last_step, released), first)
            if first:
                self.audit.append("lease", job.logical_job,
                                  f"generation {job.generation} started training on "
                                  f"{request.cluster}:{request.job_id}",
                                  "first lease of this generation",
                                  cluster=request.cluster, job_id=request.job_id,
                                  generation=job.generation, resume_step=job.resume_step)
            return Reply(200, {"verdict": "grant", "action": answer.action.value,
                               "reason": answer.reason, "logical_job": job.logical_job,
                               "generation": job.generation,
                               "ttl_s": self.config.lease_ttl_s})

    def key(self, token: str) -> Reply:
        """The run's data key, for the incarnation the token was minted for, while it is
        the current generation."""
        with self._lock:
            owner = self.state.token_owner(token)
            if owner is None:
                return Reply(403, {"reason": "unknown or expired token"})
            job = self.state.job(owner[0])
            if not job.run:
                return Reply(409, {"reason": "ask for a lease first: it names the run"})
            if job.generation != owner[1] or job.status.is_final():
                return Reply(403, {"reason": f"generation {owner[1]} is no longer current"})
            store = self.stores[self.site.cluster(job.cluster).store]
        try:
            data_key = unwrap_run_key(store, self._key, job.run, create=True)
        except CkptError as exc:
            return Reply(503, {"reason": str(exc)})
        self._say_once(("key", job.logical_job, str(job.generation)), "key", job.logical_job,
                       f"released run {job.run}'s data key to generation {job.generation} "
                       f"on {job.cluster}", "the job presented its one-time token")
        return Reply(200, {"run": job.run, "data_key": data_key.hex()})

    def _register(self, request: LeaseRequest, now: float) -> LogicalJob:
        script = self.clients[self.home].batch_script(request.job_id)
        options = script_options(script)
        try:
            options.directives()
        except DirectiveError as exc:
            raise SlurmGeoError(f"job {self.home}:{request.job_id}: {exc}") from None
        return self._add(request.job_id, request.run, script, options, now,
                         "first lease request of a home job")

    def _add(self, job_id: int, run: str, script: str, options: ScriptOptions, now: float,
             why: str) -> LogicalJob:
        logical = f"{self.home}-{job_id}"
        job = LogicalJob(logical, run, self.home, script, options.to_json(),
                         options.directives().as_options(), 0, self.home, job_id,
                         None, JobStatus.RUNNING, None, None, now, now)
        self.state.add_job(job)
        self.audit.append("register", logical, f"registered {self.home}:{job_id}"
                          + (f" (run {run})" if run else ""), why, cluster=self.home,
                          job_id=job_id, run=run, directives=job.directives)
        return job

    def _discover_pending(self) -> None:
        """Register geo jobs pending at home, so a hopeless queue can be left: a job that
        asks --geo-failover and --geo-ckpt-dir. Each pending job's script is read once."""
        for info in self.clients[self.home].jobs():
            key = (self.home, info.job_id)
            if info.state is not JobState.PENDING or key in self._seen_pending:
                continue
            self._seen_pending.add(key)
            with self._lock:
                if self.state.find_job(self.home, info.job_id) is not None:
                    continue
                try:
                    script = self.clients[self.home].batch_script(info.job_id)
                    options = script_options(script)
                    directives = options.directives()
                except (SlurmError, DirectiveError, ValueError):
                    continue
                if directives.ckpt_dir and directives.failover in ("auto", "manual"):
                    self._add(info.job_id, "", script, options, self.clock(),
                              "a geo job pending on the home cluster")

    # --- the loop ---------------------------------------------------------------------------

    def tick(self, health: dict[str, Health] | None = None) -> None:
        """One round over every logical job; `health` from a probe loop running beside
        (the daemon's), else probed now."""
        health = self.probe_all() if health is None else health
        self._learn_from_sync()
        self._probe_bandwidth()
        if _answering(health, self.home):
            self._discover_pending()
        for job in self.state.jobs():
            try:
                if job.status.is_final():
                    self._fence_stale(job, health)  # a stale incarnation may come back
                else:
                    self._reconcile(job, health)
            # ConfigError: a store's job_credentials file went bad after the start; the
            # move is finished in a later round, once it is mended.
            except (SlurmError, CkptError, ConfigError) as exc:
                log.warning("event=reconcile_failed job=%s error=%s", job.logical_job, exc)

    def probe_all(self) -> dict[str, Health]:
        """Ping every controller at once; a probe unanswered within the probe interval
        failed (the probe clients carry that timeout)."""
        now = self.clock()
        known = self.state.health()

        def probe(client: SlurmClient) -> str | None:
            try:
                client.ping()
                self.nodes_available[client.cluster] = sum(
                    1 for node in client.nodes() if node.available)
            except SlurmError as exc:
                self.nodes_available.pop(client.cluster, None)
                return str(exc)
            return None

        with ThreadPoolExecutor(max_workers=len(self.probes)) as pool:
            errors = dict(zip(self.probes, pool.map(probe, self.probes.values()), strict=True))
        return {name: self._track_health(known.get(name), name, error, now)
                for name, error in errors.items()}

    def _probe_bandwidth(self) -> None:
        """Time a probe object from each cluster store to each other one, every
        BANDWIDTH_PROBE_EVERY_S: the planner needs a rate before any real move."""
        now = self.clock()
        if now - float(self.state.meta("bandwidth_probe_at") or 0) < BANDWIDTH_PROBE_EVERY_S:
            return
        self.state.put_meta("bandwidth_probe_at", str(now))
        names = sorted({c.store for c in self.site.clusters.values() if c.store})
        payload = os.urandom(PROBE_BYTES)
        for source in names:
            for destination in (n for n in names if n != source):
                name = f"probes/{secrets.token_hex(8)}"
                try:
                    self.stores[source].put(name, payload)
                    started = time.monotonic()
                    self.stores[destination].put(name, self.stores[source].get(name))
                    seconds = time.monotonic() - started
                    self.bandwidth.observe(source, destination, PROBE_BYTES, seconds,
                                           probe=True)
                except CkptError as exc:
                    log.warning("event=bandwidth_probe_failed source=%s destination=%s "
                                "error=%s", source, destination, exc)
                finally:
                    for store in (self.stores[source], self.stores[destination]):
                        try:
                            store.delete(name)
                        except CkptError:
                            continue
        self.state.put_bandwidth_snapshot(self.bandwidth.snapshot())

    def _learn_from_sync(self) -> None:
        """Every replication checkpoint-sync finished is a bandwidth sample."""
        sync = self.site.sync
        if sync is None or not sync.state.exists():
            return
        watermark = int(self.state.meta("sync_transfer_id") or 0)
        try:
            with sqlite3.connect(f"file:{sync.state}?mode=ro", uri=True, timeout=5) as db:
                rows = db.execute(
                    "SELECT MAX(id), source, destination, SUM(bytes), MIN(started_at), "
                    "MAX(finished_at) FROM transfers WHERE id > ? AND kind != 'verify' "
                    "GROUP BY replica_id, source, destination", (watermark,)).fetchall()
        except sqlite3.Error as exc:
            log.warning("event=sync_state_unreadable error=%s", exc)
            return
        if not rows:
            return
        for _last, source, destination, nbytes, started, finished in rows:
            if finished > started and source != destination:
                self.bandwidth.observe(source, destination, int(nbytes), finished - started)
        self.state.put_bandwidth_snapshot(self.bandwidth.snapshot())
        self.state.put_meta("sync_transfer_id", str(max(r[0] for r in rows)))

    def _track_health(self, previous: Health | None, cluster: str, error: str | None,
                      now: float) -> Health:
        if previous is None:
            previous = Health(cluster, UP, 0, now, None, None)
        if error is None:
            health = Health(cluster, UP, 0, previous.since if previous.status == UP else now,
                            now, None)
            if previous.status == OUT:
                self.audit.append("recovered", None, f"cluster {cluster} answers again",
                                  "a probe succeeded", cluster=cluster,
                                  out_for_s=round(now - previous.since, 3))
        else:
            failures = previous.failures + 1
            out = previous.status == OUT or failures >= self.config.outage_after
            health = Health(cluster, OUT if out else UP, failures,
                            now if out and previous.status == UP else previous.since,
                            previous.last_ok, error)
            if out and previous.status == UP:
                self.audit.append("outage", None, f"cluster {cluster} declared out",
                                  f"{failures} probes failed in a row; last: {error}",
                                  cluster=cluster, failures=failures,
                                  last_ok=previous.last_ok)
        self.state.put_health(health)
        return health

    # --- one logical job --------------------------------------------------------------------

    def _reconcile(self, job: LogicalJob, health: dict[str, Health]) -> None:
        self._fence_stale(job, health)
        if job.status is JobStatus.MOVING:
            with self._lock:
                self._complete_move(self.state.job(job.logical_job),  # a move cut short
                                    "finishing a move the daemon was stopped in")
            return
        here = health.get(job.cluster)
        if here is None:
            return  # not probed yet
        if here.status == OUT:
            self._consider_failover(job, health)
            return
        if here.failures:
            return  # a probe just failed: do not wait on that controller, probe again
        info = self._slurm_job(job)
        lease = self.state.lease(job.logical_job)
        if job.move_to is not None and lease is not None and lease.released \
                and lease.generation == job.generation:
            self._move(job, job.move_to, f"planned move to {job.move_to} at checkpoint "
                       f"{lease.last_step}", health)
            return
        if info is not None and info.state.is_terminal():
            if lease is not None and lease.generation == job.generation \
                    and not lease.released:
                self._restart_lost(job, info.state, lease, health)
            else:
                self._finish(job, info.state, lease)
            return
        if info is not None and info.state is JobState.PENDING and lease is None:
            self._consider_queue_move(job, info, health)
            return
        if self.config.failback and job.cluster != self.home and job.move_to is None \
                and self.state.meta(f"left_home:{job.logical_job}") != "queue":
            self._consider_failback(job, health, lease)

    def _slurm_job(self, job: LogicalJob) -> Any:
        if job.job_id is None:
            return None
        try:
            return self.clients[job.cluster].job(job.job_id)
        except JobNotFound:
            return None

    def _finish(self, job: LogicalJob, state: JobState, lease: Lease | None) -> None:
        now = self.clock()
        done = state is JobState.COMPLETED
        status = JobStatus.COMPLETED if done else JobStatus.FAILED
        self.state.update_job(job.logical_job, now, status=status)
        self.state.end_incarnation(job.logical_job, job.generation, state.value.lower(), now)
        self._failback_planned.pop(job.logical_job, None)
        self.audit.append("finished", job.logical_job,
                          f"generation {job.generation} on {job.cluster}:{job.job_id} ended "
                          f"{state.value}", "Slurm reports the job finished",
                          cluster=job.cluster, job_id=job.job_id,
                          last_step=None if lease is None else lease.last_step)

    def _fence_stale(self, job: LogicalJob, health: dict[str, Health]) -> None:
        """Cancel older incarnations still known to Slurm on clusters that answer."""
        for incarnation in self.state.incarnations(job.logical_job):
            if incarnation.generation >= job.generation or incarnation.ended_at is not None:
                continue
            cluster = incarnation.cluster
            if not _answering(health, cluster):
                continue
            reason = "ended"
            if incarnation.job_id is not None:
                try:
                    info = self.clients[cluster].job(incarnation.job_id)
                except JobNotFound:
                    info = None
                if info is not None and not info.state.is_terminal():
                    self.clients[cluster].cancel(incarnation.job_id)
                    reason = "cancelled: fenced"
            self._fence_store(job, cluster)
            self.state.end_incarnation(job.logical_job, incarnation.generation, reason,
                                       self.clock())
            self.audit.append("fence", job.logical_job,
                              f"generation {incarnation.generation} on {cluster}:"
                              f"{incarnation.job_id} {reason}",
                              f"the job is at generation {job.generation} on {job.cluster}",
                              cluster=cluster, job_id=incarnation.job_id,
                              generation=incarnation.generation)

    def _fence_store(self, job: LogicalJob, cluster: str) -> None:
        """Fence the run in `cluster`'s store too, now that it can be reached."""
        store_name = self.site.cluster(cluster).store
        if not job.run or store_name == self.site.cluster(job.cluster).store \
                or not self.stores[store_name].exists(key_name(job.run)):
            return  # nothing of the run is there to fence
        fence = Fence(job.run, job.generation, job.cluster, job.resume_step, _utc(self.clock()))
        write_fence(Repository(self.stores[store_name], self._key), fence)

    # --- deciding to move -------------------------------------------------------------------

    def plan_for(self, job: LogicalJob, health: dict[str, Health] | None = None,
                 current_wait: float | None = None) -> Plan:
        """Where `job` should run now (also what `slurm-geo plan` prints). `current_wait`:
        Slurm's estimate for the job where it is queued now."""
        health = health if health is not None else self.state.health()
        options = ScriptOptions.from_json(job.spec)
        source_store = self.site.cluster(job.cluster).store
        checkpoint_bytes = self._checkpoint_bytes(job, source_store)
        needs = JobNeeds(
            logical_job=job.logical_job, home=self.home, current=job.cluster,
            nodes=options.nodes, cpus=options.nodes * options.cpus_per_task,
            gpus=options.gpus,
            remaining_s=60.0 * (options.time_limit_minutes or 60),
            checkpoint_bytes=checkpoint_bytes, checkpoint_store=source_store,
            directives=options.directives())
        views = [self._view(name, health, options, job,
                            current_wait if name == job.cluster else None)
                 for name in self.clients]
        regions = {name: store.region for name, store in self.site.stores.items()}
        return plan(needs, views, self._rules, self.bandwidth.predict_seconds,
                    store_regions=regions, margin_s=self.config.margin_s)

    def _checkpoint_bytes(self, job: LogicalJob, store_name: str) -> int:
        """Stored size of the run's newest checkpoint: what a move must carry (0 if none)."""
        try:
            repository = Repository(self.stores[store_name], self._key)
            steps = repository.steps(job.run)
            if not steps:
                return 0
            manifest = repository.manifest(job.run, steps[-1])
        except CkptError:
            return 0
        return sum({ref.id: ref.length for ref in with_bases(manifest.refs())}.values())

    def _view(self, name: str, health: dict[str, Health], options: ScriptOptions,
              job: LogicalJob, known_wait: float | None) -> ClusterView:
        cluster = self.site.cluster(name)
        up = _answering(health, name)
        wait = None
        if up:
            wait = known_wait if known_wait is not None else self._queue_wait(name, options,
                                                                                job)
        # A partition the cluster lacks is dropped on resubmission: its default one fits.
        current = self.site.cluster(job.cluster)
        sibling = name != job.cluster and bool(cluster.slurm_federation) \
            and cluster.slurm_federation == current.slurm_federation
        return ClusterView(name=name, region=cluster.region, store=cluster.store,
                           prices=cluster.prices, up=up, queue_wait_s=wait, fits=True,
                           federation_sibling=sibling)

    def _queue_wait(self, name: str, options: ScriptOptions, job: LogicalJob) -> float | None:
        if name == job.cluster and job.status is JobStatus.RUNNING:
            lease = self.state.lease(job.logical_job)
            if lease is not None and not lease.expired(self.clock(), self.config.lease_ttl_s):
                return 0.0  # it is training there now
        spec = resubmission(job.script, options, Incoming(job.logical_job, 0, job.run, None,
                                                          "", "", ""),
                            self.site.cluster(name).partitions, {})
        try:
            start = self.clients[name].expected_start(spec)
        except SlurmError:
            return None
        if start is None:
            return None
        return max(0.0, (start - datetime.now(UTC)).total_seconds())

    def _consider_failover(self, job: LogicalJob, health: dict[str, Health]) -> None:
        if job.status is not JobStatus.RUNNING:
            return
        # Checked before planning: no move can start while the lease is live, and a plan
        # costs Slurm calls and a manifest read every round.
        lease = self.state.lease(job.logical_job)
        if lease is not None and lease.generation == job.generation \
                and not lease.expired(self.clock(), self.config.lease_ttl_s):
            self._say_once(("lease", job.logical_job, str(job.generation)), "decision",
                           job.logical_job, "waiting to move until the lease runs out",
                           f"{job.cluster} is out but the job's lease was renewed "
                           f"{self.clock() - lease.renewed_at:.1f} s ago; it may still be "
                           "training")
            return
        chosen = self.plan_for(job, health)
        if not chosen.moves():
            self._say_once(("stranded", job.logical_job, str(job.generation)), "decision",
                           job.logical_job, f"job stays on {job.cluster}", chosen.reason,
                           plan=_plan_summary(chosen))
            return
        if self._awaits_approval(job, chosen):
            return
        self.audit.append("decision", job.logical_job, f"move to {chosen.choice}",
                          chosen.reason, plan=_plan_summary(chosen))
        self.state.put_meta(f"left_home:{job.logical_job}", "outage")
        self._move(job, chosen.choice, chosen.reason, health)

    def _restart_lost(self, job: LogicalJob, state: JobState, lease: Lease,
                      health: dict[str, Health]) -> None:
        """Slurm says the job ended, but its trainer never released its lease: it was
        killed (a controller and its nodes lost and restarted can even report such a job
        COMPLETED). The job continues from its newest verified checkpoint, where the plan
        says, once the lease has run out."""
        if not lease.expired(self.clock(), self.config.lease_ttl_s):
            return
        counter = f"lost_restarts:{job.logical_job}"
        restarts = int(self.state.meta(counter) or 0)
        if restarts >= self.site.policy.max_restarts:
            self.audit.append("decision", job.logical_job, "give up",
                              f"generation {job.generation} ended {state.value} without "
                              f"releasing its lease, and {restarts} restarts (the policy's "
                              "max_restarts) were spent", cluster=job.cluster)
            self._finish(job, state, lease)
            return
        self.state.put_meta(counter, str(restarts + 1))
        chosen = self.plan_for(job, health)
        target = chosen.choice if chosen.moves() and not chosen.needs_approval \
            else job.cluster
        reason = (f"generation {job.generation} on {job.cluster}:{job.job_id} ended "
                  f"{state.value} without releasing its lease (last checkpoint "
                  f"{lease.last_step}); it continues on {target}")
        self.audit.append("decision", job.logical_job, f"restart on {target}", reason,
                          plan=_plan_summary(chosen))
        self._move(job, target, reason, health)

    def _consider_queue_move(self, job: LogicalJob, info: JobInfo,
                             health: dict[str, Health]) -> None:
        """A job still pending (never granted a lease) moves when another cluster would
        start it sooner by more than the margin. Its own wait is Slurm's estimate of its
        start; a job pending for less than the margin, or not yet estimated, stays: a job
        that left a queue for that reason does not fail back either."""
        now = datetime.now(UTC)
        if info.submit_time is None or (now - info.submit_time).total_seconds() \
                < self.config.margin_s:
            return
        if info.start_time is None:
            return
        wait = max(0.0, (info.start_time - now).total_seconds())
        chosen = self.plan_for(job, health, current_wait=wait)
        if not chosen.moves() or self._awaits_approval(job, chosen):
            return
        self.audit.append("decision", job.logical_job, f"move to {chosen.choice}",
                          chosen.reason, plan=_plan_summary(chosen))
        self.state.put_meta(f"left_home:{job.logical_job}", "queue")
        self._move(job, chosen.choice, chosen.reason, health, cancel_current=True)

    def _awaits_approval(self, job: LogicalJob, chosen: Plan) -> bool:
        """A move the job did not consent to (--geo-failover is not auto) and nobody has
        approved yet: say so once, and do not move."""
        if not chosen.needs_approval or job.move_to == chosen.choice:
            return False
        self._say_once(("approval", job.logical_job, str(job.generation)), "decision",
                       job.logical_job, f"move to {chosen.choice} needs approval",
                       chosen.reason + " (--geo-failover is not auto; `slurm-geo approve "
                       f"{job.logical_job} {chosen.choice}`)", plan=_plan_summary(chosen))
        return True

    def _consider_failback(self, job: LogicalJob, health: dict[str, Health],
                           lease: Lease | None) -> None:
        home = health.get(self.home)
        if home is None or home.status != UP or home.last_ok is None \
                or self.clock() - home.since < self.config.failback_stable_s:
            return
        planned_for = (None if lease is None else lease.last_step, home.since)
        if self._failback_planned.get(job.logical_job) == planned_for:
            return
        chosen = self.plan_for(job, health)
        self._failback_planned[job.logical_job] = planned_for
        if chosen.choice != self.home or chosen.needs_approval:
            return
        after = None if lease is None else lease.last_step
        self.state.update_job(job.logical_job, self.clock(), move_to=self.home,
                              move_after_step=after)
        self.audit.append("decision", job.logical_job, f"fail back to {self.home} at the "
                          "next checkpoint", chosen.reason, after_step=after,
                          plan=_plan_summary(chosen))

    def approve(self, logical_job: str, target: str, who: str) -> LogicalJob:
        """A person's consent to move a job that did not ask --geo-failover=auto. A job
        whose cluster is out, or that is still queued, moves as soon as the plan chooses
        `target`; a running job moves at its next checkpoint."""
        self.site.cluster(target)  # a known cluster, or ConfigError naming the known ones
        with self._lock:
            job = self.state.job(logical_job)
            if job.status.is_final():
                raise SlurmGeoError(f"logical job {logical_job} is {job.status.value}; "
                                    "there is nothing to move")
            if target == job.cluster:
                raise SlurmGeoError(f"logical job {logical_job} already runs on {target}")
            lease = self.state.lease(logical_job)
            after = lease.last_step if lease is not None else None
            job = self.state.update_job(logical_job, self.clock(), move_to=target,
                                        move_after_step=after)
        self.audit.append("approval", logical_job, f"move to {target} approved",
                          f"approved by {who}", cluster=target, after_step=after)
        return job

    # --- moving -----------------------------------------------------------------------------

    def _move(self, job: LogicalJob, target: str, reason: str,
              health: dict[str, Health], cancel_current: bool = False) -> None:
        """`cancel_current`: the current incarnation is still queued; it is cancelled once
        the generation is bumped, so if it starts meanwhile it is refused a lease."""
        with self._lock:
            job = self.state.job(job.logical_job)
            if job.status is not JobStatus.RUNNING:
                return
            target_store = self.site.cluster(target).store
            source_store = self.site.cluster(job.cluster).store
            current_up = _answering(health, job.cluster)
            if job.run and current_up and source_store != target_store:
                self._carry_newest(job, source_store, target_store)
            resume = self._newest_verified(job, target_store) if job.run else None
            if resume is False:
                return
            now = self.clock()
            moved = self.state.begin_generation(job.logical_job, job.generation + 1, target,
                                                resume, now)
            if cancel_current and job.job_id is not None:
                self.clients[job.cluster].cancel(job.job_id)
            if current_up and job.run and source_store != target_store:
                self._fence_store(moved, job.cluster)
            self._complete_move(moved, reason)

    def _complete_move(self, moved: LogicalJob, reason: str) -> None:
        """Fence the target store, then submit: the part of a move that is repeated, from
        the top, when the daemon died half-way through it (the job's status is moving)."""
        if moved.run:  # a job that never trained has no checkpoint to protect yet
            target_store = self.site.cluster(moved.cluster).store
            self._ensure_run_key(moved, target_store)
            repository = Repository(self.stores[target_store], self._key)
            write_fence(repository, Fence(moved.run, moved.generation, moved.cluster,
                                          moved.resume_step, _utc(self.clock())))
            self._drop_unadmitted(moved, repository, target_store)
            self.audit.append("fence", moved.logical_job,
                              f"run {moved.run} fenced at generation {moved.generation} for "
                              f"{moved.cluster} from step {moved.resume_step}", reason,
                              store=target_store)
        self._submit(moved)

    def _ensure_run_key(self, job: LogicalJob, store_name: str) -> None:
        """The run keeps one data key everywhere: a store without it gets the sealed key
        from a store that has it (the run may have no checkpoint off-site yet); only if
        none can be read is a new one made there (the run then starts from scratch)."""
        target = self.stores[store_name]
        name = key_name(job.run)
        if target.exists(name):
            return
        for other, store in self.stores.items():
            if other == store_name:
                continue
            try:
                target.put(name, store.get(name))
                return
            except CkptError:
                continue
        unwrap_run_key(target, self._key, job.run, create=True)

    def _carry_newest(self, job: LogicalJob, source_store: str, target_store: str) -> None:
        source = Repository(self.stores[source_store], self._key)
        steps = source.steps(job.run)
        if not steps:
            return
        started = time.monotonic()
        report = copy_checkpoint(source, self.stores[source_store], self.stores[target_store],
                                 job.run, steps[-1])
        seconds = time.monotonic() - started
        if report.bytes_copied and seconds > 0:
            self.bandwidth.observe(source_store, target_store, report.bytes_copied, seconds)
            self.state.put_bandwidth_snapshot(self.bandwidth.snapshot())
        # The fields checkpoint-sync records for its transfers: billing charges the egress.
        self.audit.append("transfer", job.logical_job,
                          f"copied {job.run}@{steps[-1]} from {source_store} to {target_store}",
                          "the job moves; its newest checkpoint goes with it",
                          bytes=report.bytes_copied, seconds=round(seconds, 3),
                          packs_copied=report.packs_copied, run=job.run, step=steps[-1],
                          source=source_store, destination=target_store,
                          source_region=self.site.stores[source_store].region,
                          destination_region=self.site.stores[target_store].region)

    def _drop_unadmitted(self, job: LogicalJob, repository: Repository,
                         store_name: str) -> None:
        """Checkpoints a stale incarnation got into the store just before the fence."""
        for step in unadmitted_steps(repository, job.run):
            repository.delete_checkpoint(job.run, step)
            self.audit.append("fence", job.logical_job, f"dropped {job.run}@{step} from "
                              f"{store_name}", "written by an incarnation the fence does "
                              "not admit", run=job.run, step=step, store=store_name)

    def _newest_verified(self, job: LogicalJob, store_name: str) -> int | None | bool:
        """The newest step the store's fence admits that verifies in full in `store_name`;
        None when the run has no such checkpoint there; False (and audited) when
        checkpoints exist but none verifies."""
        repository = Repository(self.stores[store_name], self._key)
        stale = set(unadmitted_steps(repository, job.run))
        steps = [s for s in repository.steps(job.run) if s not in stale]
        if not steps:
            self.audit.append("verify", job.logical_job, f"no checkpoint of {job.run} in "
                              f"{store_name}", "the new incarnation starts from scratch",
                              store=store_name)
            return None
        for step in reversed(steps[-VERIFY_OLDER_LIMIT:]):
            faults = repository.verify(job.run, step)
            if not faults:
                self.audit.append("verify", job.logical_job, f"{job.run}@{step} verified in "
                                  f"{store_name}", "newest checkpoint that verifies in full",
                                  run=job.run, step=step, store=store_name)
                return step
            self.audit.append("verify", job.logical_job, f"{job.run}@{step} failed "
                              f"verification in {store_name}", str(faults[0]),
                              run=job.run, step=step, faults=len(faults))
        return False

    def _submit(self, job: LogicalJob) -> None:
        cluster = self.site.cluster(job.cluster)
        store = self.site.stores[cluster.store]
        token = secrets.token_urlsafe(32)
        incoming = Incoming(job.logical_job, job.generation, job.run, job.resume_step,
                            self.config.url, token, store.url, store.endpoint_url)
        spec = resubmission(job.script, ScriptOptions.from_json(job.spec), incoming,
                            cluster.partitions, job_environment(store, os.environ))
        job_id = self.clients[job.cluster].submit(spec)
        self.state.submitted(job.logical_job, job.generation, job_id, token_digest(token),
                             self.clock())
        self.audit.append("requeue", job.logical_job,
                          f"generation {job.generation} submitted as {job.cluster}:{job_id}",
                          f"resumes {job.run} from step {job.resume_step}",
                          cluster=job.cluster, job_id=job_id, generation=job.generation,
                          run=job.run, resume_step=job.resume_step, store=cluster.store)

    def _say_once(self, key: tuple[str, ...], kind: str, logical_job: str | None, what: str,
                  why: str, **detail: Any) -> None:
        if key in self._announced:
            return
        self._announced.add(key)
        self.audit.append(kind, logical_job, what, why, **detail)


def _answering(health: dict[str, Health], cluster: str) -> bool:
    """Up, and its last probe answered: safe to wait on its controller."""
    known = health.get(cluster)
    return known is not None and known.status == UP and known.failures == 0


def _plan_summary(chosen: Plan) -> dict[str, Any]:
    return {"choice": chosen.choice, "candidates": [
        {"cluster": c.cluster, "eligible": c.eligible, "why_not": c.why_not,
         "transfer_s": c.transfer_s, "queue_wait_s": c.queue_wait_s,
         "cost_usd": round(c.cost_usd, 4)} for c in chosen.candidates]}


def _utc(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat()
