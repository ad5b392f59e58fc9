"""The federation daemon, wired: each round gathers every logical job's snapshot, asks the
pure reconciler (federation.reconcile) for its next step, and applies it.

The parts, each in its own module: the lease and key service (leaseservice), the health
and bandwidth probes (probes), moves and fencing (mover), the decisions (reconcile,
planner, leases). Everything the daemon knows is in FederationState, the stores and
Slurm, so a killed daemon picks up where it was (crash-only).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from slurm_geo.ckpt.errors import CkptError
from slurm_geo.ckpt.format.manifest import with_bases
from slurm_geo.config.model import SiteConfig
from slurm_geo.daemon.events import event
from slurm_geo.errors import ConfigError
from slurm_geo.federation.access.authn import Authenticator
from slurm_geo.federation.act.fencing import Refencer
from slurm_geo.federation.act.mover import Mover
from slurm_geo.federation.act.probes import BandwidthProbes, HealthProbes
from slurm_geo.federation.act.resubmit import Incoming, ScriptOptions, resubmission
from slurm_geo.federation.decide.bandwidth import BandwidthModel
from slurm_geo.federation.decide.owners import own_dir, owner_refusal
from slurm_geo.federation.decide.planner import (
    ClusterView,
    JobNeeds,
    Plan,
    WorldStaging,
    checkpoint_every_s,
    plan,
    policy_refusal,
)
from slurm_geo.federation.decide.reconcile import (
    PlanPurpose,
    Settings,
    Snapshot,
    Step,
    StepKind,
    failback_key,
    reconcile,
)
from slurm_geo.federation.decide.worldstaged import world_staging
from slurm_geo.federation.decide.worldwait import world_wait
from slurm_geo.federation.engine.leaseservice import LeaseService, Reply
from slurm_geo.federation.model import (
    FederationStateError,
    Health,
    IncarnationEnd,
    JobStatus,
    Lease,
    LeftHome,
    LogicalJob,
    NotActionable,
    NotLeader,
    Replica,
    answering,
)
from slurm_geo.federation.state.interface import Audit, State
from slurm_geo.federation.wiring import Wiring
from slurm_geo.lease.munge import MungeCommands, munge_socket
from slurm_geo.lease.protocol import KeyRequest, LeaseRequest
from slurm_geo.lease.signing import Credentials
from slurm_geo.policy.geo import rules_for
from slurm_geo.policy.world import World
from slurm_geo.slurm import JobInfo, JobState, SlurmClient, SlurmError
from slurm_geo.slurm.client import cancel_requester
from slurm_geo.slurm.errors import JobNotFound

log = logging.getLogger("slurm_geo.federation")


class Federation:
    def __init__(self, wiring: Wiring, probes: dict[str, SlurmClient],
                 bandwidth: BandwidthModel, authenticator: Authenticator | None = None):
        """`authenticator`: who sends each lease request; by default MUNGE's programs on
        the socket `[federation] munge_socket` or the home cluster's slurm.conf names."""
        self.wiring = wiring
        self.site, self.config, self.state = wiring.site, wiring.config, wiring.state
        self.audit, self.clients, self.clock = wiring.audit, wiring.clients, wiring.clock
        self.home = wiring.home
        if authenticator is None:
            socket = munge_socket(self.config.munge_socket,
                                  self.site.cluster(self.home).slurm_conf)
            authenticator = Authenticator(wiring.state.identities, MungeCommands(socket),
                                          wiring.clock)
        self.authenticator = authenticator
        self._probes = probes
        self._generation_lock = threading.Lock()
        self._assemble(bandwidth)
        self.rules = rules_for(wiring.site)
        self._settings = Settings(self.home, self.config.lease_ttl_s, self.config.margin_s,
                                  self.config.failback, self.config.failback_stable_s,
                                  self.site.policy.max_restarts)
        # The term this Federation acts in: a daemon alone always leads (term 0); a
        # replica has none until it leads.
        self.term: int | None = 0 if wiring.leadership is None else None

    def _assemble(self, bandwidth: BandwidthModel) -> None:
        """The parts, each with nothing in memory yet but `bandwidth`."""
        self.bandwidth = bandwidth
        self.leases = LeaseService(self.wiring, self._generation_lock, self.authenticator)
        self.mover = Mover(self.wiring, self._generation_lock, bandwidth)
        self.refencer = Refencer(self.wiring)
        self.health = HealthProbes(self.wiring, self._probes)
        self.bandwidth_probes = BandwidthProbes(self.wiring, bandwidth)
        # Per job away from home: what its failback was last planned for (see reconcile).
        self._failback_planned: dict[str, tuple[int | None, float]] = {}

    # --- leadership -------------------------------------------------------------------------

    def leading_term(self) -> int | None:
        """The term this daemon leads in now (0 for one alone on SQLite); None while it
        follows another replica."""
        leadership = self.wiring.leadership
        return 0 if leadership is None else leadership.current_term()

    def begin_term(self, term: int) -> None:
        """This replica leads from now on, in `term`. Another replica decided meanwhile,
        so what this one held in memory is forgotten and read again, as at a start: every
        live lease counts as renewed now (jobs could not renew while nobody led), the
        bandwidth model is the state's, signatures made before now are refused (another
        replica saw their nonces), and what was said once is said again."""
        now = self.clock()
        self.state.refresh_leases(now)
        self.authenticator.refuse_signed_before(now)
        self.wiring.forget_announcements()
        self._assemble(BandwidthModel.restore(self.state.bandwidth_snapshot()))
        self.term = term

    def leader(self) -> Replica | None:
        """Who leads, as the state says now: this daemon, when it is alone."""
        leadership = self.wiring.leadership
        if leadership is None:
            me = self.config.this_replica
            return Replica(me.name, me.site, me.url)
        return leadership.leader()

    def reload(self, site: SiteConfig) -> None:
        """Take a re-read config (SIGHUP) from the next round and the next lease on: the
        [federation] timings and failback, [policy], the stores' job_credentials. The caller
        keeps what was opened at the start (clusters, stores, databases) as it was."""
        config = site.federation
        if config is None:
            raise ConfigError(f"{site.source} has no [federation] table")
        self.wiring.site, self.wiring.config = site, config
        self.site, self.config = site, config
        self.health.outage_after = config.outage_after
        self.rules = rules_for(site)
        self._settings = Settings(self.home, config.lease_ttl_s, config.margin_s,
                                  config.failback, config.failback_stable_s,
                                  site.policy.max_restarts)

    def probe_all(self) -> dict[str, Health]:
        return self.health.probe_all()

    # --- the loop ---------------------------------------------------------------------------

    def tick(self, health: dict[str, Health] | None = None) -> None:
        """One round over every logical job; `health` from a probe loop running beside
        (the daemon's), else probed now."""
        health = self.probe_all() if health is None else health
        self.bandwidth_probes.learn_from_sync()
        self.bandwidth_probes.probe()
        if answering(health, self.home):
            try:
                self.leases.discover_pending()
                self.leases.learn_environments(self.state.jobs())
            except SlurmError as exc:
                event(log, "discover_failed", logging.WARNING, error=exc)
        for job in self.state.jobs():
            try:
                self.reconcile_job(job, health)
            except NotLeader:
                raise  # another replica leads: this one decides nothing more
            # ConfigError: a store's job_credentials file went bad after the start; the
            # move is finished in a later round, once it is mended.
            except (SlurmError, CkptError, ConfigError, FederationStateError) as exc:
                event(log, "reconcile_failed", logging.WARNING, job=job.logical_job, error=exc)
        self.refencer.round(self.state.jobs())

    def reconcile_job(self, job: LogicalJob, health: dict[str, Health]) -> Step:
        _hold_for_world(self, job, job.move_to, health)  # before the trainer is released
        snapshot = self.snapshot(job, health)
        step = reconcile(snapshot, self._settings)
        if step.kind is StepKind.PLAN:
            chosen = self.plan_for(job, health, current_wait=step.current_wait_s)
            if step.purpose is PlanPurpose.FAILBACK:
                self._failback_planned[job.logical_job] = failback_key(snapshot)
            step = reconcile(replace(snapshot, plan=chosen), self._settings)
        self._apply(job, snapshot, step, health)
        return step

    def snapshot(self, job: LogicalJob, health: dict[str, Health]) -> Snapshot:
        # A cancelled job's current incarnation is stale too: `slurm-geo cancel` may not
        # have reached its cluster.
        cancelled = job.status is JobStatus.CANCELLED
        stale = tuple(i for i in self.state.incarnations(job.logical_job)
                      if (i.generation < job.generation or cancelled) and i.ended_at is None
                      and answering(health, i.cluster))
        info = None
        if job.status is JobStatus.RUNNING and answering(health, job.cluster):
            info = _slurm_job(self.clients, job)
        return Snapshot(job, self.state.lease(job.logical_job), info, health, self.clock(),
                        stale, failback_planned_for=self._failback_planned.get(job.logical_job))

    def _apply(self, job: LogicalJob, snap: Snapshot, step: Step,
               health: dict[str, Health]) -> None:
        kind, w = step.kind, self.wiring
        if kind is StepKind.FENCE_STALE:
            self.mover.fence_stale(job, step.stale)
        elif kind is StepKind.COMPLETE_MOVE:
            self.mover.complete(self.state.job(job.logical_job), step.reason)
        elif kind in (StepKind.MOVE, StepKind.RESTART_LOST):
            assert step.target is not None
            if not _hold_for_world(self, job, step.target, health):
                self._move(job, step, health)
        elif kind is StepKind.OWNER_CANCELLED:
            self._failback_planned.pop(job.logical_job, None)
            _owner_cancelled(self.state, self.audit, self.clock(), job, snap.slurm, step.reason)
        elif kind in (StepKind.FINISH, StepKind.GIVE_UP):
            if kind is StepKind.GIVE_UP:
                self.audit.append("decision", job.logical_job, "give up", step.reason,
                                  cluster=job.cluster)
            self._finish(job, snap, step.state or JobState.UNKNOWN,
                         gave_up=kind is StepKind.GIVE_UP)
        elif kind is StepKind.HOLD_FOR_LEASE:
            w.say_once(("lease", job.logical_job, str(job.generation)), "decision",
                       job.logical_job, "waiting to move until the lease runs out",
                       step.reason)
        elif kind is StepKind.STRANDED:
            w.say_once(("stranded", job.logical_job, str(job.generation)), "decision",
                       job.logical_job, f"job stays on {job.cluster}", step.reason,
                       plan=_plan_summary(step.plan))
        elif kind is StepKind.AWAIT_APPROVAL:
            self.state.await_approval(job.logical_job, step.target, self.clock())
            w.say_once(("approval", job.logical_job, str(job.generation)), "decision",
                       job.logical_job, f"move to {step.target} needs approval", step.reason,
                       plan=_plan_summary(step.plan))
        elif kind is StepKind.PLAN_FAILBACK:
            assert step.target is not None
            self.state.plan_move(job.logical_job, job.generation, step.target,
                                 step.after_step, self.clock())
            _hold_for_world(self, job, step.target, health)  # before its next renewal
            self.audit.append("decision", job.logical_job, f"fail back to {step.target} at "
                              "the next checkpoint", step.reason, after_step=step.after_step,
                              plan=_plan_summary(step.plan))

    def _move(self, job: LogicalJob, step: Step, health: dict[str, Health]) -> None:
        assert step.target is not None
        restart = step.kind is StepKind.RESTART_LOST
        if step.plan is not None:
            what = f"restart on {step.target}" if restart else f"move to {step.target}"
            self.audit.append("decision", job.logical_job, what, step.reason,
                              plan=_plan_summary(step.plan))
        if restart:
            self.state.count_lost_restart(job.logical_job, self.clock())
        self.mover.move(job, step.target, step.reason, health,
                        cancel_current=step.cancel_current, left_home=step.left_home,
                        recovery=restart or step.left_home is LeftHome.OUTAGE)

    def _finish(self, job: LogicalJob, snap: Snapshot, state: JobState,
                gave_up: bool = False) -> None:
        """`gave_up`: lost past max_restarts, failed whatever Slurm says (a controller
        restarted under a killed job can report it COMPLETED)."""
        now = self.clock()
        done = state is JobState.COMPLETED and not gave_up
        status = JobStatus.COMPLETED if done else JobStatus.FAILED
        self.state.move_status(job.logical_job, JobStatus.RUNNING, status, now)
        self.state.end_incarnation(job.logical_job, job.generation,
                                   IncarnationEnd.from_slurm(state), now)
        self._failback_planned.pop(job.logical_job, None)
        lease = snap.lease
        trained = lease is not None and lease.generation == job.generation
        if job.generation > 0 and not trained:
            info = snap.slurm
            exit_code = None if info is None else info.exit_code
            self.audit.append("requeue", job.logical_job,
                              f"generation {job.generation} on {job.cluster}:{job.job_id} "
                              f"ended {state.value} before its first lease",
                              f"the job never asked for a lease (exit code {exit_code}); "
                              "see its output (`slurm-geo logs "
                              f"{job.logical_job}`)", cluster=job.cluster,
                              job_id=job.job_id, exit_code=exit_code)
        self.audit.append("finished", job.logical_job,
                          f"generation {job.generation} on {job.cluster}:{job.job_id} ended "
                          f"{state.value}", "Slurm reports the job finished",
                          cluster=job.cluster, job_id=job.job_id,
                          last_step=lease.last_step if trained and lease else None)

    # --- what people ask of it ----------------------------------------------------------------

    def lease(self, request: LeaseRequest, credentials: Credentials) -> Reply:
        return self.leases.lease(request, credentials)

    def key(self, request: KeyRequest, credentials: Credentials) -> Reply:
        return self.leases.key(request, credentials)

    def plan_for(self, job: LogicalJob, health: dict[str, Health] | None = None,
                 current_wait: float | None = None) -> Plan:
        """Where `job` should run now (also what `slurm-geo plan` prints). `current_wait`:
        Slurm's estimate for the job where it is queued now."""
        health = health if health is not None else self.state.health()
        options = ScriptOptions.from_json(job.spec)
        source_store = self.wiring.store_of(job.cluster)
        world = _world_staging(self.wiring, job, options, answering(health, self.home))
        needs = JobNeeds(
            logical_job=job.logical_job, home=self.home, current=job.cluster,
            nodes=options.nodes, cpus=options.nodes * options.cpus_per_task,
            gpus=options.gpus, remaining_s=60.0 * (options.time_limit_minutes or 60),
            checkpoint_bytes=_checkpoint_bytes(self.wiring, job, source_store),
            checkpoint_store=source_store, directives=options.directives(), world=world,
            checkpoint_every_s=None if world is None else _cadence_s(
                self.wiring, job, source_store, options.directives().ckpt_interval_min))
        views = [self._view(name, health, options, job,
                            current_wait if name == job.cluster else None)
                 for name in self.clients]
        regions = {name: store.region for name, store in self.site.stores.items()}
        return plan(needs, views, self.rules, self.bandwidth.predict_seconds,
                    store_regions=regions, margin_s=self.config.margin_s)

    def _view(self, name: str, health: dict[str, Health], options: ScriptOptions,
              job: LogicalJob, known_wait: float | None) -> ClusterView:
        cluster = self.site.cluster(name)
        up = answering(health, name)
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
                           federation_sibling=sibling,
                           owner_refused=owner_refusal(cluster, job.owner),
                           world_fetch_mb_s=None if own_dir(cluster, job.owner) is None
                           else cluster.world_fetch_mb_s)

    def _queue_wait(self, name: str, options: ScriptOptions, job: LogicalJob) -> float | None:
        if name == job.cluster and job.status is JobStatus.RUNNING:
            lease = self.state.lease(job.logical_job)
            if lease is not None and not lease.expired(self.clock(), self.config.lease_ttl_s):
                return 0.0  # it is training there now
        spec = resubmission(job.script, options, Incoming(job.logical_job, 0, job.run, None,
                                                          "", "", ""),
                            self.site.cluster(name).partitions, owner=job.owner)
        try:
            start = self.clients[name].expected_start(spec)
        except SlurmError:
            return None
        if start is None:
            return None
        return max(0.0, start.timestamp() - self.clock())

    def approve(self, logical_job: str, target: str, who: str) -> LogicalJob:
        """A person's consent to move a job (`approved_move`)."""
        return approved_move(self, logical_job, target, who)


