"""`slurm-geo plan`, `status`, `approve`, `cancel`, `resubmit` and `logs`: a logical job
across clusters. JOB is a logical job id (onprem-1234), CLUSTER:JOBID of any of its
incarnations, a bare Slurm job id, or its run name. `slurm-geo federation status`: the
daemon's replicas and etcd's members."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from slurm_geo.config.model import SiteConfig
    from slurm_geo.federation.state.interface import State

CONFIG_HELP = "Site config (default: $SLURM_GEO_CONFIG or /etc/slurm-geo/config.toml)."
JSON_HELP = "Print JSON."


@click.command("plan")
@click.argument("job")
@click.option("--config", type=click.Path(path_type=Path), default=None, help=CONFIG_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan(job: str, config: Path | None, as_json: bool) -> None:
    """Where logical job JOB (e.g. onprem-1234) should run now: every cluster's predicted
    transfer, queue wait and cost, whether it is eligible, and the choice with its reason.
    Read-only: the federation daemon makes the moves."""
    from slurm_geo.federation.decide.planner import plan_to_json, render_plan
    from slurm_geo.federation.engine.runtime import build
    from slurm_geo.federation.operator.operations import resolve

    federation = build(config, daemon=False)
    chosen = federation.plan_for(resolve(federation.state, job))
    click.echo(json.dumps(plan_to_json(chosen), indent=2) if as_json else render_plan(chosen))


@click.command("status")
@click.argument("job", required=False)
@click.option("--config", type=click.Path(path_type=Path), default=None, help=CONFIG_HELP)
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
def status(job: str | None, config: Path | None, as_json: bool) -> None:
    """A logical job across clusters: what on-call sees (moving, awaiting-approval,
    cluster-out, held with Slurm's reason, else its lifecycle status), its recoveries,
    the step it resumed at, where it runs, its lease and its generations (one per
    incarnation). Without JOB: every logical job. JOB is a logical job id (onprem-1234),
    CLUSTER:JOBID of any incarnation, a Slurm job id or a run name, here as in cancel,
    resubmit, logs, plan and approve."""
    from slurm_geo.config.model import load_config
    from slurm_geo.federation.engine.runtime import slurm_client
    from slurm_geo.federation.model import UnknownLogicalJob
    from slurm_geo.federation.operator.operations import current_in_slurm, display_state, resolve
    from slurm_geo.federation.operator.ownerclient import OwnerClient, reads_daemon_files
    from slurm_geo.federation.operator.views import job_view
    from slurm_geo.federation.state.open import federation_config

    site = load_config(config)
    if not reads_daemon_files(site):  # a user: the daemon answers for her own jobs
        _print_views(OwnerClient(site).ask("status", job or "")["views"], job, as_json)
        return
    state = _open_state(site)
    if state is None:  # the daemon has not started yet: no logical jobs
        if job:
            raise UnknownLogicalJob(job)
        views: list[dict[str, Any]] = []
    else:
        jobs = [resolve(state, job)] if job else state.jobs()
        health = state.health()
        fed = federation_config(site)
        clients = {name: slurm_client(c, fed) for name, c in site.clusters.items()}
        slurm = current_in_slurm(clients, jobs, health)
        views = [job_view(state, j, display_state(j, health, slurm.get(j.logical_job)),
                          slurm.get(j.logical_job), _world_staging(site, j) if job else None)
                 for j in jobs]
    _print_views(views, job, as_json)


def _world_staging(site: SiteConfig, job: Any) -> dict[str, Any] | None:
    """Where an admin's job's world is staged, read from the stores with the master key
    (federation.worldstatus, as the daemon reads it for an owner)."""
    import os
    import time

    from slurm_geo.ckpt.errors import CkptError
    from slurm_geo.ckpt.format.keys import LiveKeyFile
    from slurm_geo.ckpt.stores.open_store import DECIDING, open_store
    from slurm_geo.config.paths import master_key_path
    from slurm_geo.federation.act.worldgrants import world_roots
    from slurm_geo.federation.operator.worldstatus import job_world_status
    from slurm_geo.federation.state.open import federation_config

    if not job.run or not world_roots(job):
        return None
    try:
        keys = LiveKeyFile(master_key_path(federation_config(site).key_file, os.environ))
        stores = {name: open_store(store.url, endpoint_url=store.endpoint_url or None,
                                   patience=DECIDING, ca_file=store.ca_file)
                  for name, store in site.stores.items()}
        return job_world_status(stores, keys, site, job, time.time())
    except (CkptError, OSError) as exc:
        return {"error": str(exc)}


def _print_views(views: list[dict[str, Any]], job: str | None, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(views if job is None else views[0], indent=2))
    else:
        click.echo(_render_list(views) if job is None else _render(views[0]))


def _open_state(site: SiteConfig) -> State | None:
    """The state, read-only; None before the daemon alone on SQLite ever started."""
    from slurm_geo.federation.state.open import federation_config, read_state

    return read_state(federation_config(site))


def _where(cluster: str, job_id: int | None) -> str:
    return f"{cluster}:{'-' if job_id is None else job_id}"


def _dash(value: object) -> str:
    from slurm_geo.cells import cell

    return cell(value)


def _render_list(views: list[dict[str, Any]]) -> str:
    from slurm_geo.cells import table

    header = ("LOGICAL JOB", "RUN", "STATUS", "GEN", "RECOVERIES", "RESUMED AT", "WHERE",
              "REASON")
    return table([header] + [
        (v["logical_job"], _dash(v["run"]), v["shown"]["state"], str(v["generation"]),
         str(v["recoveries"]), _dash(v["resume_step"]), v["where"],
         _dash(v["shown"]["reason"])) for v in views], right=(3, 4, 5))


def _render(view: dict[str, Any]) -> str:
    lease, shown = view["lease"], view["shown"]
    reason = f" ({shown['reason']})" if shown["reason"] else ""
    lines = [f"{view['logical_job']}  run {_dash(view['run'])}  home {view['home']}  "
             f"{shown['state']}{reason}, generation {view['generation']} on "
             f"{view['where']}",
             f"  recoveries {view['recoveries']}, resumed at step {_dash(view['resume_step'])}"
             + (f", away from home ({view['left_home']})" if view["left_home"] else "")]
    lines += _world_lines(view.get("world"))
    lines += staging_lines(view.get("world_staging"))
    if view["move_to"]:
        lines.append(f"  moving to {view['move_to']} at its next checkpoint")
    if lease:
        lines.append(f"  lease: generation {lease['generation']} on "
                     f"{_where(lease['cluster'], lease['job_id'])}, renewed "
                     f"{_dash(lease['renewed_at'])}, last checkpoint "
                     f"{_dash(lease['last_step'])}{' (released)' if lease['released'] else ''}")
    lines.append(f"  {'GEN':>3}  {'WHERE':<16} {'RESUMED AT':>10}  {'TRAINING SINCE':<26} "
                 "ENDED")
    for i in view["incarnations"]:
        ended = f"{i['ended_at']} ({_dash(i['end_reason'])})" if i["ended_at"] else "-"
        lines.append(f"  {i['generation']:>3}  {_where(i['cluster'], i['job_id']):<16} "
                     f"{_dash(i['resume_step']):>10}  {i['training_at'] or '-':<26} {ended}")
    return "\n".join(lines)


def _world_lines(world: dict[str, Any] | None) -> list[str]:
    """inputs, env, outputs: a line each, '-' when none (a daemon too old to say: none)."""
    from slurm_geo.policy.world import Input, World

    if not world:
        return []
    if world.get("error"):
        return [f"  inputs, env, outputs: unreadable ({world['error']})"]
    declared = World(tuple(Input(i["path"], i["data_class"]) for i in world["inputs"]),
                     world["env"], tuple(world["outputs"]))
    return [f"  {label:<8}{text}" for label, text in declared.lines()]


def staging_lines(staging: dict[str, Any] | None) -> list[str]:
    """Where the world is staged (federation.worldstatus): the lag and bytes pending, a
    line per root with its size and its state at each other store, and why the job is
    not movable while its world is staged nowhere but home."""
    from slurm_geo.cells import table
    from slurm_geo.cli.progress import human_bytes, human_seconds

    if not staging:
        return []
    if "roots" not in staging:
        return [f"  staging: not read ({staging.get('error', '-')})"]
    pending = ", ".join(f"{name} {human_bytes(n)}"
                        for name, n in sorted(staging["pending_bytes"].items())) or "-"
    lag = staging["lag_s"]
    lines = [f"  staging: home store {staging['home_store']}, lag "
             f"{'-' if lag is None else human_seconds(lag)}, pending {pending}"]
    stores = sorted({name for r in staging["roots"] for name in r["stores"]})
    rows = [("ROOT", "WHAT", "CLASS", "SIZE", *stores)] + [
        (r["path"], r["what"], r["data_class"],
         "-" if r["bytes"] is None else human_bytes(r["bytes"]),
         *(f"{name}: {r['stores'].get(name, '-')}" for name in stores))
        for r in staging["roots"]]
    lines += [f"    {line}" for line in table(rows, right=(3,)).splitlines()]
    for name, error in sorted(staging.get("errors", {}).items()):
        lines.append(f"    {name}: not read ({error})")
    if staging["why_not_movable"]:
        lines.append(f"  not movable: {staging['why_not_movable']}")
    return lines


def _who() -> str:
    """Who runs the command, from the process's real uid (not $USER, which anyone sets);
    under sudo, also who called sudo."""
    import os
    import pwd

    name = pwd.getpwuid(os.getuid()).pw_name
    sudo = os.environ.get("SUDO_USER")
    return f"{name} (sudo by {sudo})" if os.getuid() == 0 and sudo else name


@click.command("approve")
@click.argument("job")
@click.argument("cluster")
@click.option("--config", type=click.Path(path_type=Path), default=None, help=CONFIG_HELP)
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
def approve(job: str, cluster: str, config: Path | None, as_json: bool) -> None:
    """Consent to moving logical job JOB to CLUSTER, for jobs without
    --geo-failover=auto, or to move any job there (it then stays there: no failback). A
    job whose cluster is out, or that is still queued, moves as soon as the daemon's plan
    chooses CLUSTER; a running job moves at its next checkpoint. Never where the job's
    policy forbids (residency, data class, --geo-clusters, --geo-failover=never). A user
    approves moves of her own jobs (asked of the daemon); an admin, of any."""
    from slurm_geo.federation.engine.runtime import build
    from slurm_geo.federation.operator.operations import resolve

    site = _asks_daemon(config)
    if site is not None:  # a user: the daemon approves her own job's move
        from slurm_geo.federation.operator.ownerclient import OwnerClient

        report = OwnerClient(site).ask("approve", job, cluster=cluster)
    else:
        federation = build(config, daemon=False)
        who = _who()
        moved = federation.approve(resolve(federation.state, job).logical_job, cluster, who)
        report = {"logical_job": moved.logical_job, "cluster": cluster, "approved_by": who}
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(f"{report['logical_job']}: move to {cluster} approved by "
               f"{report['approved_by']}; the federation daemon makes it when its plan "
               "chooses it")


@click.command("cancel")
@click.argument("job")
@click.option("--config", type=click.Path(path_type=Path), default=None, help=CONFIG_HELP)
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
def cancel(job: str, config: Path | None, as_json: bool) -> None:
    """Cancel logical job JOB: its status becomes cancelled, its lease is released (a
    trainer still running is fenced at its next renewal and exits 33), and every
    incarnation Slurm still runs or queues is cancelled on the clusters that answer.
    Those it cannot reach are listed; run it again once they answer. Audited."""
    from slurm_geo.federation.engine.runtime import build
    from slurm_geo.federation.operator import operations

    site = _asks_daemon(config)
    if site is not None:  # a user: the daemon cancels her own job
        from slurm_geo.federation.operator.ownerclient import OwnerClient

        report = OwnerClient(site).ask("cancel", job)
    else:
        federation = build(config, daemon=False)
        report = operations.cancel(federation, operations.resolve(federation.state, job),
                                   _who()).to_json()
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(f"{report['logical_job']}: cancelled by {report['by']}")
    for o in report["incarnations"]:
        detail = f" ({o['detail']})" if o["detail"] else ""
        click.echo(f"  {_where(o['cluster'], o['job_id']):<16} generation {o['generation']}: "
                   f"{o['result']}{detail}")
    if any(o["result"] == "not reached" for o in report["incarnations"]):
        click.echo(f"  run `slurm-geo cancel {report['logical_job']}` again once those "
                   "clusters answer; their trainers are fenced meanwhile")


def _asks_daemon(config: Path | None) -> SiteConfig | None:
    """The site, when this process cannot read the daemon's state or the master key (a
    user): her verbs go to the daemon (federation.ownerverbs); None for an admin."""
    import os

    from slurm_geo.config.model import load_config
    from slurm_geo.config.paths import master_key_path
    from slurm_geo.federation.operator.ownerclient import can_read_key, reads_daemon_files
    from slurm_geo.federation.state.open import federation_config

    site = load_config(config)
    if site.federation is None:
        return None  # build() says what is missing
    fed = federation_config(site)
    if reads_daemon_files(site) and can_read_key(master_key_path(fed.key_file, os.environ)):
        return None
    return site


@click.command("resubmit")
@click.argument("job")
@click.option("--config", type=click.Path(path_type=Path), default=None, help=CONFIG_HELP)
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
def resubmit(job: str, config: Path | None, as_json: bool) -> None:
    """Resubmit logical job JOB, which ended failed, as a new generation from its newest
    checkpoint that verifies: at home if home answers, else where the plan chooses. Its
    lost-restart count starts again. Audited."""
    from slurm_geo.federation.engine.runtime import build
    from slurm_geo.federation.operator import operations

    site = _asks_daemon(config)
    if site is not None:  # a user: the daemon resubmits her own job
        from slurm_geo.federation.operator.ownerclient import OwnerClient

        moved = OwnerClient(site).ask("resubmit", job)
    else:
        federation = build(config, daemon=False)
        from slurm_geo.federation.operator.views import resubmitted_view

        moved = resubmitted_view(operations.resubmit(
            federation, operations.resolve(federation.state, job), _who()))
    if as_json:
        click.echo(json.dumps({k: v for k, v in moved.items() if k != "run"}, indent=2))
        return
    click.echo(f"{moved['logical_job']}: generation {moved['generation']} "
               f"{moved['status']} as {_where(moved['cluster'], moved['job_id'])}, resuming "
               f"{_dash(moved['run'])} from step {_dash(moved['resume_step'])}")


@click.command("logs")
@click.argument("job")
@click.option("--follow", "-f", is_flag=True,
              help="Keep printing the current incarnation's output, and the next one's when "
              "the job moves, until the job ends.")
@click.option("--config", type=click.Path(path_type=Path), default=None, help=CONFIG_HELP)
def logs(job: str, follow: bool, config: Path | None) -> None:
    """Logical job JOB's output across its incarnations and clusters, in generation order,
    each under a header line (CLUSTER:JOBID, generation, file). A moved incarnation's log
    is read as it shipped it home (from the home store, under the run's key: yours, or an
    admin's); one that shipped none says where its file would be."""
    from slurm_geo.config.model import load_config
    from slurm_geo.federation.model import UnknownLogicalJob
    from slurm_geo.federation.operator.operations import resolve
    from slurm_geo.federation.operator.output import JobOutput
    from slurm_geo.federation.operator.ownerclient import (
        AskedState,
        OwnerClient,
        reads_daemon_files,
    )

    site = load_config(config)
    users = {name: c.rest_user for name, c in site.clusters.items()
             if c.access == "rest" and c.rest_user}
    from slurm_geo.cli.shipped import shipped_logs

    if not reads_daemon_files(site):  # a user: the daemon says where her job's output is
        asked = AskedState(OwnerClient(site), job)
        shipped = shipped_logs(site, asked.job(asked.logical_job))
        output = JobOutput(asked, asked.logical_job,  # type: ignore[arg-type]
                           lambda text: click.echo(text, nl=False), users, shipped)
    else:
        state = _open_state(site)
        if state is None:
            raise UnknownLogicalJob(job)
        logical_job = resolve(state, job).logical_job
        output = JobOutput(state, logical_job, lambda text: click.echo(text, nl=False), users,
                           shipped_logs(site, state.job(logical_job)))
    if follow:
        output.follow()
    else:
        output.print_all()


@click.group("federation")
def federation() -> None:
    """The federation daemon's replicas and the etcd members their state is in."""


@federation.command("status")
@click.option("--config", type=click.Path(path_type=Path), default=None, help=CONFIG_HELP)
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
def federation_status(config: Path | None, as_json: bool) -> None:
    """Every replica (does it answer GET /v1/leader, does it lead), who leads as etcd
    says, and each etcd member's health, raft index and lag behind the furthest member.
    A daemon alone on SQLite shows itself. Read-only."""
    import os
    import ssl

    from slurm_geo.ckpt.format.keys import load_master_key
    from slurm_geo.config.model import load_config
    from slurm_geo.config.paths import master_key_path
    from slurm_geo.federation.operator.replication import render, replication_status
    from slurm_geo.federation.state.open import federation_config, open_kv

    fed = federation_config(load_config(config))
    tls = ssl.create_default_context(cafile=None if fed.ca_file is None else str(fed.ca_file))
    kv = open_kv(fed, load_master_key(master_key_path(fed.key_file, os.environ))) \
        if fed.replicated else None
    try:
        found = replication_status(fed, kv, tls)
    finally:
        if kv is not None:
            kv.close()
    click.echo(json.dumps(found.to_json(), indent=2) if as_json else render(found))


@federation.group("runs")
def federation_runs() -> None:
    """Runs of the federation and their owners: an admin's verbs."""


@federation_runs.command("assign")
@click.argument("run")
@click.option("--owner", "user", required=True, metavar="USER",
              help="The user whose jobs may name RUN and get its key from now on.")
@click.option("--force", is_flag=True,
              help="Take RUN from the owner it has now (an earlier assignment, or the owner "
              "of the jobs that named it) and give it to USER; audited with both.")
@click.option("--config", type=click.Path(path_type=Path), default=None, help=CONFIG_HELP)
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
def federation_runs_assign(run: str, user: str, force: bool, config: Path | None,
                           as_json: bool) -> None:
    """Give RUN, a run in a store that no job of the federation names (written by an
    operator, an older slurm-geo, a job that never leased), to USER: from then on USER's
    jobs, and no one else's, may name it, train on and get its key. Refused while a job
    that names RUN is active, for a run that has an owner unless --force, for a run no
    store holds and for a name that is no user who runs jobs. Admins only (root, the
    daemons' service account: whoever reads the federation state and the master key).
    Audited."""
    from slurm_geo.exitcodes import ExitCode
    from slurm_geo.federation.engine.runtime import build
    from slurm_geo.federation.operator.runowners import AssignRefused, assign

    if _asks_daemon(config) is not None:
        raise AssignRefused("federation runs assign is an admin's command: run it as root or "
                            "the daemons' service account, which read the federation state "
                            "and the master key", ExitCode.NOT_OWNER)
    federation = build(config, daemon=False)
    answer = assign(federation, run, user, force, _who())
    if as_json:
        click.echo(json.dumps(answer, indent=2))
        return
    if not answer["changed"]:
        click.echo(f"run {run} already belongs to {user}; nothing changed")
        return
    taken = f", taken from {answer['previous_owner']}" if answer["previous_owner"] \
        and answer["previous_owner"] != user else ""
    click.echo(f"run {run} now belongs to {user}{taken}: their jobs may name it and get its "
               "key (audited)")
