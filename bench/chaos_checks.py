"""The chaos benchmarks' invariants, checked after each trial (bench/federation_chaos.py,
bench/site_chaos.py): pure functions over what a trial left behind, the trained steps'
trace, the audit log's entries and each incarnation's output and uid.

(a) never two incarnations training; (b) never a resume from an unverified checkpoint;
(e) every incarnation ran as its owner's account; and the incarnations that never trained.
"""

from __future__ import annotations

from pathlib import Path

from slurm_geo.drills import drill
from slurm_geo.federation.state.audit import Entry
from slurm_geo.sandbox.users import ALICE


def overlaps(lines: list[drill.TraceLine]) -> list[str]:
    """(a): steps of a generation traced after a newer generation's first step."""
    first: dict[int, float] = {}
    for line in lines:
        first[line.generation] = min(first.get(line.generation, line.time), line.time)
    found = []
    for line in lines:
        newer = [(t, g) for g, t in first.items() if g > line.generation and t <= line.time]
        if newer:
            t, g = min(newer)
            found.append(f"generation {line.generation} ({line.incarnation}) trained step "
                         f"{line.step} {line.time - t:.3f} s after generation {g} began")
    return found


def not_as_owner(ran_as: dict[str, int], accounts: dict[str, int]) -> list[str]:
    """(e): incarnations ('cluster:job') run as anyone but alice's account on its cluster."""
    return [f"{incarnation} as uid {uid}" for incarnation, uid in ran_as.items()
            if uid != accounts.get(incarnation.partition(":")[0], ALICE.uid)]


def unverified_resumes(entries: list[Entry], work: Path | list[Path]) -> list[str]:
    """(b): each requeue resumes from the step the daemon's last verify before it verified
    (or, for a job that never trained, from nothing), and the incarnation says it started
    there."""
    found = []
    for index, entry in enumerate(entries):
        if entry.kind != "requeue":
            continue
        resume = entry.detail.get("resume_step")
        earlier = entries[:index]
        verifies = [e for e in earlier if e.kind == "verify"]
        never_trained = not any(e.kind == "lease" for e in earlier)
        if verifies:
            last = verifies[-1]
            ok = (last.detail.get("step") == resume and " verified in " in last.what) \
                if resume is not None else last.what.startswith("no checkpoint")
            if not ok:
                found.append(f"requeue #{entry.seq} resumes from {resume}; the last verify "
                             f"said '{last.what}'")
        elif not (never_trained and resume is None):
            found.append(f"requeue #{entry.seq}: no verify entry before it")
        output = drill.job_output(work, int(entry.detail["job_id"]),
                                  str(entry.detail["cluster"]))
        started = [line for line in output.splitlines() if line.startswith("started at step")]
        if started and started[0] != f"started at step {resume or 0}":
            found.append(f"requeue #{entry.seq} named step {resume}; the incarnation says "
                         f"'{started[0]}'")
    return found


def failed_resumes(entries: list[Entry], work: Path | list[Path]) -> list[str]:
    """Incarnations the daemon submitted that never started training: superseded before
    they ran (a move for the queue, then another), or unable to (no run key). Not (b):
    nothing was resumed; the job is lost only if it did not complete."""
    found = []
    for entry in entries:
        if entry.kind != "requeue":
            continue
        output = drill.job_output(work, int(entry.detail["job_id"]),
                                  str(entry.detail["cluster"]))
        if "started at step" not in output:
            errors = [line for line in output.splitlines() if line.startswith("error:")]
            found.append(f"generation {entry.detail.get('generation')} on "
                         f"{entry.detail.get('cluster')}:{entry.detail.get('job_id')} never "
                         f"started: {errors[0] if errors else 'no output'}")
    return found
