"""A drill's report as the verdict and progress tests read one."""

from __future__ import annotations

from dataclasses import asdict

from slurm_geo.drills.drill import DrillSettings
from slurm_geo.drills.report import DrillReport

KILLED_AT = 1_000_000.0
WINDOW_S = 3.0  # RTO target: window + 15 s = 18 s


def report(rto_s: float | None = 9.0, steps_lost: int | None = 20, identical: bool = True,
           audit_ok: bool = True, ran_as: dict[str, int] | None = None,
           predicted_s: float | None = 0.0, actual_s: float | None = 0.1) -> DrillReport:
    last_step_home = 100
    resume = None if steps_lost is None else last_step_home - steps_lost
    running = None if rto_s is None else KILLED_AT + rto_s
    return DrillReport(
        run="r", logical_job="onprem-1", home="onprem", target="rented",
        settings=asdict(DrillSettings(ckpt_every=40)), killed_at=KILLED_AT,
        detected_at=KILLED_AT + 2.5, moved_at=KILLED_AT + 3.0, running_elsewhere_at=running,
        completed_at=None if running is None else running + 10, detection_window_s=WINDOW_S,
        last_step_home=last_step_home, offsite_step_at_kill=80, resume_step=resume,
        steps_lost=steps_lost, final_step=240, final_weights="a" * 64,
        reference_weights="a" * 64 if identical else "b" * 64, bit_identical=identical,
        replicated_bytes=1, replication_seconds=0.1, predicted_transfer_s=predicted_s,
        actual_transfer_s=actual_s, legs=[], stale_incarnation="onprem:1 cancelled: fenced",
        audit_ok=audit_ok, owner="alice", owner_uid=2001,
        ran_as={"onprem:1": 2001, "rented:1": 2001} if ran_as is None else ran_as)
