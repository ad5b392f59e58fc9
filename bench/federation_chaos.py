"""Federation chaos: lose or partition the home cluster at random points, N times (issue 6).

Targets: in 20 trials (random kill points, including while checkpoint-sync is copying a
checkpoint off-site, and partitions of the home cluster that later heal) never two
incarnations training and never a resume from an unverified checkpoint; RTO <= detection
window + 15 s; steps lost <= one checkpoint interval; final weights bit-identical.

Runs against its OWN sandbox (/var/tmp/sg-chaos, port base 23800), never the default one.
Each trial submits a federated slurm_geo.examples.train job to onprem
(slurm_geo.drills.drill's pieces) and applies one fault:

- kill-random    SIGKILL onprem's slurmctld, slurmds, slurmstepds and the trainer once the
                 trainer reached a random step (before or after the first off-site copy);
- kill-boundary  the same, a few steps either side of a random checkpoint;
- kill-transfer  the same, the moment checkpoint-sync's state DB shows a checkpoint of the
                 run being copied off-site (status uploading or replicated), and
                 checkpoint-sync with it (it runs at the home site): the copy is cut off;
- freeze-home    SIGSTOP every onprem process (the same set), wait until the daemon has
                 moved the job and the new incarnation trains, then SIGCONT (it thaws);
- cut-wan        cut the WAN link between the sites (`sandbox wan --cut`: home and rented
                 cannot reach each other; the daemon, at home, loses rented and its store)
                 while the job trains at home, for CUT_WAN_S, then heal it: nothing may
                 move, and the job finishes at home;
- partition-rented  kill onprem as kill-random; once the job trains on rented, bring onprem
                 back and cut the WAN: the rented incarnation can no longer renew its lease
                 and the daemon cannot reach it; the daemon brings the job home from the
                 newest checkpoint it verified; then heal: the rented incarnation must find
                 itself fenced.

Then onprem is brought back (`sandbox up`), the job runs to its end wherever the daemon
put it, and the trial is checked:

(a) never two incarnations training: in the --trace file (`time generation cluster:job
    step` per trained step) no step of a generation is later than the first step of a
    newer generation, and the home store holds no checkpoint the old incarnation
    committed after the new one began training;
(b) never a resume from an unverified checkpoint: every `requeue` in the audit log names a
    resume step S for which the daemon's last `verify` before it says "run@S verified"
    ("no checkpoint" when S is none), and that incarnation printed "started at step S";
(c) final weights bit-identical to an uninterrupted run (drill.reference_weights);
(d) detection, RTO (fault -> the new generation's first lease), steps lost;
(e) every incarnation ran as alice's account on its cluster (`id -u`: hers at home, geo-alice
    at the provider, whose home there holds that incarnation's outputs: Training.dirs).

Run: python bench/federation_chaos.py [--trials 20] [--seed N]; writes
bench/results/federation_chaos-<time>.json, prints a table and Markdown for
docs/benchmarks.md; exits 1 if any trial violates (a), (b) or (e), 2 if a trial could not
complete, lost its job (it did not complete) or ended with other weights.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from chaos_checks import (  # noqa: E402
    failed_resumes,
    not_as_owner,
    overlaps,
    unverified_resumes,
)

from slurm_geo.config.model import SiteConfig, load_config  # noqa: E402
from slurm_geo.drills import drill, losses, sharded  # noqa: E402
from slurm_geo.federation.model import answering  # noqa: E402
from slurm_geo.federation.state.audit import Entry  # noqa: E402
from slurm_geo.sandbox import Sandbox, netns  # noqa: E402
from slurm_geo.sandbox.users import ALICE  # noqa: E402
from slurm_geo.slurm import SlurmClient, SlurmError, connect  # noqa: E402
from slurm_geo.sync.reader import SyncStateReader  # noqa: E402
from slurm_geo.sync.state import Replica, Status  # noqa: E402

SANDBOX_DIR = Path("/var/tmp/sg-chaos")
PORT_BASE = 23800
KINDS = ("kill-random", "kill-boundary", "kill-transfer", "freeze-home", "cut-wan",
         "partition-rented")
SETTINGS = drill.DrillSettings(steps=320, ckpt_every=40, step_delay_s=0.05, hidden=32768,
                               timeout_s=240.0)
TRAINING_AFTER_MOVE_S = 2.0  # a partition heals while the new incarnation trains
# Longer than the daemon's detection window (3 probes, 1 s apart): it sees rented out.
CUT_WAN_S = 8.0
EXIT_FENCED = 33
_STALE = ("freeze-home", "partition-rented")  # kinds whose hit incarnation lives on, stale


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int  # kill/freeze once the trainer reached this step (kill-transfer: checkpoint)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:  # a renamed kind would otherwise run as a kill
            raise ValueError(f"fault kind {self.kind!r}: expected one of {', '.join(KINDS)}")


@dataclass
class Trial:
    index: int
    fault: Fault
    run: str = ""
    logical_job: str = ""
    fault_at: float = 0.0
    fault_step: int | None = None       # the newest step traced when the fault hit
    offsite_at_fault: int | None = None  # the newest step verified off-site then
    hit: str = ""                       # the incarnation the fault hit
    transfer_status: str | None = None  # kill-transfer: the replica's status at the kill
    healed_at: float | None = None
    detection_s: float | None = None
    rto_s: float | None = None
    rto_target_s: float | None = None
    moves: list[dict[str, Any]] = field(default_factory=list)
    last_step_home: int | None = None
    steps_lost: int | None = None
    final_weights: str | None = None
    bit_identical: bool = False
    overlap: list[str] = field(default_factory=list)     # (a) violations
    unverified: list[str] = field(default_factory=list)  # (b) violations
    not_started: list[str] = field(default_factory=list)  # submitted, never trained
    not_as_owner: list[str] = field(default_factory=list)  # incarnations not run as alice
    moved_during_cut: list[dict[str, Any]] = field(default_factory=list)  # cut-wan: moves
    finished: str | None = None                          # the daemon's "finished" entry
    stale: dict[str, Any] = field(default_factory=dict)  # how the hit incarnation ended
    error: str | None = None
    seconds: float = 0.0

    @property
    def violates(self) -> bool:
        return bool(self.overlap or self.unverified or self.not_as_owner
                    or self.moved_during_cut)


def plan_faults(trials: int, rng: random.Random, settings: drill.DrillSettings) -> list[Fault]:
    """Every kind equally often (shuffled), each at a random point of the run."""
    kinds = [KINDS[i % len(KINDS)] for i in range(trials)]
    rng.shuffle(kinds)
    every, steps = settings.ckpt_every, settings.steps
    last_ckpt = (steps * 2 // 3) // every
    faults = []
    for kind in kinds:
        if kind == "kill-random":
            step = rng.randint(1, steps * 2 // 3)
        elif kind == "kill-boundary":
            step = rng.randint(1, last_ckpt) * every + rng.randint(-3, 3)
        elif kind == "kill-transfer":
            step = rng.randint(1, last_ckpt) * every
        else:
            step = rng.randint(every // 2, steps // 2)
        faults.append(Fault(kind, step))
    return faults


# --- one trial ------------------------------------------------------------------------------

class Chaos:
    def __init__(self, sandbox: Sandbox, settings: drill.DrillSettings, out_dir: Path,
                 reference: str, say: Any = print):
        self.sandbox = sandbox
        self.settings = settings
        self.out_dir = out_dir
        self.reference = reference
        self.say = say
        self.site: SiteConfig = load_config(sandbox.layout.site_config)
        assert self.site.federation is not None
        self.home = self.site.home_cluster
        self.target = drill._other_cluster(self.site)
        self.clients: dict[str, SlurmClient] = {
            name: connect(cluster) for name, cluster in self.site.clusters.items()}
        self.view = losses.FederationView(self.site)  # SQLite, or the replicas' etcd
        self.audit = self.view  # its entries ride out an etcd election
        self.wan = netns.sandbox_topology(sandbox.layout)
        self.accounts = sharded.account_uids(sandbox.layout, ALICE)
        self.jobs: dict[int, drill.Training] = {}  # each trial's job, where it wrote

    def run(self, index: int, fault: Fault) -> Trial:
        trial = Trial(index, fault)
        started = time.time()
        frozen: set[int] = set()
        try:
            self._wait_home_up(time.time() + 90)
            job = drill.submit_training(self.site, self.clients[self.home], self.settings,
                                        self.out_dir, self.sandbox.layout, prefix="chaos")
            trial.run, trial.logical_job = job.run, job.logical_job
            self.jobs[index] = job
            deadline = time.time() + self.settings.timeout_s
            frozen = self._inject(trial, job, deadline)
            self._recover(trial, job, frozen, deadline)
            frozen = set()
            self._check(trial, job)
        except (drill.DrillFailed, SlurmError, OSError) as exc:
            trial.error = str(exc)
        finally:
            if frozen:
                losses.signal_pids(frozen, signal.SIGCONT)
            if netns.wan_state(self.wan).cut:
                netns.heal_wan(self.wan)
            if trial.error is not None:
                self._clean_up(trial)
            trial.seconds = round(time.time() - started, 1)
        return trial

    def _inject(self, trial: Trial, job: drill.Training, deadline: float) -> set[int]:
        """Apply the fault; the pids it froze (freeze-home), for _recover to thaw."""
        fault = trial.fault
        if fault.kind == "kill-transfer":
            trial.transfer_status = drill.wait_for(
                lambda: self._copying(job.run, fault.step), deadline,
                f"checkpoint-sync to copy {job.run}@{fault.step} (or a later one)")
        else:
            drill.wait_for(lambda: self._reached(job, fault.step), deadline,
                           f"{job.run} to reach step {fault.step}")
        frozen: set[int] = set()
        if fault.kind == "partition-rented":
            self._move_to_rented(job, deadline)
        trial.fault_at = time.time()
        if fault.kind == "freeze-home":
            frozen = drill.cluster_pids(self.sandbox, self.home)
            losses.signal_pids(frozen, signal.SIGSTOP)
        elif fault.kind in ("cut-wan", "partition-rented"):
            netns.cut_wan(self.wan)
        else:
            if fault.kind == "kill-transfer":
                sync = self.sandbox.processes.running_pid("checkpoint-sync")
                losses.signal_pids(set() if sync is None else {sync}, signal.SIGKILL)
            drill.kill_cluster(self.sandbox, self.home)
        lines = drill.trace_lines(job.traces)
        trial.fault_step = lines[-1].step if lines else 0
        trial.offsite_at_fault = max(drill.verified_offsite(self.site, job.run), default=None)
        if fault.kind == "kill-transfer":
            trial.transfer_status = f"{trial.transfer_status} -> {self._replica_status(job.run)}"
        return frozen

    def _move_to_rented(self, job: drill.Training, deadline: float) -> None:
        """partition-rented's setting: onprem lost, the job training on rented, onprem back."""
        lost_at = time.time()
        drill.kill_cluster(self.sandbox, self.home)
        drill.wait_for(lambda: self._entry("lease", job.logical_job, self.target, lost_at),
                       deadline, f"{job.logical_job} to train on {self.target}")
        time.sleep(TRAINING_AFTER_MOVE_S)
        self._wait_home_up(deadline)

    def _recover(self, trial: Trial, job: drill.Training, frozen: set[int],
                 deadline: float) -> None:
        logical, after, kind = job.logical_job, trial.fault_at, trial.fault.kind
        if kind == "freeze-home":
            drill.wait_for(lambda: self._entry("lease", logical, self.target, after),
                           deadline, f"{logical} to train on {self.target}")
            time.sleep(TRAINING_AFTER_MOVE_S)
            losses.signal_pids(frozen, signal.SIGCONT)
        elif kind == "cut-wan":
            time.sleep(CUT_WAN_S)
            netns.heal_wan(self.wan)
        elif kind == "partition-rented":
            drill.wait_for(lambda: self._entry("lease", logical, self.home, after),
                           deadline, f"{logical} to train on {self.home} again")
            time.sleep(TRAINING_AFTER_MOVE_S)
            netns.heal_wan(self.wan)
        if kind in ("freeze-home", "cut-wan", "partition-rented"):
            trial.healed_at = time.time()
        drill.wait_for(lambda: self._entry("finished", logical, None, after), deadline,
                       f"{logical} to finish")
        self.sandbox.up(progress=lambda _msg: None)
        stale_on = self.target if kind == "partition-rented" else self.home
        if kind != "cut-wan":
            drill.wait_or_none(lambda: self._entry("fence", logical, stale_on, after),
                               time.time() + 60)

    # --- checks ---------------------------------------------------------------------------

    def _check(self, trial: Trial, job: drill.Training) -> None:
        entries = list(self.audit.entries(logical_job=job.logical_job))
        assert self.site.federation is not None
        lines = drill.trace_lines(job.traces)
        hit = [line for line in lines if line.time <= trial.fault_at][-1]  # who the fault hit
        after = [e for e in entries if e.unix_time >= trial.fault_at]
        # partition-rented's cut hides rented (where the job then is), not home
        outage = self._entry("outage", None, hit.incarnation.split(":")[0], trial.fault_at)
        lease = next((e for e in after if e.kind == "lease"
                      and int(e.detail.get("generation", 0)) > hit.generation), None)
        trial.hit = f"generation {hit.generation} on {hit.incarnation}"
        trial.detection_s = _since(outage, trial.fault_at)
        trial.rto_s = _since(lease, trial.fault_at)
        trial.rto_target_s = self.site.federation.detection_window_s + 15.0
        trial.overlap = overlaps(lines)
        if lease is not None and hit.incarnation.startswith(f"{self.home}:"):
            trial.overlap += self._stale_commits(job, hit, lease.unix_time)
        trial.unverified = unverified_resumes(entries, job.dirs)
        trial.not_started = failed_resumes(entries, job.dirs)
        trial.not_as_owner = not_as_owner(drill.incarnation_uids(job.dirs), self.accounts)
        trial.moves = [{"generation": e.detail.get("generation"),
                        "cluster": e.detail.get("cluster"), "job_id": e.detail.get("job_id"),
                        "resume_step": e.detail.get("resume_step"),
                        "after_fault": e.unix_time >= trial.fault_at}
                       for e in entries if e.kind == "requeue"]
        trial.last_step_home = max(line.step for line in lines
                                   if line.generation == hit.generation)
        move = next((e for e in after if e.kind == "requeue"), None)
        if move is not None:
            trial.steps_lost = trial.last_step_home - (move.detail.get("resume_step") or 0)
        finished = next(e for e in reversed(entries) if e.kind == "finished")
        trial.finished = finished.what
        output = drill.job_output(job.dirs, int(finished.detail["job_id"]),
                                  str(finished.detail["cluster"]))
        _, trial.final_weights = drill.final_line(output)
        trial.bit_identical = trial.final_weights == self.reference
        trial.stale = self._stale_end(job, entries, hit)
        if trial.fault.kind == "cut-wan":
            trial.moved_during_cut = [m for m in trial.moves if m["after_fault"]]

    def _stale_end(self, job: drill.Training, entries: list[Entry],
                   hit: drill.TraceLine) -> dict[str, Any]:
        """How the incarnation the fault hit ended: the daemon's fence entry, its output,
        sacct."""
        cluster, job_id = hit.incarnation.split(":")[0], int(hit.incarnation.split(":")[1])
        fence = next((e for e in entries if e.kind == "fence"
                      and e.detail.get("cluster") == cluster
                      and e.detail.get("generation") == hit.generation), None)
        output = drill.job_output(job.dirs, job_id, cluster)
        try:
            records = self.clients[cluster].accounting([job_id])
        except SlurmError:
            records = []
        return {"fence": None if fence is None else fence.what,
                "output_says_fenced": "error: this incarnation is fenced" in output,
                "sacct": [{"state": r.state.value, "exit_code": r.exit_code}
                          for r in records][-1:]}

    def _stale_commits(self, job: drill.Training, hit: drill.TraceLine,
                       superseded_at: float) -> list[str]:
        """(a), in the home store: checkpoints the incarnation the fault hit committed
        after the next generation started training (commit time: the manifest's mtime)."""
        from slurm_geo.ckpt import LocalDirStore, Repository, load_master_key

        pfs = Path(self.site.stores[self.site.cluster(self.home).store].url
                   .removeprefix("file://"))
        repository = Repository(LocalDirStore(pfs), load_master_key(
            self.sandbox.layout.master_key))
        found = []
        for path in sorted((pfs / "manifests" / job.run).glob("*")):
            committed = path.stat().st_mtime
            if committed <= superseded_at:
                continue
            metadata = repository.manifest(job.run, int(path.name)).metadata
            if f"{metadata.cluster}:{metadata.job_id}" == hit.incarnation:
                found.append(f"generation {hit.generation} ({hit.incarnation}) committed "
                             f"checkpoint "
                             f"{int(path.name)} to the home store {committed - superseded_at:.3f}"
                             " s after generation 1 began training")
        return found

    # --- sandbox helpers ------------------------------------------------------------------

    def _entry(self, kind: str, logical: str | None, cluster: str | None,
               after: float) -> Entry | None:
        for entry in self.audit.entries(logical_job=logical):
            if entry.kind == kind and entry.unix_time >= after and \
                    (cluster is None or entry.detail.get("cluster") == cluster):
                return entry
        return None

    def _reached(self, job: drill.Training, step: int) -> bool:
        lines = drill.trace_lines(job.traces)
        return bool(lines) and lines[-1].step >= step \
            and lines[-1].incarnation.startswith(f"{self.home}:")

    def _copying(self, run: str, step: int) -> str | None:
        """The status of a checkpoint of `run` at `step` or later that checkpoint-sync is
        copying right now (uploading, or copied but not yet verified)."""
        copying = [r for r in self._replicas(run) if r.step >= step
                   and r.status in (Status.UPLOADING, Status.REPLICATED)]
        return copying[-1].status.value if copying else None

    def _replica_status(self, run: str) -> str:
        return ",".join(f"{r.step}:{r.status.value}"
                        for r in reversed(self._replicas(run))) or "none"

    def _replicas(self, run: str) -> list[Replica]:
        """The run's replicas, oldest step first; none before checkpoint-sync first ran."""
        sync = self.site.sync
        if sync is None:
            return []
        return SyncStateReader(sync.state, missing_ok=True).replicas(run)

    def _wait_home_up(self, deadline: float) -> None:
        """The daemon must see home answering before a trial starts there."""
        def up() -> bool:
            return answering(self.view.health(), self.home)

        def nodes_ready() -> bool:
            try:
                nodes = self.clients[self.home].nodes()
            except SlurmError:
                return False
            return bool(nodes) and all(node.available for node in nodes)
        self.sandbox.up(progress=lambda _msg: None)
        drill.wait_for(up, deadline, f"the daemon to see {self.home} up")
        # A job pending on nodes that are still coming back would be moved for its queue.
        drill.wait_for(nodes_ready, deadline, f"{self.home}'s nodes to be available")

    def _clean_up(self, trial: Trial) -> None:
        """After a failed trial: onprem up again, the trial's jobs cancelled."""
        self.sandbox.up(progress=lambda _msg: None)
        jobs = [(self.home, int(trial.logical_job.rsplit("-", 1)[1]))] \
            if trial.logical_job else []
        jobs += [(str(e.detail["cluster"]), int(e.detail["job_id"]))
                 for e in self.audit.entries(logical_job=trial.logical_job or None)
                 if e.kind == "requeue"] if trial.logical_job else []
        for cluster, job_id in jobs:
            try:
                self.clients[cluster].cancel(job_id)
            except SlurmError:
                continue


