#!/usr/bin/env python3
"""slurm-geo: the client-side check of --geo-* directives, run by the SPANK plugin.

plugstack.conf: `required .../geo_directives.so validator=/PATH/check_directives.py
config=/etc/slurm-geo/config.toml cluster=NAME`. Exits 0, or prints one line and exits
5 (a mistake in the directives), 6 (forbidden by the site's policy) or 3 (broken config).
"""
import sys

from slurm_geo.hooks.validator import run

sys.exit(run(sys.argv[1:]))
