"""Billing's tests' world: clusters onprem and rented on FakeSlurm with one job each and a
manual clock (the fixtures `clock` and `clusters`, imported as `clock_fixture` and
`clusters_fixture`), the prices and facts, sacct lines, the billing CLI and a local
webhook (the fixture `hook`, imported as `hook_fixture`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from slurm_geo.billing.config import BillingConfig, ClusterFacts, PriceEntry
from slurm_geo.slurm.fake import FakeSlurm
from slurm_geo.slurm.models import JobSpec
from tests.kit.clock import ManualClock

T0 = int(datetime(2026, 11, 2, 10, 0, tzinfo=UTC).timestamp())
HOUR = 3600
CLUSTERS = {"onprem": ClusterFacts("onprem", "home", "onprem"),
            "rented": ClusterFacts("rented", "remote", "gpu-market")}


PRICES = (PriceEntry(0, 0.0, 0.01, 0.0, 0.0, cluster="onprem", source="t"),
          PriceEntry(0, 2.5, 0.04, 0.09, 5.0, cluster="rented", source="t"))


@pytest.fixture(name="clock")
def clock_fixture():
    return ManualClock(T0)


@pytest.fixture(name="clusters")
def clusters_fixture(clock):
    """onprem and rented, each with one job of 2 CPUs that ran an hour from T0 + 60."""
    fakes = {name: FakeSlurm(name, clock=clock) for name in ("onprem", "rented")}
    for fake in fakes.values():
        job = fake.submit(JobSpec(script="#!/bin/bash\n", cpus_per_task=2))
        clock.now = T0 + 60
        fake.start(job)
        clock.now = T0 + 60 + HOUR
        fake.finish(job)
        clock.now = T0
    clock.now = T0 + 2 * HOUR
    return fakes


def config(tmp_path: Path, **extra) -> BillingConfig:
    return BillingConfig(database=tmp_path / "billing.db", prices=PRICES, clusters=CLUSTERS,
                         **extra)


def sacct_line(job_id, *, cluster="rented", user="alice", account="ml", state="COMPLETED",
               submit="2026-11-02T10:00:00", start="2026-11-02T10:00:05",
               end="2026-11-02T11:00:05", elapsed=3600, alloc="cpu=8,gres/gpu=2,node=1",
               admin="geo:cost_center=ml-research", name="train"):
    return "|".join(map(str, [job_id, cluster, user, account, "gpu", state, submit, start, end,
                              elapsed, alloc, "0:0", "n1", admin, "", name]))


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "slurm_geo", "billing", *args],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


@pytest.fixture(name="hook")
def hook_fixture() -> Iterator[tuple[str, list]]:
    """A local webhook: its URL, and the JSON bodies POSTed to it."""
    received: list = []

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's naming
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/hook", received
    finally:
        server.shutdown()
