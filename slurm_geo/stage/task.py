"""A task of a moved job's `srun` step enters its node's world, then becomes its command:

    python3 -m slurm_geo.stage.task --base DIR [--cwd DIR] [--shim-dir DIR] -- CMD ARGS...

what the preamble's `srun` (stage.srunshim) puts before each step's command. It opens
this node's workspace of the job (`job-<SLURM_JOB_ID>.<SLURMD_NODENAME>`, stage.steps:
the world step made it, and holds it, before the script started), reads how the world is
presented there, and
`exec`s CMD in it: in `namespace` and `container` modes through stage.nsexec (its own
namespaces: the trees at their home paths, inputs read-only), in `apptainer` mode
through `apptainer exec`, in `mapped` mode as is; with the variables of that
presentation (SLURM_GEO_WORLD_MODE, SLURM_GEO_INPUT_<n>, ..., PATH with the
environment's bin first) in place of the batch step's. It is given no key and opens no
store. The task's process is the command's (exec), so srun's signals reach it.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from collections.abc import Mapping
from pathlib import Path

from slurm_geo.errors import SlurmGeoError
from slurm_geo.exitcodes import ExitCode
from slurm_geo.jobenv import JobEnv
from slurm_geo.stage.nsexec import PLAN_VARIABLE
from slurm_geo.stage.present import ENV_PREFIX, Presentation
from slurm_geo.stage.steps import PRESENTATION, StepWorldError, node_job

# The batch step's world variables a task's own replace (its WORLD_ROOT differs in mapped
# mode; the batch script is not presented to tasks).
WORLD_VARIABLES = ("WORLD_MODE", "WORLD_ROOT", "INPUT_", "INPUTS", "OUTPUT_", "OUTPUTS",
                   "ENV", "WORKDIR", "SCRIPT")


def task_path(path: str, drop: list[str]) -> str:
    """The PATH a task's world puts its environment's bin in front of: the step's, less
    the preamble's srun directory and the batch step's environment bin. Pure."""
    return ":".join(entry for entry in path.split(":") if entry and entry not in drop)


def task_environment(environ: Mapping[str, str], shim_dir: str | None) -> dict[str, str]:
    """The step's environment less the batch step's world variables. Pure."""
    drop = [d for d in (shim_dir, environ.get(f"{ENV_PREFIX}ENV_BIN")) if d]
    env = {name: value for name, value in environ.items()
           if not (name.startswith(ENV_PREFIX)
                   and name[len(ENV_PREFIX):].startswith(WORLD_VARIABLES))}
    env["PATH"] = task_path(environ.get("PATH", ""), drop)
    if environ.get("VIRTUAL_ENV") and environ.get(f"{ENV_PREFIX}ENV"):
        env.pop("VIRTUAL_ENV")
    if environ.get("CONDA_PREFIX") and environ.get(f"{ENV_PREFIX}ENV"):
        env.pop("CONDA_PREFIX")
    return env


def task_cwd(given: str | None, presentation: Presentation, batch_root: str | None,
             exists: bool) -> str | None:
    """Where the task starts: the directory srun was run from (or its --chdir), where
    the task's world has it, else the working directory's root. `exists`: `given` is a
    directory of the node itself. Pure."""
    if not given:
        return None
    homes = [r.home.rstrip("/") for r in presentation.roots if not r.file]
    if presentation.mode == "mapped":
        if batch_root and given.startswith(batch_root.rstrip("/") + "/"):
            given = given[len(batch_root.rstrip("/")):]
        if any(given == h or given.startswith(h + "/") for h in homes):
            return str(presentation.world_dir) + given
        return given if exists else None
    if any(given == h or given.startswith(h + "/") for h in homes) or exists:
        return given
    return None


def open_world(base: Path, job: str, node: str, uid: int) -> Presentation:
    """How this node's world of the job is presented."""
    user_dir = base / f"slurm-geo-{uid}"
    path = user_dir / f"job-{node_job(job, node)}"
    try:
        info = os.lstat(user_dir)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid or info.st_mode & 0o077:
            raise StepWorldError(f"'{user_dir}' is not uid {uid}'s private directory")
        fd = os.open(path / PRESENTATION, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise StepWorldError(f"no world of job {job} on node {node} (under '{base}'): its "
                             "world step did not present it here (the job's error output "
                             "says why), or has ended") from None
    with os.fdopen(fd, "rb") as handle:
        return Presentation.from_json(json.load(handle))


def enter(command: list[str], base: Path, cwd: str | None = None,
          shim_dir: str | None = None, batch_root: str | None = None,
          environ: Mapping[str, str] | None = None, python: str = sys.executable) -> int:
    """Become `command` in this node's world of the job (exec); an exit code where that
    cannot be (one line on stderr). `python` runs stage.nsexec."""
    env = dict(os.environ if environ is None else environ)
    job = JobEnv.from_environ(env)
    node = job.node
    try:
        if not command:
            raise StepWorldError("no command to run: give it after --")
        presentation = open_world(base, job.job_id, node, os.getuid())
        argv, task_env, workdir = presentation.command(
            command, task_environment(env, shim_dir), python)
        where = task_cwd(cwd, presentation, batch_root, bool(cwd) and os.path.isdir(cwd or ""))
        if presentation.mode in ("namespace", "container") and where:
            plan = json.loads(task_env[PLAN_VARIABLE])
            plan["cwd"] = where
            task_env[PLAN_VARIABLE] = json.dumps(plan)
        elif presentation.mode == "mapped" and (where or workdir):
            os.chdir(where or workdir or "/")
        os.execvpe(argv[0], argv, task_env)
    except SlurmGeoError as exc:
        print(f"slurm-geo: error: node {node}: {exc}", file=sys.stderr, flush=True)
        return int(exc.exit_code)
    except OSError as exc:
        print(f"slurm-geo: error: node {node}: cannot run {command[:1]} in the job's "
              f"world: {exc}", file=sys.stderr, flush=True)
        return 127 if isinstance(exc, FileNotFoundError) else ExitCode.FAILURE
    return 0  # not reached


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m slurm_geo.stage.task",
        description="Run a task of a moved job's srun step in its node's world "
                    "(put there by the preamble's srun; docs/training.md).")
    parser.add_argument("--base", required=True, type=Path)
    parser.add_argument("--cwd", help="where srun was run (or its --chdir)")
    parser.add_argument("--shim-dir", help="the preamble's srun directory (off PATH here)")
    parser.add_argument("--batch-root", help="the batch step's SLURM_GEO_WORLD_ROOT")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return enter(command, args.base, args.cwd, args.shim_dir, args.batch_root)


if __name__ == "__main__":
    sys.exit(main())
