"""`slurm-geo plan JOB`, `status [JOB]` and `approve JOB CLUSTER`: a logical job across
clusters."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click

CONFIG_HELP = "Site config (default: $SLURM_GEO_CONFIG or /etc/slurm-geo/config.toml)."


@click.command("plan")
@click.argument("job")
@click.option("--config", type=click.Path(path_type=Path), default=None, help=CONFIG_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan(job: str, config: Path | None, as_json: bool) -> None:
    """Where logical job JOB (e.g. onprem-1234) should run now: every cluster's predicted
    transfer, queue wait and cost, whether it is eligible, and the choice with its reason.
    Read-only: the federation daemon makes the moves."""
    from slurm_geo.federation.planner import plan_to_json, render_plan
    from slurm_geo.federation.runtime import build

    federation = build(config, daemon=False)
    chosen = federation.plan_for(federation.state.job(job))
    click.echo(json.dumps(plan_to_json(chosen), indent=2) if as_json else render_plan(chosen))


@click.command("status")
@click.argument("job", required=False)
@click.option("--config", type=click.Path(path_type=Path), default=None, help=CONFIG_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def status(job: str | None, config: Path | None, as_json: bool) -> None:
    """A logical job across clusters: its generations (one per cluster it ran on), where
    it runs now, its lease and last checkpoint. Without JOB: every logical job."""
    from slurm_geo.config.model import load_config
    from slurm_geo.federation.runtime import federation_config
    from slurm_geo.federation.model import UnknownLogicalJob
    from slurm_geo.federation.state import FederationState

    path = federation_config(load_config(config)).state
    if not path.exists():  # the daemon has not started yet: no logical jobs
        if job:
            raise UnknownLogicalJob(job)
        views = []
    else:
        state = FederationState(path, readonly=True)
        views = [_view(state, j) for j in ([state.job(job)] if job else state.jobs())]
    if as_json:
        click.echo(json.dumps(views if job is None else views[0], indent=2))
    elif job is None:
        click.echo(f"{'LOGICAL JOB':<18} {'RUN':<20} {'STATUS':<10} {'GEN':>3}  WHERE")
        for view in views:
            click.echo(f"{view['logical_job']:<18} {view['run']:<20} {view['status']:<10} "
                       f"{view['generation']:>3}  {view['cluster']}:{view['job_id']}")
    else:
        click.echo(_render(views[0]))


def _view(state: Any, job: Any) -> dict[str, Any]:
    lease = state.lease(job.logical_job)
    return {
        "logical_job": job.logical_job, "run": job.run, "home": job.home,
        "status": job.status.value, "generation": job.generation, "cluster": job.cluster,
        "job_id": job.job_id, "resume_step": job.resume_step, "move_to": job.move_to,
        "lease": None if lease is None else {
            "generation": lease.generation, "cluster": lease.cluster, "job_id": lease.job_id,
            "renewed_at": _iso(lease.renewed_at), "last_step": lease.last_step,
            "released": lease.released},
        "incarnations": [{
            "generation": i.generation, "cluster": i.cluster, "job_id": i.job_id,
            "resume_step": i.resume_step, "submitted_at": _iso(i.submitted_at),
            "training_at": _iso(i.training_at), "ended_at": _iso(i.ended_at),
            "end_reason": i.end_reason} for i in state.incarnations(job.logical_job)],
    }


def _render(view: dict[str, Any]) -> str:
    lease = view["lease"]
    lines = [f"{view['logical_job']}  run {view['run']}  home {view['home']}  "
             f"{view['status']}, generation {view['generation']} on "
             f"{view['cluster']}:{view['job_id']}"]
    if view["move_to"]:
        lines.append(f"  moving to {view['move_to']} at its next checkpoint")
    if lease:
        lines.append(f"  lease: generation {lease['generation']} on {lease['cluster']}:"
                     f"{lease['job_id']}, renewed {lease['renewed_at']}, last checkpoint "
                     f"{lease['last_step']}{' (released)' if lease['released'] else ''}")
    lines.append(f"  {'GEN':>3}  {'WHERE':<16} {'RESUMED AT':>10}  {'TRAINING SINCE':<26} "
                 "ENDED")
    for i in view["incarnations"]:
        ended = f"{i['ended_at']} ({i['end_reason']})" if i["ended_at"] else "-"
        lines.append(f"  {i['generation']:>3}  {i['cluster'] + ':' + str(i['job_id']):<16} "
                     f"{i['resume_step']!s:>10}  {i['training_at'] or '-':<26} {ended}")
    return "\n".join(lines)


def _iso(epoch: float | None) -> str | None:
    return None if epoch is None else datetime.fromtimestamp(epoch, UTC).isoformat(
        timespec="seconds")


@click.command("approve")
@click.argument("job")
@click.argument("cluster")
@click.option("--config", type=click.Path(path_type=Path), default=None, help=CONFIG_HELP)
def approve(job: str, cluster: str, config: Path | None) -> None:
    """Consent to moving logical job JOB to CLUSTER, for jobs without
    --geo-failover=auto. A job whose cluster is out, or that is still queued, moves as soon
    as the daemon's plan chooses CLUSTER; a running job moves at its next checkpoint."""
    import getpass

    from slurm_geo.federation.runtime import build

    moved = build(config, daemon=False).approve(job, cluster, getpass.getuser())
    click.echo(f"{moved.logical_job}: move to {cluster} approved; the federation daemon "
               "makes it when its plan chooses it")
