"""`slurm-geo-checkpoint-sync`: the daemon's command line (thin: parse, build, run).

The systemd unit (slurm_geo/share/systemd/slurm-geo-checkpoint-sync.service), the sandbox and
daemons/checkpoint_sync.py all run this `main`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from slurm_geo.errors import SlurmGeoError

PROGRAM = "slurm-geo-checkpoint-sync"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from slurm_geo.config.model import config_path_from_env

    parser = argparse.ArgumentParser(
        prog=PROGRAM, description="Replicate committed checkpoints to the off-site store, "
        "verify them, and keep their state (docs/checkpoint-sync.md).")
    parser.add_argument("--config", type=Path, default=None,
                        help=f"Site config (default: $SLURM_GEO_CONFIG or "
                             f"{config_path_from_env()}).")
    parser.add_argument("--state", type=Path, default=None,
                        help="State database; overrides [sync] state.")
    parser.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                        help="Prometheus port; overrides [sync] metrics_port (0: off).")
    parser.add_argument("--once", action="store_true",
                        help="Replicate what is due now, then exit: 0 if every replica is "
                             "verified, 1 if some are not (for tests and cron).")
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from slurm_geo.config.model import config_path_from_env
    from slurm_geo.daemon.events import configure_logging
    from slurm_geo.daemon.notify import Notifier
    from slurm_geo.sync.daemon import Daemon
    from slurm_geo.sync.runtime import load_runtime

    configure_logging(os.environ, getattr(logging, args.log_level))
    config = args.config or config_path_from_env()
    try:
        runtime = load_runtime(config)
        sync = runtime.sync
        daemon = Daemon(runtime, lambda: load_runtime(config), args.state or sync.state,
                        notifier=Notifier(os.environ),
                        metrics_port=sync.metrics_port if args.metrics_port is None
                        else args.metrics_port,
                        metrics_address=sync.metrics_address)
        return daemon.run(once=args.once)
    except SlurmGeoError as exc:
        print(f"{PROGRAM}: error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
