"""Bulk TCP between two of the sandbox's sites, to see what the WAN's shaping gives.

    python -m slurm_geo.sandbox.throughput receive ADDRESS PORT   # prints "ready", then JSON
    python -m slurm_geo.sandbox.throughput send ADDRESS PORT BYTES

`measure` runs both inside the sites' namespaces. The receiver times from accept() to the
end of the stream, so connection set-up counts against the rate, never for it.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from slurm_geo.sandbox import netns
from slurm_geo.sandbox.sites import Site, Topology, exec_argv

CHUNK = 1 << 20
READY = "ready"


@dataclass(frozen=True)
class Measurement:
    nbytes: int
    seconds: float

    @property
    def mbit(self) -> float:
        return self.nbytes * 8 / self.seconds / 1e6


def receive(address: str, port: int) -> Measurement:
    with socket.create_server((address, port)) as server:
        print(READY, flush=True)
        server.settimeout(60)
        conn, _ = server.accept()
        started = time.monotonic()
        received = 0
        with conn:
            conn.settimeout(60)
            while chunk := conn.recv(CHUNK):
                received += len(chunk)
        return Measurement(received, time.monotonic() - started)


def send(address: str, port: int, nbytes: int) -> None:
    block = bytes(CHUNK)
    with socket.create_connection((address, port), timeout=60) as conn:
        left = nbytes
        while left > 0:
            step = min(left, CHUNK)
            conn.sendall(block[:step])
            left -= step


def measure(topo: Topology, sender: Site, receiver: Site, nbytes: int, port: int,
            timeout_s: float = 300) -> Measurement:
    """`nbytes` from `sender`'s namespace to `receiver`'s site address."""
    address = str(topo.site_address(receiver))
    me = [sys.executable, "-m", __name__]
    server = subprocess.Popen(exec_argv(topo, receiver, [*me, "receive", address, str(port)]),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        if server.stdout.readline().strip() != READY:
            raise RuntimeError(f"the receiver in {topo.namespace(receiver)} did not start")
        netns.exec_in(topo, sender, [*me, "send", address, str(port), str(nbytes)],
                      check=True, timeout=timeout_s)
        out, _ = server.communicate(timeout=timeout_s)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    row = json.loads(out)
    return Measurement(row["bytes"], row["seconds"])


def main(argv: list[str]) -> None:
    mode, address, port = argv[0], argv[1], int(argv[2])
    if mode == "receive":
        result = receive(address, port)
        print(json.dumps({"bytes": result.nbytes, "seconds": result.seconds}), flush=True)
    else:
        send(address, port, int(argv[3]))


if __name__ == "__main__":
    main(sys.argv[1:])
