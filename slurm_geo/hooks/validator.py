"""The client-side check the SPANK plugin runs before sbatch queues a geo job.

    check_directives --config=PATH --cluster=NAME --geo-residency=home ...

It reads the site config and applies slurm_geo.policy.geo's rules; it lives here, above
both, so that policy never imports config.

Exit 0 accepts; otherwise one line on stdout (the plugin prints it as sbatch's error) and
the error's exit code: 5 for a mistake in the directives, 6 for a policy violation, 3 when
the site's config cannot be read.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from slurm_geo.errors import ConfigError, SlurmGeoError


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
    except SlurmGeoError as exc:
        print(str(exc), file=out)
        return exc.exit_code
    return 0


def main() -> None:
    sys.exit(run(sys.argv[1:]))


if __name__ == "__main__":
    main()
