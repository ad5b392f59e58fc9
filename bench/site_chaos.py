"""Chaos on a replicated sandbox (issue 17): leaders, sites and partitions of each site.

The federation daemon runs as replicas at home and control, their state in the three
sites' etcd (`sandbox up --replicated`, its own sandbox at /var/tmp/sg-sitechaos, port
base 23900). Each trial submits a federated slurm_geo.examples.train job to onprem and
strikes once, at a random point:

- lose-leader: onprem killed; once the leader has decided the move, the leading replica
  is SIGKILLed (no resignation): its successor must finish the move;
- lose-site: the whole home site lost while checkpoint-sync copies a checkpoint off-site
  (its links cut, every process there SIGKILLed, the home replica and etcd member too),
  home's replica leading (the lead is handed to it first, as the drill does); the trial
  watches from control until home is back;
- partition-home: home cut off, nothing killed; healed once the job trains on rented:
  the home trainer, alive all along, must be fenced;
- partition-control, partition-remote: that site cut off for longer than the detection
  window, then healed: nothing may move (home still answers the leader).

Checked per trial, from the trace, the audit log in etcd and the outputs:
(a) never two incarnations training at once; (b) every resume from the checkpoint the
leader verified; (c) every decision written by the replica that led when it was written
(who leads is sampled from control every 0.2 s); and the job completed, bit-identical to
an uninterrupted run. bench/federation_chaos.py holds the trial loop and checks (a) and
(b); this adds the strikes and (c).

    python bench/site_chaos.py [--trials 20] [--seed N] [--kinds lose-site,...]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import federation_chaos as chaos  # noqa: E402

from slurm_geo.drills import drill, losses  # noqa: E402
from slurm_geo.sandbox import Sandbox, netns  # noqa: E402
from slurm_geo.sandbox.sites import Site  # noqa: E402

SANDBOX_DIR = Path("/var/tmp/sg-sitechaos")
PORT_BASE = 23900
KINDS = ("lose-leader", "lose-site", "partition-home", "partition-control",
         "partition-remote")
CUT_S = 8.0  # a partition of control or remote: past the detection window (3 s)
LEADER_LOST = ("lose-leader", "lose-site", "partition-home")  # when home's replica leads
PARTITIONED = {"partition-home": Site.HOME, "partition-control": Site.CONTROL,
               "partition-remote": Site.REMOTE}
# An entry written by a replica counts as the leader's if it led within this much of the
# entry's time (the sampling interval, and the writer's clock: the same machine's).
LEADER_SLACK_S = 1.0
DECISION_KINDS = ("decision", "verify", "transfer", "fence", "requeue", "outage",
                  "recovered", "finished")


@dataclass(frozen=True)
class SiteFault:
    kind: str
    step: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"fault kind {self.kind!r}: expected one of {', '.join(KINDS)}")


@dataclass
class LeaderSamples:
    """Who leads, as etcd says, sampled from control (which stays reachable from every
    strike but its own partition, when home and remote still are)."""

    samples: list[tuple[float, str | None]] = field(default_factory=list)

    def led_near(self, replica: str, at: float) -> bool:
        return any(leader == replica and abs(t - at) <= LEADER_SLACK_S
                   for t, leader in self.samples)


class SiteChaos(chaos.Chaos):
    def __init__(self, sandbox: Sandbox, settings: drill.DrillSettings, out_dir: Path,
                 reference: str, say: Any = print):
        super().__init__(sandbox, settings, out_dir, reference, say)
        self.watch = losses.InSite(sandbox, Site.CONTROL)
        self.leaders = LeaderSamples()
        self.not_by_leader: dict[int, list[str]] = {}
        self._stop = threading.Event()
        threading.Thread(target=self._sample_leaders, daemon=True).start()

    def close(self) -> None:
        self._stop.set()

    def _sample_leaders(self) -> None:
        losses.InSite(self.sandbox, Site.CONTROL).enter()  # this thread's, for good
        view = losses.FederationView(self.site)
        while not self._stop.wait(0.2):
            self.leaders.samples.append((time.time(), view.leader()))

    # --- strikes -------------------------------------------------------------------------

    def _inject(self, trial: chaos.Trial, job: drill.Training, deadline: float) -> set[int]:
        kind, step = trial.fault.kind, trial.fault.step
        if kind == "lose-site":  # as the drill does: the loss takes the leader with it
            losses.hand_lead_to(self.sandbox, self.view, Site.HOME,
                                lambda check, what: drill.wait_for(check, deadline, what))
            drill.wait_for(lambda: self._copying(job.run, step), deadline,
                           f"checkpoint-sync to copy {job.run}@{step} (or a later one)")
        else:
            drill.wait_for(lambda: self._reached(job, step), deadline,
                           f"{job.run} to reach step {step}")
        trial.fault_at = time.time()
        if kind == "lose-leader":
            drill.kill_cluster(self.sandbox, self.home)
            drill.wait_for(lambda: drill.decision_entry(self.view, job.logical_job,
                                                        trial.fault_at),
                           deadline, "the leader to decide the move")
            losses.kill_replica(self.sandbox, self.view.leader() or "")
        elif kind == "lose-site":
            losses.lose_site(self.sandbox, Site.HOME)
            self.watch.enter()
        else:
            netns.isolate_site(self.wan, PARTITIONED[kind])
            if kind == "partition-home":
                self.watch.enter()
        lines = drill.trace_lines(job.traces)
        trial.fault_step = lines[-1].step if lines else 0
        trial.offsite_at_fault = max(drill.verified_offsite(self.site, job.run), default=None)
        return set()

    def _recover(self, trial: chaos.Trial, job: drill.Training, frozen: set[int],
                 deadline: float) -> None:
        try:
            self._recover_from(trial, job, deadline)
        except BaseException:
            self._heal()  # the trial loop's own clean-up runs from the login host
            raise

    def _recover_from(self, trial: chaos.Trial, job: drill.Training, deadline: float) -> None:
        logical, after, kind = job.logical_job, trial.fault_at, trial.fault.kind
        if kind in ("lose-site", "partition-home"):
            drill.wait_for(lambda: self._entry("lease", logical, self.target, after),
                           deadline, f"{logical} to train on {self.target}")
            time.sleep(chaos.TRAINING_AFTER_MOVE_S)
            self._heal()
        elif kind in ("partition-control", "partition-remote"):
            time.sleep(CUT_S)
            self._heal()
        trial.healed_at = time.time()
        drill.wait_for(lambda: self._entry("finished", logical, None, after), deadline,
                       f"{logical} to finish")
        self.sandbox.up(progress=lambda _msg: None)  # whatever was killed, back
        if kind in ("lose-leader", "lose-site", "partition-home"):
            drill.wait_or_none(lambda: self._entry("fence", logical, self.home, after),
                               time.time() + 60)

    def _heal(self) -> None:
        self.watch.leave()
        netns.heal_all(self.wan)

    def _clean_up(self, trial: chaos.Trial) -> None:
        self._heal()
        super()._clean_up(trial)

    # --- checks ----------------------------------------------------------------------------

    def _check(self, trial: chaos.Trial, job: drill.Training) -> None:
        super()._check(trial, job)
        if trial.fault.kind in LEADER_LOST and trial.rto_target_s is not None:
            # the leader's loss: the successor leads within a TTL and a third of its
            # last renewal, and only then decides (the drill's RTO target does the same)
            assert self.site.federation is not None
            trial.rto_target_s += self.site.federation.leader_ttl_s * 4 / 3
        if trial.fault.kind in ("partition-control", "partition-remote"):
            trial.moved_during_cut = [m for m in trial.moves if m["after_fault"]]
        self.not_by_leader[trial.index] = [
            f"#{e.seq} {e.kind} by {e.detail.get('replica')}: {e.what}"
            for e in self.audit.entries(logical_job=None)
            if e.unix_time >= trial.fault_at and e.kind in DECISION_KINDS
            and e.detail.get("replica")
            and (e.logical_job in (None, job.logical_job))
            and not self.leaders.led_near(str(e.detail["replica"]), e.unix_time)]


def plan(trials: int, rng: random.Random, settings: drill.DrillSettings) -> list[SiteFault]:
    """Every kind equally often (shuffled), each at a random step (lose-site: of a
    checkpoint being replicated) after the first checkpoint is off-site."""
    kinds = [KINDS[i % len(KINDS)] for i in range(trials)]
    rng.shuffle(kinds)
    every = settings.ckpt_every
    faults = []
    for kind in kinds:
        step = rng.randrange(2 * every, settings.steps - 2 * every)
        if kind == "lose-site":
            step = (step // every) * every
        faults.append(SiteFault(kind, step))
    return faults


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated subset")
    parser.add_argument("--keep", action="store_true", help="leave the sandbox up")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    kinds = [k for k in args.kinds.split(",") if k]
    faults = [f for f in plan(args.trials * len(KINDS), random.Random(seed), chaos.SETTINGS)
              if f.kind in kinds][:args.trials]
    print(f"seed {seed}; bringing up {SANDBOX_DIR} (port base {PORT_BASE}, replicated)",
          file=sys.stderr)
    subprocess.run([sys.executable, "-m", "slurm_geo", "sandbox", "up", "--dir",
                    str(SANDBOX_DIR), "--port-base", str(PORT_BASE), "--replicated"],
                   check=True, capture_output=True)
    sandbox = Sandbox(SANDBOX_DIR)
    print("computing the reference weights", file=sys.stderr)
    reference = drill.reference_weights(chaos.SETTINGS)
    runner = SiteChaos(sandbox, chaos.SETTINGS, SANDBOX_DIR / "chaos", reference)
    trials = []
    for index, fault in enumerate(faults, 1):
        trial = runner.run(index, fault)  # type: ignore[arg-type]
        trials.append(trial)
        print(f"trial {index}/{len(faults)} {fault.kind}@{fault.step}: rto {trial.rto_s} "
              f"identical {trial.bit_identical} (a) {len(trial.overlap)} "
              f"(b) {len(trial.unverified)} (c) {len(runner.not_by_leader.get(index, []))} "
              f"moved during cut {len(trial.moved_during_cut)} {trial.seconds} s"
              + (f" ERROR {trial.error}" if trial.error else ""), file=sys.stderr)
    runner.close()
    summary = chaos.summary(trials, chaos.SETTINGS)
    summary["violations_decided_without_the_lease"] = sum(
        bool(runner.not_by_leader.get(t.index)) for t in trials)
    summary["faults"] = dict(Counter(t.fault.kind for t in trials))
    result = {"seed": seed, "settings": asdict(chaos.SETTINGS), "summary": summary,
              "trials": [{**asdict(t), "not_by_leader": runner.not_by_leader.get(t.index, []),
                          "violates": t.violates} for t in trials]}
    out = ROOT / "bench" / "results" / f"site_chaos-{time.strftime('%Y%m%dT%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    print(chaos.table(trials))
    print(json.dumps(summary, indent=2))
    print(f"results: {out}", file=sys.stderr)
    if not args.keep:
        sandbox.down(purge=True)
    if any(t.violates for t in trials) or summary["violations_decided_without_the_lease"]:
        return 1
    lost = [t for t in trials if "COMPLETED" not in (t.finished or "")]
    return 2 if any(t.error or not t.bit_identical for t in trials) or lost else 0


if __name__ == "__main__":
    sys.exit(main())
