"""Fixtures for tests against the real sandbox: two Slurm clusters, slurmrestd and S3."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_geo.config import SiteConfig, load_config
from slurm_geo.sandbox import Sandbox, root_from_env
from slurm_geo.slurm import CliSlurmClient, SlurmClient, SlurmError, connect


@pytest.fixture(scope="session")
def sandbox() -> Sandbox:
    if os.geteuid() != 0:
        pytest.fail("sandbox tests need root (they start munge, MariaDB and Slurm)")
    box = Sandbox(root_from_env(None))
    box.up(progress=lambda _msg: None)
    return box


@pytest.fixture(scope="session")
def site(sandbox: Sandbox) -> SiteConfig:
    return load_config(sandbox.layout.site_config)


class TrackingClient:
    """Wraps a client so every job a test submits is cancelled when the test ends."""

    def __init__(self, client: SlurmClient):
        self.client = client
        self.submitted: list[int] = []

    def submit(self, spec):
        job_id = self.client.submit(spec)
        self.submitted.append(job_id)
        return job_id

    def __getattr__(self, name):
        return getattr(self.client, name)

    def cancel_all(self) -> None:
        for job_id in self.submitted:
            try:
                self.client.cancel(job_id)
            except SlurmError:
                pass


@pytest.fixture(params=["onprem", "rented"])
def cluster(request, site: SiteConfig, sandbox: Sandbox) -> Iterator[TrackingClient]:
    """Each backend against its own cluster: onprem by CLI, rented by slurmrestd."""
    sandbox.up(progress=lambda _msg: None)  # a previous test may have stopped a daemon
    client = TrackingClient(connect(site.cluster(request.param)))
    yield client
    client.cancel_all()


@pytest.fixture
def provider_admin(sandbox: Sandbox):
    """The rented cluster's own admin CLI: what the provider, not slurm-geo, can do."""
    def admin_for(cluster: str) -> CliSlurmClient:
        layout = sandbox.layout.cluster(cluster)
        assert layout is not None
        return CliSlurmClient(cluster, layout.slurm_conf, timeout_s=10)
    return admin_for


@pytest.fixture
def shared_dir(sandbox: Sandbox, request) -> Path:
    """A directory jobs on either cluster can write to (the sandbox's shared filesystem)."""
    path = sandbox.layout.pfs_dir / "tests" / request.node.name.replace("/", "_")
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.iterdir():
        stale.unlink()
    return path
