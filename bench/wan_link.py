"""What the sandbox's shaped WAN gives bulk TCP: measured rate next to the configured one.

Run as root: python bench/wan_link.py [--mb 256] [--mbit 50,200,1000] [--both-directions]
It makes a throw-away pair of sites (prefix `sgb<pid>-`, 10.77.0.0/24 or 10.77.255.0/24),
sends MB megabytes at each rate (one TCP stream, Python sockets, inside the namespaces;
home -> remote and remote -> home in turn, or both at each rate), prints Mbit/s and the
ratio to the rate, and removes the sites. About 60 s with the defaults.
Target: every ratio within 0.85-1.15 (goodput, so TCP/IP headers cost ~3.5 %).
"""

from __future__ import annotations

import argparse
import os
import subprocess

from slurm_geo.sandbox import netns, site_readings, sites, throughput
from slurm_geo.sandbox.sites import Site

PORT = 5801


def free_topology() -> sites.Topology:
    prefix = f"sgb{os.getpid()}-"
    routes = subprocess.run(["ip", "-j", "route", "show"], capture_output=True, text=True,
                            check=True).stdout
    for block in (0, 255):
        topo = sites.topology(prefix, block)
        if not site_readings.conflicting_routes(topo, routes):
            return topo
    raise SystemExit("10.77.0.0/24 and 10.77.255.0/24 are both in use; try again later")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256, help="megabytes per transfer")
    parser.add_argument("--mbit", default="50,200,1000", help="rates to try, Mbit/s")
    parser.add_argument("--both-directions", action="store_true",
                        help="each rate both ways (twice as long)")
    args = parser.parse_args()
    rates = [int(r) for r in args.mbit.split(",")]
    topo = free_topology()
    netns.create(topo, rates[0])
    worst = 0.0
    try:
        print(f"{'rate':>10} {'direction':<16} {'MB':>5} {'seconds':>8} {'Mbit/s':>8} ratio")
        ways = [(Site.HOME, Site.REMOTE), (Site.REMOTE, Site.HOME)]
        for turn, mbit in enumerate(rates):
            netns.set_wan_rate(topo, mbit)
            for sender, receiver in ways if args.both_directions else [ways[turn % 2]]:
                got = throughput.measure(topo, sender, receiver, args.mb * 1_000_000, PORT)
                ratio = got.mbit / mbit
                worst = max(worst, abs(1 - ratio))
                print(f"{mbit:>5} Mbit {sender.value + ' -> ' + receiver.value:<16} "
                      f"{args.mb:>5} {got.seconds:>8.2f} {got.mbit:>8.1f} {ratio:.3f}")
    finally:
        netns.remove(topo)
    print(f"target within 15 % of the rate: {'met' if worst <= 0.15 else 'MISSED'} "
          f"(worst {worst * 100:.1f} % off)")


if __name__ == "__main__":
    main()
