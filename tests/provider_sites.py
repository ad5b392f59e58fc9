"""Slurm sites from a root filesystem of their own (slurm_geo.sandbox.provider), brought up
for one test module on loopback ports no sandbox uses: the provider's 26.05, home's 24.11.

`running` is the whole life of one: up (the test skipped, saying why, only when Debian's
registry cannot be reached to build its image), used, down, and then nothing of it left:
no mount under `watched` (its directory unless told), no process it started."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from slurm_geo.sandbox import provider, rootfs
from slurm_geo.sandbox.processes import MARKER_ENV
from slurm_geo.sandbox.provider import ProviderSite


def free_base(start: int, count: int) -> int:
    """The first of `count` consecutive loopback ports, all free, at or after `start`."""
    for base in range(start, start + 400, count):
        try:
            for port in range(base, base + count):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {count} free ports from {start}")


@contextmanager
def running(made: ProviderSite, up: Callable[[ProviderSite], object] = provider.up,
            watched: Path | None = None) -> Iterator[ProviderSite]:
    try:
        try:
            up(made)
        except rootfs.RegistryUnreachable as exc:
            pytest.skip(f"no image for the site: {exc}")
        yield made
    finally:
        provider.down(made)
    with open("/proc/self/mountinfo") as handle:
        assert str(watched or made.root) not in handle.read(), \
            "down left a mount of the site behind"
    assert not made.table.marked_processes(), f"down left a process ({MARKER_ENV})"
