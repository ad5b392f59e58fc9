"""The drill with a job of many ranks (`slurm-geo drill --ranks 4`): a sharded job of 2
tasks per node (slurm_geo.examples.sharded_train under srun, rank 0 holding the
lease) fails over from onprem's 2 nodes to rented. With `reshard`, rented offers only
one node (the other drained for the drill), so the job, which asks for `--nodes=1-2`,
resumes there on half the ranks, resharded by DCP from the checkpoint the daemon
verified."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from slurm_geo.drills.settings import DrillSettings
from slurm_geo.sandbox import remote_site
from slurm_geo.sandbox.layout import SandboxLayout
from slurm_geo.sandbox.render import CPUS_PER_NODE
from slurm_geo.sandbox.users import SandboxUser
from slurm_geo.slurm import JobSpec
from slurm_geo.slurm.admin import drain_node, resume_node

TASKS_PER_NODE = CPUS_PER_NODE  # one rank per CPU of a sandbox node


def nodes_for(settings: DrillSettings) -> int:
    return max(1, settings.ranks // TASKS_PER_NODE)


def shaped_for_home(spec: JobSpec, settings: DrillSettings) -> JobSpec:
    """The job at home, where every node is free. sbatch's command line overrides the
    script's #SBATCH lines, which are what the daemon reads for a move."""
    return replace(spec, nodes=nodes_for(settings), tasks_per_node=TASKS_PER_NODE)


def batch_lines(settings: DrillSettings) -> list[str]:
    """The #SBATCH lines of the job's shape: a node range when it may reshard."""
    nodes = nodes_for(settings)
    shape = f"1-{nodes}" if settings.reshard else str(nodes)
    return [f"#SBATCH --nodes={shape} --ntasks-per-node={TASKS_PER_NODE}"]


def trainer_command(run: str, settings: DrillSettings, trace: str) -> str:
    return (f"srun python -m slurm_geo.examples.sharded_train --run {run} --federated "
            f"--steps {settings.steps} --ckpt-every {settings.ckpt_every} "
            f"--step-delay {settings.step_delay_s} --hidden {settings.hidden} --trace {trace}")


@contextmanager
def fewer_nodes(layout: SandboxLayout, cluster: str, reshard: bool) -> Iterator[None]:
    """With `reshard`, all but the first node of `cluster` drained while the drill runs."""
    place = layout.cluster(cluster)
    assert place is not None, cluster
    conf = place.slurm_conf
    drained = place.node_names[1:] if reshard else ()
    provider = place not in layout.host_clusters  # the provider's: the operator's hand
    for node in drained:
        if provider:
            remote_site.scontrol(layout, ["update", f"nodename={node}", "state=drain",
                                          "reason=slurm-geo drill: a site with one node free"])
        else:
            drain_node(conf, node, "slurm-geo drill: a site with one node free")
    try:
        yield
    finally:
        for node in drained:
            if provider:
                remote_site.scontrol(layout, ["update", f"nodename={node}", "state=resume"])
            else:
                resume_node(conf, node)


def remote_work(layout: SandboxLayout, person: SandboxUser, run: str) -> Path | None:
    """Where a drill job's incarnations at the provider write (its account's home there,
    the directory `run`), as the sandbox's operator reads it; None when rented shares
    home's disk."""
    if not remote_site.is_provider(layout):
        return None
    return remote_site.operator_path(layout, person.name,
                                     remote_site.work_dir(person.name) / run)


def account_uids(layout: SandboxLayout, person: SandboxUser) -> dict[str, int]:
    """The uid `person`'s jobs run as on each cluster: their own, but at the provider's,
    whose accounts are its own."""
    uids = {cluster.name: person.uid for cluster in layout.clusters}
    if remote_site.is_provider(layout):
        uids[layout.rented.name] = remote_site.account_for(person.name).uid
    return uids


def reference_output(settings: DrillSettings) -> str:
    """What rank 0 of the same job, uninterrupted, prints: on as many ranks, in
    processes of this host, with a throwaway store and key."""
    from slurm_geo.ckpt.format.keys import create_master_key_file

    with tempfile.TemporaryDirectory() as scratch:
        store, key = Path(scratch) / "store", Path(scratch) / "key"
        store.mkdir()
        create_master_key_file(key)
        args = ["--run", "reference", "--store", f"file://{store}", "--key-file", str(key),
                "--steps", str(settings.steps), "--ckpt-every", str(settings.ckpt_every),
                "--hidden", str(settings.hidden)]
        port = _free_port()
        ranks = [subprocess.Popen(
            [sys.executable, "-m", "slurm_geo.examples.sharded_train", *args],
            env={**os.environ, "RANK": str(rank), "WORLD_SIZE": str(settings.ranks),
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
            stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL, text=True)
            for rank in range(settings.ranks)]
        output, _ = ranks[0].communicate(timeout=600)
        for process in ranks[1:]:
            process.wait(timeout=60)
    return output


def resumed_and_saved(home_output: str, moved_output: str) -> tuple[str | None, str | None]:
    """(the weights the moved job loaded, the weights saved at that step before), from
    the trainers' 'resumed step S on N ranks weights H' and 'saved step S weights H'."""
    resumed = next((line.split() for line in moved_output.splitlines()
                    if line.startswith("resumed step ")), None)
    if resumed is None:
        return None, None
    step = resumed[2]
    saved = next((line.split()[-1] for line in home_output.splitlines()
                  if line.startswith(f"saved step {step} ")), None)
    return resumed[-1], saved


def ranks_of(moved_output: str) -> int | None:
    for line in moved_output.splitlines():
        if line.startswith("resumed step "):
            return int(line.split()[4])
    return None


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