def _since(entry: Entry | None, at: float) -> float | None:
    return None if entry is None else round(entry.unix_time - at, 2)


# --- report ---------------------------------------------------------------------------------

def summary(trials: list[Trial], settings: drill.DrillSettings) -> dict[str, Any]:
    done = [t for t in trials if t.error is None]
    rtos = [t.rto_s for t in done if t.rto_s is not None]
    lost = [t.steps_lost for t in done if t.steps_lost is not None]
    return {
        "trials": len(trials), "completed": len(done),
        "violations_two_training": sum(bool(t.overlap) for t in trials),
        "violations_unverified_resume": sum(bool(t.unverified) for t in trials),
        "violations_not_run_as_owner": sum(bool(t.not_as_owner) for t in trials),
        "bit_identical": sum(t.bit_identical for t in done),
        "jobs_completed": sum("COMPLETED" in (t.finished or "") for t in done),
        "trials_with_an_incarnation_that_never_trained": sum(bool(t.not_started)
                                                             for t in trials),
        "rto_s": {"min": min(rtos, default=None), "median": statistics.median(rtos)
                  if rtos else None, "max": max(rtos, default=None)},
        "rto_target_s": done[0].rto_target_s if done else None,
        "rto_within_target": sum(t.rto_s is not None and t.rto_target_s is not None
                                 and t.rto_s <= t.rto_target_s for t in done),
        "steps_lost_max": max(lost, default=None),
        "steps_lost_within_interval": sum(n <= settings.ckpt_every for n in lost),
        "faults": dict(Counter(t.fault.kind for t in trials)),
        "killed_during_transfer": sum(t.transfer_status is not None for t in trials),
        "violations_moved_during_wan_cut": sum(bool(t.moved_during_cut) for t in trials),
        "partitioned_stale_trainer_fenced": sum(bool(t.stale.get("output_says_fenced"))
                                                for t in trials if t.fault.kind in _STALE),
        "partitioned_stale_exit_33_in_sacct": sum(
            any(r.get("exit_code") == EXIT_FENCED for r in t.stale.get("sacct", []))
            for t in trials if t.fault.kind in _STALE),
        "partitioned_trials": sum(t.fault.kind in _STALE for t in trials),
        "stale_cancelled": sum(bool(t.stale.get("fence")) for t in trials),
    }


