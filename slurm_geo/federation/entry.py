"""`slurm-geo-federation`: the federation daemon's command line (thin: parse, build, run).

The systemd unit (systemd/slurm-geo-federation.service), the sandbox and
daemons/federation.py all run this `main`.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from slurm_geo.errors import SlurmGeoError

PROGRAM = "slurm-geo-federation"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROGRAM, description="Watch the clusters, move geo jobs away from a dead "
        "cluster or a hopeless queue and back (docs/federation.md).")
    parser.add_argument("--config", type=Path, default=None,
                        help="Site config (default: $SLURM_GEO_CONFIG or "
                             "/etc/slurm-geo/config.toml).")
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from slurm_geo.daemon.events import configure_logging
    from slurm_geo.daemon.notify import Notifier
    from slurm_geo.federation.runtime import build
    from slurm_geo.federation.service import Metrics, serve

    configure_logging(os.environ, getattr(logging, args.log_level))
    log = logging.getLogger("slurm_geo.federation")
    try:
        federation = build(args.config, daemon=True)
        config = federation.config
        metrics = Metrics()
        server = serve(federation, metrics, config.listen_address, config.listen_port)
    except (SlurmGeoError, OSError) as exc:
        print(f"{PROGRAM}: error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 1)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    threading.Thread(target=_probe_forever, args=(federation, stop), name="federation-probes",
                     daemon=True).start()
    notifier = Notifier(os.environ)
    notifier.ready(f"watching {len(federation.clients)} clusters")
    log.info("event=started clusters=%s url=%s", ",".join(federation.clients), config.url)
    while not stop.is_set():
        started = time.monotonic()
        try:
            federation.tick(federation.state.health())
            metrics.observe(federation)
        except Exception:  # a bug must cost one round, not the daemon
            log.exception("event=tick_crashed")
        notifier.send("WATCHDOG=1")
        stop.wait(max(0.0, config.probe_interval_s - (time.monotonic() - started)))
    notifier.send("STOPPING=1")
    server.shutdown()
    log.info("event=stopped")
    return 0


def _probe_forever(federation: Any, stop: threading.Event) -> None:
    """Probes keep their own rhythm: a round of moves waiting on a slow controller must
    not delay noticing that another one died."""
    log = logging.getLogger("slurm_geo.federation")
    interval = federation.config.probe_interval_s
    while not stop.is_set():
        started = time.monotonic()
        try:
            federation.probe_all()
        except Exception:  # a bug must cost one probe, not the daemon
            log.exception("event=probe_crashed")
        stop.wait(max(0.0, interval - (time.monotonic() - started)))


if __name__ == "__main__":
    sys.exit(main())
