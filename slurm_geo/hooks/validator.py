"""The client-side check the SPANK plugin runs before sbatch queues a geo job.

    check_directives --config=PATH --cluster=NAME --geo-residency=home ...

It reads the site config and applies slurm_geo.policy.geo's rules; it lives here, above
both, so that policy never imports config.

Exit 0 accepts; otherwise one line on stdout (the plugin prints it as sbatch's error) and
the error's exit code: 5 for a mistake in the directives, 6 for a policy violation, 3 when
the site's config cannot be read.

It runs as the user who submits (sbatch's own process), so it also looks at `--geo-env` on
disk: a directory, or a container image file. As root (a site's sbatch as root, a setuid
wrapper) it looks at nothing on disk: root never follows a path a user controls.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from slurm_geo.errors import ConfigError, SlurmGeoError
from slurm_geo.policy.world import PathKind


def path_kind(path: str) -> PathKind:
    """What `path` is to the calling user (stat(2), following links)."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return "missing"
    except OSError:  # EACCES on a directory above it, ELOOP, ...
        return "unreadable"
    if stat.S_ISDIR(mode):
        return "directory"
    return "file" if stat.S_ISREG(mode) else "other"


def privileged() -> bool:
    return os.getuid() == 0 or os.geteuid() == 0 or os.getuid() != os.geteuid()


def check_on_disk(env: str | None) -> None:
    """`--geo-env` as the submitting user finds it; nothing looked at when privileged."""
    from slurm_geo.policy.directives import DirectiveError
    from slurm_geo.policy.world import env_refusal

    if env is None or privileged():
        return
    why = env_refusal(env, path_kind(env))
    if why is not None:
        raise DirectiveError(why)


def run(argv: Sequence[str], out: TextIO | None = None) -> int:
    from slurm_geo.config import load_config
    from slurm_geo.policy.directives import parse_arguments
    from slurm_geo.policy.geo import check, rules_for

    out = out or sys.stdout
    config: Path | None = None
    cluster = ""
    directive_args = []
    for arg in argv:
        if arg.startswith("--config="):
            config = Path(arg.removeprefix("--config="))
        elif arg.startswith("--cluster="):
            cluster = arg.removeprefix("--cluster=")
        else:
            directive_args.append(arg)
    try:
        directives = parse_arguments(directive_args)
        try:
            site = load_config(config)
        except ConfigError as exc:
            print(f"geo: cannot check the --geo-* options, the slurm-geo config is broken "
                  f"({exc}); ask your admin", file=out)
            return exc.exit_code
        check(directives, rules_for(site), cluster or site.home_cluster)
        check_on_disk(directives.env)
    except SlurmGeoError as exc:
        print(str(exc), file=out)
        return exc.exit_code
    return 0


def main() -> None:
    sys.exit(run(sys.argv[1:]))


if __name__ == "__main__":
    main()