def approved_move(fed: Federation, logical_job: str, target: str, who: str) -> LogicalJob:
    """A person's consent to move a job that did not ask --geo-failover=auto. A job whose
    cluster is out, or that is still queued, moves as soon as the plan chooses `target`;
    a running job moves at its next checkpoint. Never where the job's policy forbids it
    (residency, data classes, --geo-clusters, an owner with no account there): consent
    is not a way round the site's rules."""
    cluster = fed.site.cluster(target)  # a known cluster, or ConfigError naming them
    job = fed.state.job(logical_job)
    if job.status.is_final():
        raise NotActionable(f"logical job {logical_job} is {job.status.value}; "
                            "there is nothing to move")
    if target == job.cluster:
        raise NotActionable(f"logical job {logical_job} already runs on {target}")
    refused = policy_refusal(ScriptOptions.from_json(job.spec).directives(), fed.rules,
                             target, owner_refusal(cluster, job.owner))
    if refused:
        raise NotActionable(f"logical job {logical_job} may not move to {target}: {refused}")
    after = _current_step(job, fed.state.lease(logical_job))
    job = fed.state.plan_move(logical_job, job.generation, target, after, fed.clock())
    fed.audit.append("approval", logical_job, f"move to {target} approved",
                     f"approved by {who}", cluster=target, after_step=after)
    return job


