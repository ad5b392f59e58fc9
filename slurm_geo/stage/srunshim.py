"""The `srun` a moved job's script finds first on its PATH (stage.steps writes it):

    python3 -m slurm_geo.stage.srunshim --srun REAL --python PY --base DIR --shim-dir DIR
        -- SRUN-ARGUMENTS...

It runs the real srun with `PY -m slurm_geo.stage.task ... --` before the command of each
component (stage.srunargs finds where each starts), so that every task of the step, on
every node, runs in its node's world (stage.task). A `--multi-prog` configuration is
rewritten the same way, line by line, into the job's workspace. A command line without a
command (`srun --version`, `srun --help`) is passed on as is. An option srun does not
know is refused in one line, exit 2, before anything runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from slurm_geo.errors import SlurmGeoError
from slurm_geo.stage.srunargs import (
    HET_SEPARATOR,
    Component,
    is_multi_prog,
    multi_prog,
    parse,
)


def task_wrapper(python: str, base: str, shim_dir: str, cwd: str,
                 batch_root: str) -> list[str]:
    """What goes before each command. Pure."""
    words = [python, "-m", "slurm_geo.stage.task", "--base", base, "--shim-dir", shim_dir,
             "--cwd", cwd]
    if batch_root:
        words += ["--batch-root", batch_root]
    return [*words, "--"]


def step_cwd(part: Component, cwd: str) -> str:
    """Where a component's tasks start: its --chdir (relative to `cwd`), else `cwd`.
    Pure."""
    chdir = part.value("chdir")
    if not chdir:
        return cwd
    return chdir if chdir.startswith("/") else os.path.normpath(os.path.join(cwd, chdir))


def rewritten(argv: list[str], python: str, base: str, shim_dir: str, cwd: str,
              batch_root: str, write_conf: object = None) -> list[str]:
    """srun's arguments with each component's command run through stage.task; a
    `--multi-prog` configuration's text is given to `write_conf(text) -> path`, whose
    path replaces it. Pure but for `write_conf`."""
    words: list[str] = []
    for index, part in enumerate(parse(argv)):
        if index:
            words.append(HET_SEPARATOR)
        # slurmstepd starts each task in "/" (the home path srun runs from may be on no
        # node): stage.task goes where it is in the task's world. A --chdir of its own
        # comes later and wins.
        words += ["--chdir=/", *part.options]
        if not part.command:
            continue
        wrapper = task_wrapper(python, base, shim_dir, step_cwd(part, cwd), batch_root)
        if is_multi_prog(part):
            assert callable(write_conf)
            conf = part.command[0]
            with open(conf if conf.startswith("/") else os.path.join(cwd, conf)) as handle:
                words += [str(write_conf(multi_prog(handle.read(), wrapper))),
                          *part.command[1:]]
        else:
            words += [*wrapper, *part.command]
    return words


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="srun (slurm-geo)", add_help=False)
    parser.add_argument("--srun", required=True)
    parser.add_argument("--python", required=True)
    parser.add_argument("--base", required=True)
    parser.add_argument("--shim-dir", required=True)
    parser.add_argument("arguments", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    given = args.arguments[1:] if args.arguments[:1] == ["--"] else args.arguments
    shim_dir = Path(args.shim_dir)

    def write_conf(text: str) -> Path:
        path = shim_dir / f"multi-prog-{os.getpid()}-{os.urandom(4).hex()}.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        return path

    try:
        words = rewritten(given, args.python, args.base, args.shim_dir, os.getcwd(),
                          os.environ.get("SLURM_GEO_WORLD_ROOT", ""), write_conf)
    except SlurmGeoError as exc:
        print(f"slurm-geo: error: {exc}", file=sys.stderr, flush=True)
        return int(exc.exit_code)
    except OSError as exc:
        print(f"slurm-geo: error: srun --multi-prog: {exc}", file=sys.stderr, flush=True)
        return 2
    os.execv(args.srun, [args.srun, *words])
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
