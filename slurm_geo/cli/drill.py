"""`slurm-geo drill`: fail the home cluster, site or leader in the sandbox and report the
recovery."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command("drill")
@click.option("--dir", "sandbox_dir", type=click.Path(path_type=Path), default=None,
              help="Sandbox directory (default: $SLURM_GEO_SANDBOX_DIR or "
                   "/var/lib/slurm-geo/sandbox).")
@click.option("--sandbox-dir", "old_sandbox_dir", type=click.Path(path_type=Path),
              default=None, hidden=True)  # its spelling before every command said --dir
@click.option("--state-mb", type=click.FloatRange(0.01), default=None,
              help="Size of the job's checkpoints (weights and AdamW moments) in MiB. The "
                   "job is paced so that checkpoint-sync keeps up over the sandbox's link: "
                   "large states train fewer, longer steps [default: 128, 1 with --world].")
@click.option("--world", is_flag=True,
              help="The job carries its world (docs/directives.md): it reads a dataset from "
                   "alice's home and runs a copy of the trainer from her project directory "
                   "in a virtualenv that exists only at home. The loss comes once the world "
                   "is complete off-site too; the report adds whether the moved job read "
                   "identical data (the SHA-256 it printed) and whether its outputs and log "
                   "came home (outputs fetch, logs, as alice).")
@click.option("--world-mb", type=click.FloatRange(1), default=None,
              help="With --world: the dataset's size in MiB [default: 256].")
@click.option("--steps", type=click.IntRange(10), default=None,
              help="Training steps of the drill job [default: 400, 60 above 16 MiB].")
@click.option("--ckpt-every", type=click.IntRange(1), default=None,
              help="Checkpoint interval in steps [default: 40, 10 above 16 MiB].")
@click.option("--step-delay", type=click.FloatRange(0), default=None,
              help="Seconds per step, standing in for GPU time [default: 0.05 s, or what "
                   "keeps checkpoints 1.5 times slower than the link carries them].")
@click.option("--ranks", type=click.IntRange(1), default=1, show_default=True,
              help="Ranks of the drill job: more than 1 runs a sharded job (FSDP2, DCP) "
                   "under srun, 2 ranks per node.")
@click.option("--reshard", is_flag=True,
              help="With --ranks: the target cluster offers one node only, so the job "
                   "resumes there on fewer ranks, resharded from its checkpoint.")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Where the report, job output and timeline.png go (default: "
                   "<sandbox>/drills).")
@click.option("--lose", type=click.Choice(["cluster", "site", "leader"]), default="cluster",
              show_default=True,
              help="What to take away: onprem's controller, nodes and job; the whole home "
                   "site (its links cut, every process there killed: the home federation "
                   "replica and etcd member too); or, after onprem, the leading replica in "
                   "the middle of the move. site and leader need `sandbox up --replicated`.")
@click.option("--return-after", "return_after", type=click.FloatRange(0), default=None,
              help="Bring home back this many seconds after the loss (once the job trains "
                   "elsewhere) [default: when the job has finished].")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def drill(sandbox_dir: Path | None, old_sandbox_dir: Path | None, state_mb: float | None,
          steps: int | None, ckpt_every: int | None, step_delay: float | None, ranks: int,
          reshard: bool, out: Path | None, lose: str, return_after: float | None,
          as_json: bool, world: bool = False, world_mb: float | None = None) -> None:
    """Lose the home cluster (or site, or leader) on purpose: submit a real training job
    to onprem, strike once two checkpoints are verified off-site, and let the federation
    move the job to rented. Prints the DR report (detection, leader failover, RTO, steps
    lost, bytes, predicted vs actual transfer, bytes over the WAN per checkpoint by the
    link's own counters and the replication lag, each against one crossing of its stored
    bytes, who decided what, cost per leg) and checks
    that the final weights are bit-identical to an uninterrupted run (resharded: that the
    job loaded exactly the weights saved). Exits 0 when every target holds."""
    from slurm_geo.cli.sandbox import existing_root
    from slurm_geo.drills.drill import run_drill
    from slurm_geo.drills.report import render_report
    from slurm_geo.drills.settings import sized
    from slurm_geo.sandbox import Sandbox
    from slurm_geo.sandbox.netns import remembered_wan_mbit

    sandbox = Sandbox(existing_root(sandbox_dir or old_sandbox_dir))
    if reshard and ranks < 4:
        raise click.UsageError("--reshard needs --ranks 4 or more (2 ranks per node, and "
                               "one node fewer after the move)")
    if world_mb is not None and not world:
        raise click.UsageError("--world-mb goes with --world")
    if world and ranks > 1:
        raise click.UsageError("--world runs a one-rank job: leave --ranks out")
    link = remembered_wan_mbit(sandbox.layout)
    settings = sized(state_mb or (1.0 if world else 128.0), link, ranks=ranks,
                     reshard=reshard, steps=steps, ckpt_every=ckpt_every,
                     step_delay_s=step_delay, lose=lose, return_after_s=return_after)
    if world:
        from slurm_geo.drills.world import DEFAULT_WORLD_MB, paced
        settings = paced(settings, world_mb or DEFAULT_WORLD_MB, link, step_delay is not None)
    progress = (lambda _msg: None) if as_json else \
        (lambda msg: click.echo(f"drill: {msg}", err=True))
    report = run_drill(sandbox, settings, out or sandbox.layout.root / "drills", progress)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        click.echo(render_report(report))
    if not report.passed:
        raise SystemExit(1)
