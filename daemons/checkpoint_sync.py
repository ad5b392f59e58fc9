#!/usr/bin/env python3
"""checkpoint-sync from a checkout: `python3 daemons/checkpoint_sync.py --config PATH`.

Installed, the same entry point is the console script `slurm-geo-checkpoint-sync`, which
the systemd unit runs (systemd/slurm-geo-checkpoint-sync.service). Options: --config,
--state, --metrics-port, --once, --log-level (see --help).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from slurm_geo.sync.entry import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
