#!/usr/bin/env python3
"""The federation daemon from a checkout: `python3 daemons/federation.py --config PATH`.

Installed, the same entry point is the console script `slurm-geo-federation`, which the
systemd unit runs (systemd/slurm-geo-federation.service).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from slurm_geo.federation.entry import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
