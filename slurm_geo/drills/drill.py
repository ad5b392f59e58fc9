"""`slurm-geo drill`: lose the home cluster (or the whole home site, or the leading
federation replica) on purpose and measure the recovery.

In the sandbox: a real PyTorch job with geo directives is submitted to `onprem`; once at
least two of its checkpoints are verified off-site, the loss is struck (drills.losses:
the sandbox's own pids, nothing else). The federation detects the outage, plans, and
requeues the job on `rented` through slurmrestd; the job resumes from the newest
verified checkpoint and completes. Its final weights are compared with an uninterrupted
reference run, and home is brought back, which lets the leader fence the stale
incarnation. A site or leader loss also times the leader's failover and names the
replica that wrote each decision.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from slurm_geo.config.model import SiteConfig, load_config
from slurm_geo.drills import figures, losses, sharded, wan, world
from slurm_geo.drills.picture import draw_timeline
from slurm_geo.drills.report import DrillReport, Sample
from slurm_geo.drills.settings import DrillSettings
from slurm_geo.drills.waits import DrillFailed, Progress, wait_for, wait_or_none
from slurm_geo.federation.state.audit import Entry
from slurm_geo.sandbox import Sandbox, netns
from slurm_geo.sandbox.layout import SandboxLayout
from slurm_geo.sandbox.sites import Site
from slurm_geo.sandbox.users import ALICE, SandboxUser, job_environment
from slurm_geo.slurm import JobSpec, SlurmClient, SlurmError, connect
from slurm_geo.sync.reader import SyncStateReader


class Audited(Protocol):
    """An audit log to read: the SQLite one, or the replicas' in etcd."""

    def entries(self, logical_job: str | None = None) -> list[Entry]: ...


@dataclass(frozen=True)
class Training:
    """A federated training job submitted to the home cluster."""

    run: str
    cluster: str
    job_id: int
    work: Path    # its outputs: train-CLUSTER-JOB.out per incarnation, trace.log
    trace: Path   # 'time generation cluster:job step' per trained step, every incarnation
    # Where its incarnations on a cluster with none of home's files write the same (the
    # provider's /home/geo-alice/RUN), as the sandbox's operator reads it: a test oracle;
    # bringing outputs home is the federation's (issue 31).
    remote_work: Path | None = None

    @property
    def logical_job(self) -> str:
        return f"{self.cluster}-{self.job_id}"

    @property
    def dirs(self) -> list[Path]:
        return [self.work, *([self.remote_work] if self.remote_work else [])]

    @property
    def traces(self) -> list[Path]:
        return [self.trace, *([self.remote_work / self.trace.name] if self.remote_work
                              else [])]


def run_drill(sandbox: Sandbox, settings: DrillSettings, out_dir: Path,
              progress: Progress = print) -> DrillReport:
    if settings.lose not in losses.LOSSES:
        raise DrillFailed(f"--lose {settings.lose}: choose one of {', '.join(losses.LOSSES)}")
    if settings.lose != "cluster" and not sandbox.layout.replicated:
        raise DrillFailed(f"--lose {settings.lose} needs federation replicas at home and "
                          f"control: slurm-geo sandbox down --purge, then slurm-geo sandbox "
                          f"up --replicated")
    progress("bringing the sandbox up")
    sandbox.up(progress=lambda _msg: None)
    site = load_config(sandbox.layout.site_config)
    if site.federation is None:
        raise DrillFailed(f"{site.source} has no [federation] table")
    home, target = site.home_cluster, _other_cluster(site)
    clients = {name: connect(cluster) for name, cluster in site.clusters.items()}
    # A job pending on nodes still coming up could be moved for its queue before the drill.
    wait_for(lambda: nodes_ready(clients[home]), time.time() + 120,
             f"{home}'s nodes to be available")
    with sharded.fewer_nodes(sandbox.layout, target, settings.ranks > 1 and settings.reshard):
        return _drill(sandbox, site, clients, home, target, settings, out_dir, progress)


