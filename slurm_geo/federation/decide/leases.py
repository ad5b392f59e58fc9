"""Training leases: the rule that keeps two incarnations of a job from training at once.

A training job asks the federation daemon for a lease before it trains and renews it
every third of `lease_ttl_s`. It trains only while its last renewal is younger than
`TRAINER_SHARE` (slurm_geo.lease.protocol) of the TTL, measured on its own monotonic
clock, so a process frozen and thawed sees at once that its lease is stale. The daemon
starts another generation only after the current lease was released or has not been
renewed for a whole TTL. Between the two lies a margin of (1 - TRAINER_SHARE) x TTL for
clock-rate drift and late packets.

`decide` is pure: the daemon gives it what it knows and applies the verdict.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from slurm_geo.federation.model import JobStatus, Lease, LogicalJob
from slurm_geo.lease.protocol import Action, LeaseRequest


class Verdict(Enum):
    """The lease protocol's verdicts, and one the daemon acts on before answering."""

    GRANT = "grant"
    WAIT = "wait"
    FENCED = "fenced"
    REGISTER = "register"    # a home job the daemon has not seen: register, then grant


@dataclass(frozen=True)
class Answer:
    verdict: Verdict
    reason: str
    action: Action = Action.TRAIN


def decide(job: LogicalJob | None, lease: Lease | None, request: LeaseRequest, home: str,
           now: float, ttl_s: float, move_waits: str | None = "") -> Answer:
    """`move_waits`: why the job's planned move cannot happen yet (its world is not at the
    target: federation.worldwait), '' when it can; None while the daemon has not looked
    at the target yet. Unless it can, the trainer keeps training instead of releasing."""
    if job is None:
        if request.generation == 0 and request.cluster == home:
            return Answer(Verdict.REGISTER, "first lease of a job on the home cluster")
        return Answer(Verdict.FENCED, f"no logical job has generation {request.generation} "
                      f"on {request.cluster}:{request.job_id}")
    if job.status.is_final():
        return Answer(Verdict.FENCED, f"logical job {job.logical_job} is {job.status.value}")
    if request.generation != job.generation:
        return Answer(Verdict.FENCED, f"generation {request.generation} is stale: the job is "
                      f"at generation {job.generation} on {job.cluster}")
    if request.cluster != job.cluster:
        return Answer(Verdict.FENCED, f"generation {job.generation} runs on {job.cluster}, "
                      f"not {request.cluster}")
    if job.status is JobStatus.MOVING or job.job_id is None:
        return Answer(Verdict.WAIT, "the daemon is still recording this incarnation")
    if request.job_id != job.job_id:
        return Answer(Verdict.FENCED, f"generation {job.generation} is Slurm job "
                      f"{job.job_id}, not {request.job_id}")
    same_generation = lease is not None and lease.generation == job.generation
    if same_generation and lease is not None:
        if request.restart < lease.restart:
            return Answer(Verdict.FENCED, f"restart {request.restart} is older than restart "
                          f"{lease.restart}, which holds the lease")
        if request.restart > lease.restart and not lease.expired(now, ttl_s):
            return Answer(Verdict.WAIT, f"restart {lease.restart} may still be training; its "
                          "lease has not run out")
    if request.release:
        return Answer(Verdict.GRANT, "lease released", Action.RELEASE)
    if job.move_to is not None and (request.last_step or -1) > (job.move_after_step or -1):
        if move_waits is None:
            return Answer(Verdict.GRANT, f"lease renewed; the move to {job.move_to} waits "
                          "for the daemon to look for the job's world there")
        if move_waits:
            return Answer(Verdict.GRANT, f"lease renewed; the move to {job.move_to} waits: "
                          f"{move_waits}")
        return Answer(Verdict.GRANT, f"moving to {job.move_to} from checkpoint "
                      f"{request.last_step}", Action.RELEASE)
    return Answer(Verdict.GRANT, "lease renewed")