def _checkpoint_bytes(wiring: Wiring, job: LogicalJob, store_name: str) -> int:
    """Stored size of the run's newest checkpoint: what a move must carry (0 if none)."""
    try:
        repository = wiring.repository(store_name)
        steps = repository.steps(job.run)
        if not steps:
            return 0
        manifest = repository.manifest(job.run, steps[-1])
    except CkptError:
        return 0
    return sum({ref.id: ref.length for ref in with_bases(manifest.refs())}.values())


def _cadence_s(wiring: Wiring, job: LogicalJob, store_name: str,
               declared_min: int | None) -> float | None:
    """How often the job checkpoints (planner.checkpoint_every_s): from its newest
    checkpoints' times, else its --geo-ckpt-interval."""
    return checkpoint_every_s(_checkpoint_times(wiring, job, store_name),
                              None if declared_min is None else 60.0 * declared_min)


def _checkpoint_times(wiring: Wiring, job: LogicalJob, store_name: str,
                      newest: int = 5) -> list[float]:
    """When the run's `newest` checkpoints were made (Unix seconds; none unreadable): how
    often the job checkpoints, which a world staged meanwhile shares the link with."""
    try:
        repository = wiring.repository(store_name)
        made = [repository.manifest(job.run, step).metadata.created_at
                for step in repository.steps(job.run)[-newest:]]
    except CkptError:
        return []
    times = []
    for text in made:
        try:
            moment = datetime.fromisoformat(text)
        except ValueError:
            continue
        times.append((moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp())
    return times


def _owner_cancelled(state: State, audit: Audit, now: float, job: LogicalJob,
                     info: JobInfo | None, reason: str) -> None:
    """Its owner's scancel: cancelled as `slurm-geo cancel` would (status first, then the
    lease), audited as a cancel by her (slurm_geo.federation.decide.cancels)."""
    state.move_status(job.logical_job, JobStatus.RUNNING, JobStatus.CANCELLED, now)
    state.end_incarnation(job.logical_job, job.generation, IncarnationEnd.CANCELLED, now)
    state.release_lease(job.logical_job)
    who = job.owner.user if job.owner is not None else ("" if info is None else info.user)
    audit.append("cancel", job.logical_job, f"cancelled at generation {job.generation}",
                 f"by {who} with scancel: {reason}; a job its owner cancelled is never "
                 "restarted", who=who, via="scancel", cluster=job.cluster, job_id=job.job_id,
                 cancelled_by=None if info is None else info.cancelled_by)


def _slurm_job(clients: dict[str, SlurmClient], job: LogicalJob) -> JobInfo | None:
    if job.job_id is None:
        return None
    client = clients[job.cluster]
    try:
        info = client.job(job.job_id)
    except JobNotFound:
        return None
    if info.state is JobState.CANCELLED and info.cancelled_by is None:
        # slurmctld does not say who cancelled a job; accounting does (federation.cancels).
        try:
            requester = cancel_requester(client.accounting([job.job_id]))
        except SlurmError as exc:
            event(log, "cancel_requester_unknown", logging.WARNING, job=job.logical_job,
                  error=exc)
            return info
        info = replace(info, cancelled_by=requester)
    return info


def _current_step(job: LogicalJob, lease: Lease | None) -> int | None:
    return lease.last_step if lease is not None and lease.generation == job.generation \
        else None


def _plan_summary(chosen: Plan | None) -> dict[str, Any] | None:
    if chosen is None:
        return None
    return {"choice": chosen.choice, "candidates": [
        {"cluster": c.cluster, "eligible": c.eligible, "why_not": c.why_not,
         "transfer_s": c.transfer_s, "queue_wait_s": c.queue_wait_s,
         "cost_usd": round(c.cost_usd, 4)} for c in chosen.candidates]}


def _world_staging(wiring: Wiring, job: LogicalJob, options: ScriptOptions,
                   home_up: bool) -> WorldStaging | None:
    """The job's inputs and env as staging has them (federation.planner.WorldStaging);
    None when it declares neither. Complete in each store that holds the run's world
    record (federation.worldstaged); its size read from home's store while home answers;
    of unknown size while no store holds it, so such a job is not moved off a lost home
    before its world is off-site."""
    world = World.of(options.directives())
    if not world.inputs and world.env is None:
        return None
    return world_staging(wiring.stores, wiring.master_keys, wiring.store_of(job.home),
                         job.run, source_up=home_up)


def _hold_for_world(fed: Federation, job: LogicalJob, target: str | None,
                    health: dict[str, Health]) -> str:
    """Why a move of `job` to `target`, decided while its cluster answers, waits for the
    job's world there ('' when it need not: federation.worldwait). Kept for the lease
    service (a trainer asked to move keeps training meanwhile) and said once in the audit
    log with the plan's prediction for the target."""
    waits = fed.leases.move_waits
    if target is None:
        waits.pop(job.logical_job, None)
        return ""
    if target == job.cluster or not answering(health, job.cluster):
        waits[job.logical_job] = (target, "")
        return ""
    world = _world_staging(fed.wiring, job, ScriptOptions.from_json(job.spec),
                           answering(health, fed.home))
    store = fed.wiring.store_of(target)
    why = world_wait(world, target, store, fed.bandwidth.predict_seconds)
    said = waits.get(job.logical_job, ("", ""))
    waits[job.logical_job] = (target, why)
    if not why:
        return ""
    if said[0] != target or not said[1]:  # a new wait: its prediction on record
        chosen = fed.plan_for(job, health)
        there = next((c for c in chosen.candidates if c.cluster == target), None)
        fed.wiring.say_once(
            ("world", job.logical_job, str(job.generation), target), "decision",
            job.logical_job, f"move to {target} waits for its world", why, target=target,
            missing_bytes=None if world is None else world.missing(store),
            predicted_s=None if there is None else there.total_s,
            plan=_plan_summary(chosen))
    return why