def _drill(sandbox: Sandbox, site: SiteConfig, clients: dict[str, SlurmClient], home: str,
           target: str, settings: DrillSettings, out_dir: Path,
           progress: Progress) -> DrillReport:
    assert site.federation is not None
    view = losses.FederationView(site)
    wait_for(view.leader, time.time() + 60, "a federation replica to lead")
    if settings.lose == "site":  # the loss must take the leader with it
        moved_from = losses.hand_lead_to(sandbox, view, Site.HOME, lambda check, what: wait_for(
            check, time.time() + 60, what))
        if moved_from is not None:
            progress(f"{moved_from}'s replica led: restarted it, so that home's leads")
    drill_world = None
    if settings.world_mb is not None:
        progress(f"making {ALICE.name}'s world at home: a {settings.world_mb:g} MiB dataset, "
                 "her project and a virtualenv")
        drill_world = world.make_world(sandbox.layout, ALICE, settings.world_mb)
    job = submit_training(site, clients[home], settings, out_dir, sandbox.layout,
                          drill_world=drill_world)
    run, work, trace, job_id, logical = job.run, job.dirs, job.traces, job.job_id, \
        job.logical_job
    progress(f"submitted {run} to {home} as job {job_id}")
    link_watch = wan.LinkWatch.home_remote(sandbox.layout.topology).start()
    world_offsite = world.OffsiteWatch(site, run, drill_world)
    # Short timeouts: a dead controller must show as unreachable when it dies, not later.
    quick = {name: connect(replace(cluster, timeout_s=1.0))
             for name, cluster in site.clusters.items()}
    # Losing home, the drill watches from control once home is cut off: the login host is
    # at home, and reaches no other site then.
    watch = losses.InSite(sandbox, Site.CONTROL) if settings.lose == "site" else None
    sampler = _Sampler(quick, home, job_id)
    sampler.start()
    returned_at: float | None = None
    try:
        deadline = time.time() + settings.timeout_s
        enough = settings.verified_before_kill
        wait_for(lambda: world_offsite() and len(verified_offsite(site, run)) >= enough,
                 deadline,
                 f"{enough} checkpoints of {run} verified off-site"
                 + (" and its world complete there" if drill_world else ""), progress,
                 lambda: _offsite_status(site, run, trace) + (
                     f"; {world.offsite_status(site, run)}" if drill_world else ""))
        offsite, readings = verified_offsite(site, run), link_watch.stop()
        leader_before = view.leader()
        progress(f"{len(offsite)} checkpoints verified off-site; {LOSS_SAYS[settings.lose]}")
        killed_at = time.time()
        if watch is not None:
            losses.lose_site(sandbox, Site.HOME)
            watch.enter()
            sampler.restart()  # its thread too: a new one, started from control
        else:
            kill_cluster(sandbox, home)
        failover_at, leader_after, leader_lost_at = None, leader_before, None

        def failover() -> None:
            """Who leads next, and when: polled from the loss on (only a leader audits,
            so the successor's failover comes before its first entry)."""
            nonlocal failover_at, leader_after
            leader_after = wait_for(lambda: view.leading_replica(besides=leader_before),
                                    deadline, "another replica to lead")
            failover_at = time.time()
            progress(f"{leader_after} leads {failover_at - (leader_lost_at or 0):.1f} s "
                     f"after {leader_before} was lost")
        if settings.lose == "site":
            leader_lost_at = killed_at
            failover()
        detected = wait_for(lambda: audit_entry(view, "outage", None, home, killed_at),
                            deadline, f"the daemon to declare {home} out", progress)
        progress(f"outage of {home} detected after {detected.unix_time - killed_at:.1f} s")
        if settings.lose == "leader":
            wait_for(lambda: decision_entry(view, logical, killed_at), deadline,
                     f"the leader to decide a move of {logical}")
            leader_lost_at = time.time()
            losses.kill_replica(sandbox, leader_before or "")
            progress(f"killed the leading replica {leader_before} in the middle of the move")
            failover()
        moved = wait_for(lambda: audit_entry(view, "requeue", logical, target, killed_at),
                         deadline, f"the daemon to requeue {logical} on {target}", progress)
        new_job = int(moved.detail["job_id"])
        sampler.follow(target, new_job)
        progress(f"requeued on {target} as job {new_job}, resuming from step "
                 f"{moved.detail.get('resume_step')}")
        training = wait_for(lambda: audit_entry(view, "lease", logical, target, killed_at),
                            deadline, f"job {target}:{new_job} to start training", progress)
        if settings.return_after_s is not None:
            wait_or_none(lambda: False, killed_at + settings.return_after_s)
            returned_at = _bring_home_back(sandbox, settings, watch, progress, home)
        finished = wait_for(lambda: audit_entry(view, "finished", logical, None, killed_at),
                            deadline, f"{logical} to finish", progress,
                            lambda: _trained_status(trace))
        progress(f"job finished: {finished.what}")
        if returned_at is None:
            returned_at = _bring_home_back(sandbox, settings, watch, progress, home)
        stale = wait_or_none(lambda: audit_entry(view, "fence", logical, home, killed_at),
                             time.time() + 60)
        if drill_world is not None:
            progress("fetching the moved job's outputs and log home as its owner")
            last = (str(finished.detail.get("cluster") or target),
                    finished.detail.get("job_id") or new_job)
            world_said = world.check(sandbox.layout, site, ALICE, drill_world, logical, run,
                                     {f"{home}:{job_id}": job_output(work, job_id, home)},
                                     f"{last[0]}:{last[1]}")
            world_said["offsite_s"] = world_offsite.seconds
    finally:
        link_watch.stop()
        sampler.stop()
        if watch is not None:
            watch.leave()
    last = (finished.detail.get("cluster"), finished.detail.get("job_id"))
    finished_on = (str(last[0]), int(last[1])) if None not in last else (target, new_job)
    output = job_output(work, finished_on[1], finished_on[0])
    reference = (reference_weights(settings) if settings.ranks == 1 or not settings.reshard
                 else "")
    final_step, final_weights = final_line(output)
    resumed, saved = sharded.resumed_and_saved(job_output(work, job_id, home),
                                               job_output(work, new_job, target))
    # The generation the kill hit: not always 0 (the daemon may have moved the job for its
    # queue and back before).
    lines = trace_lines(trace)
    hit = max((line.generation for line in lines if line.time <= killed_at
               and line.incarnation.startswith(f"{home}:")), default=0)
    home_steps = [line.step for line in lines if line.generation == hit]
    resume_step = moved.detail.get("resume_step")
    incarnations = [(home, job_id), (target, new_job)]
    if finished_on not in incarnations:
        incarnations.append(finished_on)
    report = DrillReport(
        run=run, logical_job=logical, home=home, target=target, settings=asdict(settings),
        killed_at=killed_at, detected_at=detected.unix_time, moved_at=moved.unix_time,
        running_elsewhere_at=training.unix_time, completed_at=finished.unix_time,
        detection_window_s=site.federation.detection_window_s,
        last_step_home=max(home_steps, default=0), offsite_step_at_kill=max(offsite),
        resume_step=resume_step,
        steps_lost=None if resume_step is None else max(home_steps, default=0) - resume_step,
        final_step=final_step, final_weights=final_weights, reference_weights=reference,
        bit_identical=final_weights == reference,
        **figures.replication(site, view, run, resume_step),
        link_mbit=settings.link_mbit,
        legs=figures.legs(site, clients, incarnations),
        stale_incarnation=stale.what if stale else "not seen within 60 s",
        fenced_at=stale.unix_time if stale else None,
        audit_ok=view.verify_audit(),
        owner=ALICE.name, owner_uid=ALICE.uid, ran_as=incarnation_uids(work),
        account_uids=sharded.account_uids(sandbox.layout, ALICE),
        ranks=settings.ranks, ranks_after_move=sharded.ranks_of(output) or settings.ranks,
        resumed_weights=resumed, saved_weights=saved,
        timeline=sampler.samples,
        lose=settings.lose, leader_before=leader_before, leader_after=leader_after,
        leader_lost_at=leader_lost_at, failover_at=failover_at, returned_at=returned_at,
        decisions=decisions_by_replica(view, logical, home, killed_at),
        offsite_kept=offsite_kept(sandbox, site, view, run, offsite),
        provider_secrets=provider_secrets(sandbox, site, run),
        cluster_sites={c.name: c.site.value for c in sandbox.layout.clusters},
        world=world.with_first_step(world_said, lines, home, killed_at)
        if drill_world is not None else None,
        wan=wan.measured(sandbox, site, run, offsite, readings),
        sync_poll_s=site.sync.poll_interval_s if site.sync else None,
    )
    if drill_world is not None:
        world.remove_dataset(drill_world)
    report.picture = str(draw_timeline(report, job.work / "timeline.png"))
    (job.work / "report.json").write_text(json.dumps(report.to_json(), indent=2))
    return report


