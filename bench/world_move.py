"""Issue 31: the planner's predicted time to resume a job whose world is not staged at its
target, against the actual, on a sandbox (SLURM_GEO_SANDBOX_DIR; rented the provider's).

Alice's job at home declares a fresh dataset of random bytes (`--mb`, nothing dedups) as
`--geo-inputs`; its trainer stages it into home's store (stage.home). The moment the
run's world record is there, and before checkpoint-sync has copied it off-site, a move to
rented is decided (`slurm-geo approve JOB rented`, as an owner's or admin's move would
be). The daemon says, once, "staging the world to rented: N MB left, ~T s" with the
plan's prediction for rented (`predicted_s`: the world's missing bytes put and read back
at the link's measured rate, the checkpoint, rented's queue wait), keeps the job training
at home until checkpoint-sync has the world's record at rented, then moves it at its next
checkpoint. Actual: from the decision (the approval's audit entry) to the new
incarnation's first step on rented (its trainer's "started at step N", after its
preamble took the lease and materialised the world), with the world's arrival at
rented and the submission on the way. The job is cancelled at the end and the dataset removed.

    SLURM_GEO_SANDBOX_DIR=/var/tmp/sgX python bench/world_move.py [--mb 1024] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from slurm_geo.config.model import load_config  # noqa: E402
from slurm_geo.drills import drill, losses  # noqa: E402
from slurm_geo.sandbox import Sandbox, remote_site  # noqa: E402
from slurm_geo.sandbox.users import ALICE  # noqa: E402
from slurm_geo.slurm import connect  # noqa: E402
from slurm_geo.sync.worldstate import read_worlds  # noqa: E402
from tests.conftest import user_dir  # noqa: E402
from tests.helpers import teed_trainer, with_directive  # noqa: E402

SHARD_MB = 128


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=1024, help="dataset size, MB (10^6 B)")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    sandbox = Sandbox(Path(os.environ.get("SLURM_GEO_SANDBOX_DIR",
                                          "/var/lib/slurm-geo/sandbox")))
    site = load_config(sandbox.layout.site_config)
    assert site.sync is not None
    onprem = connect(site.cluster("onprem"))
    stamp = int(time.time())
    data = user_dir(sandbox, ALICE, f"world-move-data-{stamp}")
    left = args.mb * 10**6
    for shard in range((left + SHARD_MB * 10**6 - 1) // (SHARD_MB * 10**6)):
        size = min(left, SHARD_MB * 10**6)
        path = data / f"tokens-{shard:02d}.bin"
        with open(path, "wb") as handle:
            for _ in range(size // 10**6):
                handle.write(os.urandom(10**6))
        path.chmod(0o600)
        os.chown(path, ALICE.uid, ALICE.uid)
        left -= size
    work = user_dir(sandbox, ALICE, f"world-move-{stamp}")
    run = f"world-move-{stamp}"
    settings = drill.DrillSettings(steps=4000, ckpt_every=25, step_delay_s=0.2)
    script = drill.training_script(site, run, settings, work, work / "trace.log")
    # The trainer's lines into the job's Slurm output too, which rented writes on the
    # provider's disk: its "started at step N" is the new incarnation's first step.
    lines, _ = teed_trainer(with_directive(script, f"--geo-inputs={data}"))
    script = "\n".join(lines) + "\n"
    account_dir = remote_site.operator_path(sandbox.layout, ALICE.name,
                                            remote_site.work_dir(ALICE.name))
    job_id = onprem.submit(drill.job_spec(site, sandbox.layout, script, work))
    logical = f"onprem-{job_id}"
    audit = losses.FederationView(site)
    deadline = time.time() + args.timeout
    record = Path(site.stores["pfs"].url.removeprefix("file://")) / "worlds" / run
    result: dict[str, object] = {"mb": args.mb, "logical_job": logical, "run": run}
    try:
        submitted = time.time()
        drill.wait_for(lambda: record.exists() or None, deadline,
                       f"{run}'s world record in home's store")
        result["staged_at_home_s"] = round(time.time() - submitted, 1)
        subprocess.run([sys.executable, "-m", "slurm_geo", "approve", logical, "rented",
                        "--config", str(site.source)], check=True, capture_output=True)
        approved = drill.wait_for(lambda: drill.audit_entry(audit, "approval", logical, None,
                                                            0), deadline, "the approval")
        t0 = approved.unix_time
        waits = drill.wait_for(lambda: next(
            (e for e in audit.entries(logical_job=logical) if e.kind == "decision"
             and "waits for its world" in e.what), None), deadline, "the world wait")
        predicted = waits.detail.get("predicted_s")
        world_there = None
        out: Path | None = None
        requeued = None
        while True:
            if world_there is None and any(r.complete for r in read_worlds(site.sync.state,
                                                                           run)):
                world_there = time.time() - t0
            requeued = drill.audit_entry(audit, "requeue", logical, "rented", t0)
            out = None if requeued is None else \
                account_dir / f"geo-drill-{requeued.detail['job_id']}.slurm.out"
            if out is not None and out.exists() and "started at step" in out.read_text():
                started_at = time.time()
                break
            if time.time() > deadline:
                raise TimeoutError("no lease on rented")
            time.sleep(0.2)
        leased = drill.audit_entry(audit, "lease", logical, "rented", t0)
        assert out is not None and requeued is not None
        said = out.read_text()
        actual = started_at - t0
        result.update({
            "world_complete_at_rented_after_s": None if world_there is None
            else round(world_there, 1),
            "wait_said": waits.why, "missing_bytes": waits.detail.get("missing_bytes"),
            "predicted_s": predicted, "plan": waits.detail.get("plan"),
            "actual_s": round(actual, 1),
            "submitted_on_rented_after_s": round(requeued.unix_time - t0, 1),
            "preamble_lease_after_s": None if leased is None
            else round(leased.unix_time - t0, 1),
            "world_line": next((line for line in said.splitlines()
                                if line.startswith("slurm-geo: world:")), None),
            "started_line": next((line for line in said.splitlines()
                                  if "started at step" in line), None),
            "ratio_actual_over_predicted": None if not predicted
            else round(actual / float(predicted), 3),
        })
    finally:
        subprocess.run([sys.executable, "-m", "slurm_geo", "cancel", logical, "--config",
                        str(site.source)], check=False, capture_output=True)
        for path in data.iterdir():
            path.unlink()
    print(json.dumps(result, indent=2, default=str) if args.json else
          "\n".join(f"{k}: {v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
