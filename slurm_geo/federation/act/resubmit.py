"""What a job is resubmitted with on another cluster: its own script, its own `#SBATCH`
options, the `--geo-*` directives Slurm validated, its owner, and what the new
incarnation must know. Pure.

slurmrestd does not read `#SBATCH` lines, so the options a resubmission needs are read
from the script here, as sbatch reads them (a line counts only when `#SBATCH` starts it),
and travel as JobSpec fields. The directives are never read from the script: they are
what Slurm validated (federation.owners), and travel as SLURM_GEO_* (which the
controller's job_submit.lua checks, as for any REST submission). The environment is the
four parts federation.owners lists, nothing else.
"""

from __future__ import annotations

import base64
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Any

from slurm_geo.lease.protocol import (
    ENV_FEDERATION_CA,
    ENV_FEDERATION_URL,
    ENV_FEDERATION_URLS,
    ENV_GENERATION,
    ENV_KEY_TOKEN,
    ENV_LEASE_SECRET,
    ENV_LOGICAL_JOB,
    ENV_RESUME_STEP,
    ENV_RUN,
    ENV_STORE,
    ENV_STORE_ENDPOINT,
)
from slurm_geo.policy.directives import Directives, parse_arguments, to_environment
from slurm_geo.policy.world import World
from slurm_geo.slurm.models import JobSpec, Owner