LOSS_SAYS = {"cluster": "killing home's controller, nodes and job",
             "site": "cutting the home site off and killing every process there",
             "leader": "killing home's controller, nodes and job, then the leading replica "
                       "mid-move"}


def _bring_home_back(sandbox: Sandbox, settings: DrillSettings,
                     watch: losses.InSite | None, progress: Progress, home: str) -> float:
    """Home's links healed (a site loss) and everything killed started again, from the
    login host; the drill goes on watching from there. When it came back."""
    progress(f"bringing {home} back")
    if watch is not None:
        watch.leave()
        netns.heal_all(sandbox.layout.topology)
    sandbox.up(progress=lambda _msg: None)
    return time.time()


def reference_weights(settings: DrillSettings) -> str:
    """The weights hash of the same training run, uninterrupted, in this process (on as
    many ranks, in processes of this host)."""
    if settings.ranks > 1:
        return final_line(sharded.reference_output(settings))[1] or ""
    import torch

    from slurm_geo.ckpt import LocalDirStore, Repository
    from slurm_geo.examples import train as example_train
    from slurm_geo.torch.checkpointer import Checkpointer
    from slurm_geo.torch.signals import RequeueOnSignal
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        repository = Repository(LocalDirStore(Path(scratch)), os.urandom(32))
        config = example_train.TrainConfig(settings.steps, settings.ckpt_every,
                                           hidden=settings.hidden)
        with Checkpointer(repository, "reference") as checkpointer:
            outcome = example_train.train(checkpointer, config, RequeueOnSignal(),
                                          say=lambda _line: None)
    return example_train.weights_hash(outcome.model)


