#!/usr/bin/env python3
"""slurm-geo PrologSlurmctld: records each incarnation of a geo job in the controller's
registry. Install as slurm.conf's PrologSlurmctld=.

Jobs without --geo-* directives exit here at once, before anything is imported.
"""
import os
import sys

if not any(name.startswith("SPANK_GEO_") for name in os.environ):
    sys.exit(0)

from slurm_geo.hooks.entry import run_hook  # noqa: E402

sys.exit(run_hook("prolog_slurmctld"))