def table(trials: list[Trial]) -> str:
    rows = ["| # | fault | at step | detection s | RTO s | resume | lost | bit-identical "
            "| (a) | (b) | hit incarnation | s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for t in trials:
        resume = ",".join(str(m["resume_step"]) for m in t.moves) or "-"
        sacct = t.stale.get("sacct") or [{}]
        home = f"{sacct[0].get('state', '?')} exit {sacct[0].get('exit_code', '?')}" + \
            (", fenced" if t.stale.get("output_says_fenced") else "")
        where = t.fault.step if t.fault.kind != "kill-transfer" else \
            f"{t.fault_step} ({t.transfer_status})"
        rows.append(
            f"| {t.index} | {t.fault.kind} | {where} | {_num(t.detection_s)} | "
            f"{_num(t.rto_s)} | {resume} | {_num(t.steps_lost)} | "
            f"{'yes' if t.bit_identical else 'NO'} | {'ok' if not t.overlap else 'VIOLATED'} "
            f"| {'ok' if not t.unverified else 'VIOLATED'} | {home} | {t.seconds} |"
            + (f" error: {t.error}" if t.error else "")
            + (f" (never trained: {t.not_started[0]})" if t.not_started else ""))
    return "\n".join(rows)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=None, help="fault plan seed (default: "
                        "random, printed)")
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated subset")
    parser.add_argument("--keep", action="store_true", help="leave the sandbox up")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    kinds = [k for k in args.kinds.split(",") if k]
    faults = [f for f in plan_faults(args.trials * len(KINDS), random.Random(seed), SETTINGS)
              if f.kind in kinds][:args.trials]
    print(f"seed {seed}; bringing up {SANDBOX_DIR} (port base {PORT_BASE})", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "slurm_geo", "sandbox", "up", "--dir",
                    str(SANDBOX_DIR), "--port-base", str(PORT_BASE)], check=True,
                   capture_output=True)
    sandbox = Sandbox(SANDBOX_DIR)
    print("computing the reference weights", file=sys.stderr)
    reference = drill.reference_weights(SETTINGS)
    chaos = Chaos(sandbox, SETTINGS, SANDBOX_DIR / "chaos", reference)
    trials = []
    for index, fault in enumerate(faults, 1):
        trial = chaos.run(index, fault)
        trials.append(trial)
        print(f"trial {index}/{len(faults)} {fault.kind}@{fault.step}: rto {trial.rto_s} "
              f"lost {trial.steps_lost} identical {trial.bit_identical} "
              f"(a) {len(trial.overlap)} (b) {len(trial.unverified)} "
              f"not as alice {len(trial.not_as_owner)} "
              f"moved during cut {len(trial.moved_during_cut)} {trial.seconds} s"
              + (f" ERROR {trial.error}" if trial.error else ""), file=sys.stderr)
    result = {"seed": seed, "settings": asdict(SETTINGS), "reference_weights": reference,
              "summary": summary(trials, SETTINGS),
              "trials": [{**asdict(t), "violates": t.violates} for t in trials]}
    out = ROOT / "bench" / "results" / f"federation_chaos-{time.strftime('%Y%m%dT%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(table(trials))
    print(json.dumps(result["summary"], indent=2))
    print(f"results: {out}", file=sys.stderr)
    if not args.keep:
        sandbox.down(purge=True)
    if any(t.violates for t in trials):
        return 1
    lost = [t for t in trials if "COMPLETED" not in (t.finished or "")]
    return 2 if any(t.error or not t.bit_identical for t in trials) or lost else 0


if __name__ == "__main__":
    sys.exit(main())