# --- pieces (bench/federation_chaos.py uses them too) -----------------------------------

def submit_training(site: SiteConfig, client: SlurmClient, settings: DrillSettings,
                    out_dir: Path, layout: SandboxLayout, person: SandboxUser = ALICE,
                    prefix: str = "drill", drill_world: world.DrillWorld | None = None
                    ) -> Training:
    """Submit a federated slurm_geo.examples.train job of `person`'s to the home cluster, with a
    fresh run id. It runs as that user, with the environment their login shell would
    hand sbatch: the site Python is `python` on its PATH, wherever the job runs."""
    run = f"{prefix}-{uuid.uuid4().hex[:8]}"
    work = out_dir / run if drill_world is None else drill_world.outputs
    work.mkdir(parents=True, exist_ok=True)
    os.chown(work, person.uid, person.uid)
    work.chmod(0o700)
    trace = work / "trace.log"
    spec = job_spec(site, layout, training_script(site, run, settings, work, trace, drill_world),
                    drill_world.job_dir if drill_world else work, person)
    job_id = client.submit(sharded.shaped_for_home(spec, settings) if settings.ranks > 1
                           else spec)
    return Training(run, site.home_cluster, job_id, work, trace,
                    drill_world.remote_work if drill_world else
                    sharded.remote_work(layout, person, run))


def job_spec(site: SiteConfig, layout: SandboxLayout, script: str, working_dir: Path,
             person: SandboxUser = ALICE) -> JobSpec:
    """A drill job of `person`'s, as their login shell would submit it: their uid, the
    environment it hands sbatch, the site config."""
    return JobSpec(script=script, name="geo-drill", working_dir=working_dir,
                   owner=person.owner, environment={**job_environment(layout, person),
                                                    "SLURM_GEO_CONFIG": str(site.source)})


def incarnation_uids(work: Path | list[Path]) -> dict[str, int]:
    """The uid each incarnation of a training job ran as, by 'cluster:job'."""
    found = {}
    for path in (found_path for where in _each(work) for found_path in where.glob("uid-*-*")):
        cluster, _, job_id = path.name.removeprefix("uid-").rpartition("-")
        found[f"{cluster}:{job_id}"] = int(path.read_text())
    return found


def nodes_ready(client: SlurmClient) -> bool:
    """Every node of the cluster can take a job."""
    try:
        nodes = client.nodes()
    except SlurmError:
        return False
    return bool(nodes) and all(node.available for node in nodes)


@dataclass(frozen=True)
class TraceLine:
    time: float
    generation: int
    incarnation: str  # cluster:job
    step: int


