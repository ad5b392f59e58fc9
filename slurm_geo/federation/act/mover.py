"""Moving a logical job to a new generation, and fencing the ones it leaves behind.

A move, in order (each step is safe to repeat if the daemon dies after it):
  1. the newest checkpoint of the run that is verified in the target cluster's store is
     chosen (copied there first when the current cluster is still up: a failback): from
     its verification record and a presence check of its objects, reading nothing back
     (federation.resumepoint); one without a record is read and verified in full;
  2. the generation goes up, a compare-and-set that also fails if the job's lease was
     renewed meanwhile: from now on the old incarnation gets no lease;
  3. the target store is fenced: only the new generation's cluster may commit past the
     resume step there (and the old store too, when it can be reached); fences are read
     and written the daemon's way (federation.fencing: its state's word counts); a run
     that leaves a rented cluster gets a new data key there (`rotates_run_key`), so the
     provider, which held the old one, cannot open what the run saves from now on;
  4. the job is submitted on the target with its resume pointer, the secret it signs its
     lease requests with (stored first: it may ask as soon as it starts), a one-time
     token for its run's data key and the CA to verify the daemon's https against, as
     its owner, with the environment federation.owners builds (a job without a recorded
     owner is never submitted: OwnerUnknown, before step 1).
Steps 1, 3 and 4 copy, read and call Slurm; only step 2 holds the daemon's generation
lock, which lease renewals share, so a long copy stalls no other job's trainer.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from dataclasses import replace
from datetime import UTC, datetime

from slurm_geo.ckpt import Repository
from slurm_geo.ckpt.errors import (
    CkptError,
    CorruptObject,
    ImmutableCheckpoint,
    UnsupportedFormat,
    WrongKey,
)
from slurm_geo.ckpt.format.names import key_name
from slurm_geo.ckpt.ops.replicate import copy_checkpoint
from slurm_geo.ckpt.ops.verified import record_of, write_record
from slurm_geo.ckpt.repo.fence import Fence, unadmitted_steps
from slurm_geo.ckpt.repo.runkey import rotate_run_keys, unwrap_run_keys
from slurm_geo.config.model import ClusterConfig
from slurm_geo.federation.access.tls import ca_pem
from slurm_geo.federation.act.credentials import job_environment
from slurm_geo.federation.act.fencing import daemon_lookup, known_fence, set_fence
from slurm_geo.federation.act.probes import nodes_up
from slurm_geo.federation.act.registration import learn_environment
from slurm_geo.federation.act.resubmit import Incoming, ScriptOptions, fitted, resubmission
from slurm_geo.federation.act.resumepoint import FROM_SCRATCH, newest_verified
from slurm_geo.federation.decide.bandwidth import BandwidthModel
from slurm_geo.federation.decide.owners import own_dir, owner_environment
from slurm_geo.federation.model import (
    Health,
    Incarnation,
    IncarnationEnd,
    JobStatus,
    LeftHome,
    LogicalJob,
    OwnerUnknown,
    StaleJob,
    answering,
    token_digest,
)
from slurm_geo.federation.wiring import Wiring
from slurm_geo.lease.signing import new_secret
from slurm_geo.slurm import SlurmError
from slurm_geo.slurm.errors import JobNotFound

log = logging.getLogger("slurm_geo.federation")


class Mover:
    def __init__(self, wiring: Wiring, generation_lock: threading.Lock,
                 bandwidth: BandwidthModel):
        self.wiring = wiring
        self._lock = generation_lock
        self.bandwidth = bandwidth

    def move(self, job: LogicalJob, target: str, reason: str, health: dict[str, Health], *,
             cancel_current: bool = False, left_home: LeftHome | None = None,
             recovery: bool = False) -> LogicalJob | None:
        """`job` (RUNNING, or FAILED for a resubmission) to a new generation on `target`;
        None when nothing moved (no checkpoint verifies, or the job changed meanwhile).
        `cancel_current`: the current incarnation is still queued; it is cancelled once
        the generation is bumped, so if it starts meanwhile it is refused a lease."""
        w = self.wiring
        job = w.state.job(job.logical_job)
        if job.status not in (JobStatus.RUNNING, JobStatus.FAILED):
            return None
        self._check_owner(job)
        target_store, source_store = w.store_of(target), w.store_of(job.cluster)
        current_up = answering(health, job.cluster)
        carries = bool(job.run) and current_up and source_store != target_store
        if carries:
            self._carry_newest(job, source_store, target_store)
        resume = newest_verified(w, job, target_store) if job.run else FROM_SCRATCH
        if resume.refused:
            return None
        try:
            with self._lock:
                moved = w.state.begin_generation(
                    job.logical_job, job.generation, target, resume.step, w.clock(),
                    left_home=left_home, recovery=recovery,
                    live_lease_ttl_s=w.config.lease_ttl_s)
        except StaleJob as exc:
            w.audit.append("decision", job.logical_job, f"move to {target} abandoned", str(exc),
                           generation=job.generation)
            return None
        if cancel_current and job.job_id is not None:
            w.clients[job.cluster].cancel(job.job_id)
        if carries:
            self._fence_store(moved, job.cluster)
        return self.complete(moved, reason)

    def complete(self, moved: LogicalJob, reason: str) -> LogicalJob:
        """Fence the target store, then submit: the part of a move that is repeated, from
        the top, when the daemon died half-way through it (the job's status is moving)."""
        w = self.wiring
        w.state.confirm_leading()  # a fence is no etcd write: a deposed leader sets none
        if moved.run:  # a job that never trained has no checkpoint to protect yet
            target_store = w.store_of(moved.cluster)
            self._ensure_run_key(moved, target_store)
            repository = w.repository(target_store)
            self._rotate_run_key(moved, repository, target_store)
            set_fence(repository, Fence(moved.run, moved.generation, moved.cluster,
                                        moved.resume_step, _utc(w.clock())))
            self._drop_unadmitted(moved, repository, target_store)
            w.audit.append("fence", moved.logical_job,
                           f"run {moved.run} fenced at generation {moved.generation} for "
                           f"{moved.cluster} from step {moved.resume_step}", reason,
                           store=target_store)
        return self._submit(moved)

    def _rotate_run_key(self, moved: LogicalJob, repository: Repository,
                        store_name: str) -> None:
        """A new data key for the run when it leaves a rented cluster (docs/format.md
        §4.2), before the new incarnation is given its keys. Repeated when the daemon died
        mid-move: one more key in the ring, which costs nothing but a full next save."""
        w = self.wiring
        left = _left(w.state.incarnations(moved.logical_job), moved.generation)
        if left is None or not rotates_run_key(w.site.cluster(left),
                                               w.site.cluster(moved.cluster)):
            return
        ring = rotate_run_keys(repository, moved.run)
        w.audit.append("key", moved.logical_job,
                       f"rotated run {moved.run}'s data key in {store_name} "
                       f"({len(ring.keys)} keys in its ring)",
                       f"the run leaves rented cluster {left}, whose jobs held its key: "
                       "what it saves from now on is sealed under a key they never had",
                       store=store_name, generation=moved.generation)

    def fence_stale(self, job: LogicalJob, stale: tuple[Incarnation, ...]) -> None:
        """Cancel older incarnations still known to Slurm (their clusters answer)."""
        w = self.wiring
        for incarnation in stale:
            w.state.confirm_leading()
            cluster = incarnation.cluster
            reason = IncarnationEnd.ENDED
            if incarnation.job_id is not None:
                try:
                    info = w.clients[cluster].job(incarnation.job_id)
                except JobNotFound:
                    info = None
                if info is not None and not info.state.is_terminal():
                    w.clients[cluster].cancel(incarnation.job_id)
                    reason = IncarnationEnd.FENCED
            self._fence_store(job, cluster)
            w.state.end_incarnation(job.logical_job, incarnation.generation, reason,
                                    w.clock())
            w.audit.append("fence", job.logical_job,
                           f"generation {incarnation.generation} on {cluster}:"
                           f"{incarnation.job_id} {reason}",
                           f"the job is at generation {job.generation} on {job.cluster}",
                           cluster=cluster, job_id=incarnation.job_id,
                           generation=incarnation.generation)

    def _fence_store(self, job: LogicalJob, cluster: str) -> None:
        """Fence the run in `cluster`'s store too, now that it can be reached."""
        w = self.wiring
        store_name = w.store_of(cluster)
        if not job.run or store_name == w.store_of(job.cluster) \
                or not w.stores[store_name].exists(key_name(job.run)):
            return  # nothing of the run is there to fence
        fence = Fence(job.run, job.generation, job.cluster, job.resume_step, _utc(w.clock()))
        set_fence(w.repository(store_name), fence)

    def _ensure_run_key(self, job: LogicalJob, store_name: str) -> None:
        """The run keeps one data key everywhere: a store without it gets the sealed key
        from a store that has it (the run may have no checkpoint off-site yet); only if
        none can be read is a new one made there (the run then starts from scratch)."""
        stores = self.wiring.stores
        target = stores[store_name]
        name = key_name(job.run)
        if target.exists(name):
            return
        for other, store in stores.items():
            if other == store_name:
                continue
            try:
                target.put(name, store.get(name))
                return
            except CkptError:
                continue
        unwrap_run_keys(target, self.wiring.master_keys, job.run, create=True)

    def _carry_newest(self, job: LogicalJob, source_store: str, target_store: str) -> None:
        w = self.wiring
        source, target = w.paced_stores[source_store], w.paced_stores[target_store]
        repository = w.repository(source_store, paced=True)
        steps = repository.steps(job.run)
        if not steps:
            return
        started = time.monotonic()
        report = copy_checkpoint(repository, source, target, job.run, steps[-1],
                                 fence=daemon_lookup(known_fence(job)))
        write_record(w.repository(target_store, paced=True),
                     record_of(report, w.clock(), "federation"))
        seconds = time.monotonic() - started
        if report.bytes_copied and seconds > 0:
            self.bandwidth.observe(source_store, target_store, report.bytes_copied, seconds)
            w.state.put_bandwidth_snapshot(self.bandwidth.snapshot())
        # The fields checkpoint-sync records for its transfers: billing charges the egress.
        w.audit.append("transfer", job.logical_job,
                       f"copied {job.run}@{steps[-1]} from {source_store} to {target_store}",
                       "the job moves; its newest checkpoint goes with it"
                       + ("; its latest pointer there is the owner's own and was left as it"
                          " was (the incarnation is told the step)" if report.latest_left
                          else ""),
                       bytes=report.bytes_copied, seconds=round(seconds, 3),
                       packs_copied=report.packs_copied, run=job.run, step=steps[-1],
                       source=source_store, destination=target_store,
                       source_region=w.site.stores[source_store].region,
                       destination_region=w.site.stores[target_store].region)

    def _drop_unadmitted(self, job: LogicalJob, repository: Repository,
                         store_name: str) -> None:
        """Checkpoints a stale incarnation got into the store just before the fence. One
        a marker keeps (promoted, or a marker that does not open: a job may have made it)
        stays, audited: the fence keeps it from being resumed, and the move goes on."""
        for step in unadmitted_steps(repository, job.run, daemon_lookup(known_fence(job))):
            try:
                repository.delete_checkpoint(job.run, step)
            except (ImmutableCheckpoint, UnsupportedFormat, WrongKey, CorruptObject) as exc:
                self.wiring.audit.append("fence", job.logical_job, f"kept {job.run}@{step} "
                                         f"in {store_name}", f"not admitted by the fence, "
                                         f"but not deleted: {exc}", run=job.run, step=step,
                                         store=store_name)
                continue
            self.wiring.audit.append("fence", job.logical_job, f"dropped {job.run}@{step} "
                                     f"from {store_name}", "written by an incarnation the "
                                     "fence does not admit", run=job.run, step=step,
                                     store=store_name)

    def _nodes_up(self, cluster: str) -> int | None:
        """Nodes of `cluster` that can take a job now; None when it does not say."""
        try:
            return nodes_up(self.wiring.clients[cluster])
        except SlurmError:
            return None

    def _check_owner(self, job: LogicalJob) -> None:
        """Never submit a job without its owner: it would run as the daemon's account."""
        if job.owner is None:
            self.wiring.say_once(("no-owner", job.logical_job), "decision", job.logical_job,
                                 "not submitted: the job's owner is unknown",
                                 str(OwnerUnknown(job.logical_job)))
            raise OwnerUnknown(job.logical_job)

    def _submit(self, job: LogicalJob) -> LogicalJob:
        w = self.wiring
        self._check_owner(job)
        cluster = w.site.cluster(job.cluster)
        store = w.site.stores[cluster.store]
        token, secret = secrets.token_urlsafe(32), new_secret()
        ca = "" if w.config.ca_file is None else ca_pem(w.config.ca_file)
        w.state.identities.put_secret(job.logical_job, job.generation, secret)
        incoming = Incoming(job.logical_job, job.generation, job.run, job.resume_step,
                            w.config.url, token, store.url, store.endpoint_url,
                            federation_ca=ca, lease_secret=secret,
                            federation_urls=w.config.job_urls)
        if not job.owner_env and learn_environment(w, job):  # slurmdbd may have it now
            job = replace(job, owner_env=w.state.job(job.logical_job).owner_env)
        if not job.owner_env:
            w.say_once(("no-owner-env", job.logical_job), "decision", job.logical_job,
                       "submitted with Slurm's default environment",
                       "slurmdbd never recorded the environment the owner submitted with "
                       "(AccountingStoreFlags=job_env), so PATH, modules and virtualenv are "
                       "the cluster's defaults")
        # The daemon's own environment reaches the job only through what
        # job_environment scopes for the store (federation.owners).
        asked = ScriptOptions.from_json(job.spec)
        options = fitted(asked, self._nodes_up(job.cluster) if asked.max_nodes else None)
        if asked.max_nodes is not None:
            w.audit.append("decision", job.logical_job, f"generation {job.generation} gets "
                           f"{options.nodes} nodes on {job.cluster}",
                           f"the job asks for {asked.nodes}-{asked.max_nodes} nodes; "
                           "that many are up there",
                           cluster=job.cluster, nodes=options.nodes)
        spec = resubmission(job.script, options, incoming,
                            cluster.partitions, owner=job.owner,
                            owner_env=owner_environment(job.owner_env,
                                                        same_account=cluster.access == "cli"),
                            store_env=job_environment(store, os.environ, job.run),
                            at_home=job.cluster == job.home,
                            own_dir=own_dir(cluster, job.owner),
                            preamble_python=None if cluster.python is None
                            else str(cluster.python))
        try:
            w.state.confirm_leading()  # etcd cannot refuse a submission: ask it first
            job_id = w.clients[job.cluster].submit(spec)
        except SlurmError as exc:
            w.say_once(("submit-failed", job.logical_job, str(job.generation), str(exc)),
                       "requeue", job.logical_job, f"generation {job.generation} could not "
                       f"be submitted on {job.cluster}", str(exc), cluster=job.cluster,
                       generation=job.generation)
            raise
        try:
            moved = w.state.submitted(job.logical_job, job.generation, job_id,
                                      token_digest(token), w.clock())
        except StaleJob as exc:  # cancelled by a person while the move ran
            w.clients[job.cluster].cancel(job_id)
            w.audit.append("requeue", job.logical_job, f"cancelled {job.cluster}:{job_id} "
                           "just submitted", str(exc), cluster=job.cluster, job_id=job_id)
            return w.state.job(job.logical_job)
        w.audit.append("requeue", job.logical_job,
                       f"generation {job.generation} submitted as {job.cluster}:{job_id}",
                       f"resumes {job.run} from step {job.resume_step}",
                       cluster=job.cluster, job_id=job_id, generation=job.generation,
                       run=job.run, resume_step=job.resume_step, store=cluster.store)
        return moved


def _utc(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat()


def rotates_run_key(left: ClusterConfig, target: ClusterConfig) -> bool:
    """Whether a run moving from `left` to `target` gets a new data key: when it leaves a
    cluster someone else runs (reached through slurmrestd, `access = "rest"`), whose
    provider held the run's key while its jobs ran there. A site's own clusters run under
    the site's control, and a requeue on the same cluster leaves nothing."""
    return left.access == "rest" and left.name != target.name


def _left(incarnations: list[Incarnation], generation: int) -> str | None:
    """The cluster of the newest incarnation before `generation`: the one the run left."""
    older = [i for i in incarnations if i.generation < generation]
    return max(older, key=lambda i: i.generation).cluster if older else None