@dataclass(frozen=True)
class ScriptOptions:
    """The `#SBATCH` options of a script that a resubmission carries over."""

    name: str | None = None
    time_limit_minutes: int | None = None
    nodes: int = 1
    max_nodes: int | None = None  # --nodes=MIN-MAX: a job that reshards on resume
    tasks_per_node: int | None = None
    cpus_per_task: int = 1
    partition: str | None = None
    output: str | None = None
    working_dir: str | None = None
    # The home job's working directory from Slurm's record (where its owner ran sbatch):
    # a relative --output of the home job is there, and an incarnation on the home
    # cluster runs there again (its relative paths, `python train.py`, mean what they
    # meant); elsewhere that filesystem may not exist, RESUBMIT_WORKING_DIR is used.
    submit_dir: str | None = None
    signal: str | None = None
    gpus: int = 0  # in all, over every node
    geo: tuple[str, ...] = ()  # --geo-NAME=VALUE of the directives Slurm validated

    def to_json(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> ScriptOptions:
        return cls(**{**raw, "geo": tuple(raw.get("geo", ()))})

    def directives(self) -> Directives:
        return parse_arguments(self.geo)

    def with_directives(self, directives: Mapping[str, str]) -> ScriptOptions:
        """These options with `{option: value}` directives (options without "--")."""
        return replace(self, geo=tuple(f"--{name}={value}" for name, value in
                                       sorted(directives.items())))


def fitted(options: ScriptOptions, nodes_up: int | None) -> ScriptOptions:
    """A job asking for a node range (`--nodes=MIN-MAX`, one that reshards on resume) gets
    a fixed count on the cluster it moves to: as many nodes as that cluster has up, within
    the range; MAX when that is not known. slurmrestd needs the task count, which a range
    leaves open, and a fixed count makes the incarnation's world size the daemon's
    decision, in its audit log."""
    if options.max_nodes is None:
        return options
    most = options.max_nodes if nodes_up is None else min(options.max_nodes, nodes_up)
    return replace(options, nodes=max(options.nodes, most), max_nodes=None)


_ALIASES = {"-J": "--job-name", "-t": "--time", "-N": "--nodes", "-c": "--cpus-per-task",
            "-p": "--partition", "-o": "--output", "-D": "--chdir"}


def script_options(script: str) -> ScriptOptions:
    """Read the `#SBATCH` block as sbatch does (src/sbatch/opt.c): a line counts only when
    it starts with `#SBATCH`; an indented one is a comment; the block ends at the first
    command. `--geo-*` options are left out: Slurm's validated directives are the job's
    (`with_directives`)."""
    values: dict[str, str] = {}
    for line in script.splitlines()[1:]:
        stripped = line.strip()
        if not stripped or (stripped.startswith("#") and not line.startswith("#SBATCH")):
            continue
        if not line.startswith("#SBATCH"):
            break
        words = shlex.split(line[len("#SBATCH"):], comments=True)
        for option, value in _pairs(words):
            if not option.startswith("--geo-"):
                values[_ALIASES.get(option, option)] = value
    least, _, most = values.get("--nodes", "1").partition("-")
    return ScriptOptions(
        name=values.get("--job-name"),
        time_limit_minutes=_minutes(values["--time"]) if "--time" in values else None,
        nodes=int(least),
        max_nodes=int(most) if most else None,
        tasks_per_node=(int(values["--ntasks-per-node"]) if "--ntasks-per-node" in values
                        else None),
        cpus_per_task=int(values.get("--cpus-per-task", "1")),
        partition=values.get("--partition"),
        output=values.get("--output"),
        working_dir=values.get("--chdir"),
        signal=values.get("--signal"),
        gpus=_gpus(values),
    )


def _gpus(values: dict[str, str]) -> int:
    """GPUs in all from --gpus, --gpus-per-node or --gres=gpu[:type]:N."""
    nodes = int(values.get("--nodes", "1").split("-")[0])
    if "--gpus" in values or "-G" in values:
        return _count(values.get("--gpus") or values["-G"])
    if "--gpus-per-node" in values:
        return nodes * _count(values["--gpus-per-node"])
    for gres in values.get("--gres", "").split(","):
        if gres.startswith("gpu"):
            return nodes * _count(gres)
    return 0


def _count(text: str) -> int:
    """The count at the end of `[gpu:][type:]N`; a bare type means one."""
    last = text.rsplit(":", 1)[-1]
    return int(last) if last.isdigit() else 1


def _pairs(words: list[str]) -> list[tuple[str, str]]:
    pairs = []
    index = 0
    while index < len(words):
        word = words[index]
        if "=" in word and word.startswith("--"):
            option, _, value = word.partition("=")
            pairs.append((option, value))
        elif index + 1 < len(words) and not words[index + 1].startswith("-"):
            pairs.append((word, words[index + 1]))
            index += 1
        else:
            pairs.append((word, ""))
        index += 1
    return pairs


def _minutes(text: str) -> int:
    """sbatch --time forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S (rounded up to a minute)."""
    days, _, clock = text.rpartition("-") if "-" in text else ("0", "", text)
    parts = [int(p) for p in clock.split(":")]
    if "-" in text:
        hours, minutes, seconds = (parts + [0, 0])[:3]
    elif len(parts) == 3:
        hours, minutes, seconds = parts
    elif len(parts) == 2:
        hours, minutes, seconds = 0, parts[0], parts[1]
    else:
        hours, minutes, seconds = 0, parts[0], 0
    total = int(days or 0) * 1440 + hours * 60 + minutes + (1 if seconds else 0)
    return max(total, 1)


RESUBMIT_WORKING_DIR = "/tmp"  # a resubmission's working directory when it names none


def working_dir(options: ScriptOptions, at_home: bool, own_dir: str | None = None) -> str:
    """Where an incarnation runs: on a cluster with none of home's files, the owner's
    account's directory there (`own_dir`: home's paths mean nothing there); else its
    --chdir; on the home cluster the directory the home job was submitted from; else
    RESUBMIT_WORKING_DIR. Pure."""
    if own_dir:
        return own_dir
    if options.working_dir:
        return options.working_dir
    if at_home and options.submit_dir:
        return options.submit_dir
    return RESUBMIT_WORKING_DIR


def output_path(options: ScriptOptions, own_dir: str | None = None) -> str | None:
    """The incarnation's --output: as submitted; on a cluster with none of home's files
    (`own_dir`), its file name alone, so it is written in the directory the job runs in
    (home's directories are not there, and Slurm fails a job whose output it cannot
    open). Slurm's %-patterns are kept. Pure."""
    if options.output is None or not own_dir:
        return options.output
    return PurePosixPath(options.output).name or None


def resubmitted_name(options: ScriptOptions, logical_job: str) -> str:
    """The Slurm job name of a resubmission: the script's own, else the logical job id."""
    return options.name or logical_job


PREAMBLE_PYTHON = "SLURM_GEO_PYTHON"  # the Python the wrapper runs; python3 on PATH else
_SCRIPT_END = "SLURM_GEO_JOB_SCRIPT"  # ends the heredoc; base64 lines never equal it


def wrapped_script(script: str) -> str:
    """The script submitted in place of `script` where the job's world must be
    materialised first: a bash wrapper that runs the preamble as the job's user
    (`python3 -m slurm_geo.stage.run`, stage.preamble) with the job's own script on its
    stdin, in base64 (any byte of it travels as is; the heredoc cannot end early). The
    preamble writes it into the job's private workspace and runs it in the presented
    world, so the job runs the very script Slurm held for it at home, not a later edit
    of the file. `exec`: Slurm's signals to the batch step reach the preamble, which
    passes them on. Pure."""
    encoded = base64.encodebytes(script.encode("utf-8", "surrogateescape")).decode()
    return ("#!/bin/bash\n"
            "# slurm-geo: this incarnation's world (inputs, environment, working directory)\n"
            "# is materialised from the site's store first; then the job's own script, below\n"
            "# in base64, runs in it (docs/training.md, \"A moved job's world\").\n"
            f'exec "${{{PREAMBLE_PYTHON}:-python3}}" -m slurm_geo.stage.run '
            f"--script-base64-stdin <<'{_SCRIPT_END}'\n{encoded}{_SCRIPT_END}\n")


def needs_preamble(options: ScriptOptions, own_dir: str | None) -> bool:
    """Whether the incarnation runs the preamble before its script: on a cluster with
    none of home's files (`own_dir`), for a job that declared a world (`--geo-inputs`,
    `--geo-env`, `--geo-outputs`). Elsewhere the job finds its files where they were.
    Pure."""
    return bool(own_dir) and not World.of(options.directives()).empty


@dataclass(frozen=True)
class Incoming:
    """What the new incarnation is told, beyond its directives."""

    logical_job: str
    generation: int
    run: str
    resume_step: int | None
    federation_url: str
    key_token: str
    store_url: str
    store_endpoint: str = ""
    federation_ca: str = ""  # PEM of the CA the daemon's certificate verifies against
    lease_secret: str = ""  # signs the incarnation's lease requests
    federation_urls: tuple[str, ...] = ()  # every replica's, the leader's first


def resubmission(script: str, options: ScriptOptions, incoming: Incoming,
                 partitions: tuple[str, ...], *, owner: Owner | None = None,
                 owner_env: Mapping[str, str] | None = None,
                 store_env: Mapping[str, str] | None = None,
                 at_home: bool = False, own_dir: str | None = None,
                 preamble_python: str | None = None) -> JobSpec:
    """The JobSpec for the new incarnation, run as `owner`, its environment built from
    the owner's allow-listed one, the store's credentials, the directives and `incoming`,
    in that order (federation.owners). A partition the target does not have is dropped
    (its default partition takes the job). `own_dir`: the target has none of home's
    files, the job runs there (`working_dir`, `output_path`), and a job that declared a
    world gets it first (`wrapped_script`), run by `preamble_python` (the cluster's
    `python`; None: python3 on the job's PATH)."""
    env = {
        **(owner_env or {}),
        **(store_env or {}),
        **to_environment(options.directives()),
        ENV_LOGICAL_JOB: incoming.logical_job,
        ENV_GENERATION: str(incoming.generation),
        ENV_RESUME_STEP: "" if incoming.resume_step is None else str(incoming.resume_step),
        ENV_RUN: incoming.run,
        ENV_FEDERATION_URL: incoming.federation_url,
        ENV_KEY_TOKEN: incoming.key_token,
        ENV_LEASE_SECRET: incoming.lease_secret,
        ENV_STORE: incoming.store_url,
        ENV_STORE_ENDPOINT: incoming.store_endpoint,
    }
    if incoming.federation_ca:
        env[ENV_FEDERATION_CA] = incoming.federation_ca
    if len(incoming.federation_urls) > 1:  # replicas: the job follows their leader
        env[ENV_FEDERATION_URLS] = ",".join(incoming.federation_urls)
    preamble = needs_preamble(options, own_dir)
    if preamble and preamble_python:
        env[PREAMBLE_PYTHON] = preamble_python
    partition = options.partition if options.partition in partitions else None
    return JobSpec(
        script=wrapped_script(script) if preamble else script,
        name=resubmitted_name(options, incoming.logical_job),
        working_dir=Path(working_dir(options, at_home, own_dir)),
        environment=env,
        owner=owner,
        partition=partition,
        time_limit_minutes=options.time_limit_minutes,
        nodes=options.nodes,
        max_nodes=options.max_nodes,
        tasks_per_node=options.tasks_per_node,
        cpus_per_task=options.cpus_per_task,
        requeue=True,
        signal=options.signal,
        output=output_path(options, own_dir),
        comment=f"slurm-geo {incoming.logical_job} generation {incoming.generation}",
    )