def trace_lines(trace: Path | list[Path]) -> list[TraceLine]:
    """The trace slurm_geo.examples.train --trace wrote: one line per trained step (of every trace
    given, in time order: each filesystem its incarnations ran on has one)."""
    lines = []
    for path in _each(trace):
        if not path.exists():
            continue
        for text in path.read_text().splitlines():
            words = text.split()
            if len(words) == 4 and words[1] != "-":  # a line cut short by a kill: skipped
                lines.append(TraceLine(float(words[0]), int(words[1]), words[2],
                                       int(words[3])))
    return sorted(lines, key=lambda line: line.time) if isinstance(trace, list) else lines


def _each(paths: Path | list[Path]) -> list[Path]:
    return paths if isinstance(paths, list) else [paths]


def _other_cluster(site: SiteConfig) -> str:
    others = sorted(name for name in site.clusters if name != site.home_cluster)
    if not others:
        raise DrillFailed("the drill needs a second cluster to fail over to")
    return others[0]


def training_script(site: SiteConfig, run: str, settings: DrillSettings, work: Path,
                    trace: Path, drill_world: world.DrillWorld | None = None) -> str:
    pfs = site.stores[site.cluster(site.home_cluster).store].url.removeprefix("file://")
    traced = f'"$work/{trace.name}"' if trace.parent == work else shlex.quote(str(trace))
    arguments = (f"--run {run} --federated --steps {settings.steps} --ckpt-every "
                 f"{settings.ckpt_every} --step-delay {settings.step_delay_s} --hidden "
                 f"{settings.hidden} --trace {traced}")
    trainer = (sharded.trainer_command(run, settings, traced) if settings.ranks > 1 else
               f"exec python -m slurm_geo.examples.train {arguments}")
    out = '"$work/train-$SLURM_CLUSTER_NAME-$SLURM_JOB_ID.out"'
    return "\n".join([
        "#!/bin/bash",
        "#SBATCH --job-name=geo-drill",
        *(sharded.batch_lines(settings) if settings.ranks > 1 else []),
        "#SBATCH --time=15",
        f"#SBATCH --output={work}/%x-%j.slurm.out",
        f"#SBATCH --geo-ckpt-dir={pfs}",
        "#SBATCH --geo-cost-center=ml-research",
        "#SBATCH --geo-failover=auto",
        *(drill_world.directives() if drill_world else []),
        f"#SBATCH --geo-clusters={','.join(sorted(site.clusters))}",
        drill_world.work_line() if drill_world else f"work={shlex.quote(str(work))}",
        # A cluster with none of home's files (the provider's): where it runs, its own.
        f'[ -d "$work" ] || {{ work="$PWD/{work.name}"; mkdir -p "$work"; }}',
        # Whom each incarnation ran as (incarnation_uids).
        'id -u > "$work/uid-$SLURM_CLUSTER_NAME-$SLURM_JOB_ID"',
        # Job ids repeat across clusters: the cluster's name keeps each output apart.
        # Appended: an incarnation Slurm requeues under the same id keeps what it said.
        *(drill_world.run_lines(arguments, out) if drill_world else
          [f"{trainer} >> {out} 2>&1"]),
        "",
    ])


def _trained_status(trace: Path | list[Path]) -> str:
    """What a long wait says of the training: the newest step and where it ran."""
    lines = trace_lines(trace)
    if not lines:
        return "no step trained yet"
    last = lines[-1]
    return f"step {last.step} on {last.incarnation}"


def _offsite_status(site: SiteConfig, run: str, trace: Path | list[Path]) -> str:
    """What the wait for off-site checkpoints says: how many are verified, and training."""
    steps = verified_offsite(site, run)
    done = f"verified off-site: steps {', '.join(map(str, steps))}" if steps else \
        "none verified off-site yet"
    return f"{done}; {_trained_status(trace)}"


def verified_offsite(site: SiteConfig, run: str) -> list[int]:
    """The steps of the run's checkpoints checkpoint-sync has verified off-site, oldest first;
    none while checkpoint-sync has not yet created its state."""
    if site.sync is None:
        return []
    return SyncStateReader(site.sync.state, missing_ok=True).verified_steps(run)


def kill_cluster(sandbox: Sandbox, cluster: str) -> set[int]:
    """SIGKILL the cluster's slurmctld, slurmds, slurmstepds and jobs: what losing the
    site does to them. Only processes this sandbox started, each by its pid."""
    victims = cluster_pids(sandbox, cluster)
    losses.signal_pids(victims, signal.SIGKILL)
    return victims


