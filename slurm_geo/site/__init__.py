"""What slurm-geo installs on a site besides the Python package, and where the package
keeps it (package data under slurm_geo/share/, so a wheel carries it): the Slurm hooks,
the SPANK plugin's source, the submit-as helper's source and the systemd units.
`slurm-geo site install` puts them in place (slurm_geo.site.install); the sandbox runs
the same files, so what the tests run is what a site installs.
"""

from __future__ import annotations

from pathlib import Path

SHARE = Path(__file__).resolve().parents[1] / "share"
HOOKS = SHARE / "hooks"
SPANK_SOURCE = SHARE / "spank" / "geo_directives.c"
SUBMIT_AS_SOURCE = SHARE / "libexec" / "submit_as.c"
UNITS = SHARE / "systemd"