def cluster_pids(sandbox: Sandbox, cluster: str) -> set[int]:
    """The pids of the cluster's slurmctld, slurmds, and everything they run (slurmstepds,
    jobs): processes this sandbox started, found by its pid files and markers."""
    names = [f"{cluster}-slurmctld", *(f"{cluster}-n{i}" for i in (1, 2))]
    pids = {pid for pid in map(sandbox.processes.running_pid, names) if pid is not None}
    return losses.with_descendants(pids | losses.cluster_processes(sandbox, cluster))


def audit_entry(audit: Audited, kind: str, logical: str | None, cluster: str | None,
                after: float) -> Entry | None:
    """The first entry of `kind` (of `logical`'s, when given; about `cluster`, when
    given) written at or after `after`."""
    for entry in audit.entries(logical_job=logical):
        if entry.kind == kind and cluster in (None, entry.detail.get("cluster")) \
                and entry.unix_time >= after:
            return entry
    return None


def decision_entry(audit: Audited, logical: str, after: float) -> Entry | None:
    """The leader's decision to move `logical` (or restart it elsewhere) after `after`."""
    for entry in audit.entries(logical_job=logical):
        if entry.kind == "decision" and entry.unix_time >= after and \
                entry.what.startswith(("move to ", "restart on ")):
            return entry
    return None


def decisions_by_replica(view: losses.FederationView, logical: str, home: str,
                         after: float) -> list[dict[str, Any]]:
    """What the federation decided and did about the loss, and which replica did each
    (a daemon alone: no name)."""
    return [{"time": entry.unix_time, "kind": entry.kind, "what": entry.what,
             "replica": entry.detail.get("replica")}
            for entry in view.entries()
            if entry.unix_time >= after and (entry.logical_job == logical or (
                entry.kind in ("outage", "recovered") and entry.detail.get("cluster") == home))]


def offsite_kept(sandbox: Sandbox, site: SiteConfig, view: losses.FederationView, run: str,
                 steps: list[int]) -> bool:
    """Every checkpoint verified off-site before the loss is still there, and the newest
    of them still verifies in full (read with the daemons' key to the store)."""
    repository = wan.offsite_repository(sandbox, site)
    listed = set(repository.steps(run))
    return set(steps) <= listed and not repository.verify(run, max(steps))


def provider_secrets(sandbox: Sandbox, site: SiteConfig, run: str) -> list[str]:
    """The master key or the run's key where the rented provider keeps data: remote's
    etcd member and the S3 server there (each found says where; none is the target)."""
    from slurm_geo.ckpt.format.keys import load_master_key
    from slurm_geo.ckpt.repo.runkey import unwrap_run_key
    from slurm_geo.ckpt.stores.open_store import open_store

    assert site.sync is not None
    master = load_master_key(sandbox.layout.master_key)
    home_store = site.stores[site.cluster(site.home_cluster).store]
    run_key = unwrap_run_key(open_store(home_store.url), master, run)
    layout = sandbox.layout
    return losses.secrets_found(
        [layout.etcd_cluster.member(Site.REMOTE).data_dir, layout.s3_data_dir],
        {"the master key": master.current, f"the run key of {run}": run_key})


def job_output(work: Path | list[Path], job_id: int, cluster: str) -> str:
    for where in _each(work):
        path = where / f"train-{cluster}-{job_id}.out"
        if path.exists():
            return path.read_text()
    return ""


def final_line(output: str) -> tuple[int | None, str | None]:
    for line in reversed(output.splitlines()):
        if line.startswith("final step "):
            words = line.split()
            return int(words[2]), words[4]
    return None, None


class _Sampler:
    """Polls each incarnation's Slurm state twice a second, for the timeline picture."""

    def __init__(self, clients: dict[str, SlurmClient], cluster: str, job_id: int):
        self._clients = clients
        self._follow = [(cluster, job_id)]
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="drill-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def restart(self) -> None:
        """Go on sampling from a new thread, in the network namespace of the caller's."""
        self.stop()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="drill-sampler", daemon=True)
        self._thread.start()

    def follow(self, cluster: str, job_id: int) -> None:
        self._follow.append((cluster, job_id))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=15)

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            for cluster, job_id in list(self._follow):
                try:
                    state = self._clients[cluster].job(job_id).state.value
                except SlurmError:
                    state = "UNREACHABLE"
                self.samples.append(Sample(time.time(), f"{cluster}:{job_id}", state))
