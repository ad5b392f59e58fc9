"""Fixtures for tests against the real sandbox: two Slurm clusters, slurmrestd and S3; and a
SeaweedFS S3 server of a test module's own, without the sandbox (`weed`)."""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_geo.config import SiteConfig, load_config
from slurm_geo.sandbox import Sandbox, root_from_env
from slurm_geo.sandbox.layout import S3_BUCKET
from slurm_geo.sandbox.users import ALICE
from slurm_geo.slurm import CliSlurmClient, SlurmClient, SlurmError, connect
from tests.etcd_server import EtcdMember, start_cluster, stop_cluster
from tests.kit.sandbox import cluster_dir, user_dir


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
    """Wraps a client so every job a test submits is cancelled when the test ends; a job
    that names no owner is alice's (nothing the suite submits runs as root)."""

    def __init__(self, client: SlurmClient):
        self.client = client
        self.submitted: list[int] = []

    def submit(self, spec):
        if spec.owner is None:
            spec = dataclasses.replace(spec, owner=ALICE.owner)
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
    """A directory of alice's that her jobs on either cluster write to (in her project
    directory on the sandbox's shared filesystem)."""
    return user_dir(sandbox, ALICE, request.node.name)


@pytest.fixture
def run_dir(sandbox: Sandbox, cluster, shared_dir: Path, request) -> Path:
    """Where a test's job of alice's on `cluster` runs and writes: `shared_dir`, but on
    the provider's machine (`--remote-slurm provider`), which has none of home's files,
    her account's own directory there (read it from here with `host_path`)."""
    return cluster_dir(sandbox, cluster.cluster, shared_dir, request.node.name)


# --- the sandbox's S3 endpoint, one fresh prefix per test ---------------------------------

@pytest.fixture(scope="session")
def s3_endpoint(sandbox: Sandbox) -> str:
    return sandbox.layout.s3_endpoint


@pytest.fixture(scope="session")
def s3_env(sandbox: Sandbox) -> dict[str, str]:
    """The daemons' key to the sandbox's S3 server (it may do anything), as variables."""
    return sandbox.s3_env()


@pytest.fixture(scope="session")
def s3_client(s3_endpoint, s3_env):
    from slurm_geo.ckpt.stores.s3store import make_s3_client

    return make_s3_client(s3_endpoint, "us-east-1", access_key_id=s3_env["AWS_ACCESS_KEY_ID"],
                          secret_access_key=s3_env["AWS_SECRET_ACCESS_KEY"],
                          connect_timeout_s=2, read_timeout_s=10,
                          ca_file=s3_env["AWS_CA_BUNDLE"])  # its https is the site CA's


@pytest.fixture
def s3_prefix(s3_client) -> Iterator[str]:
    prefix = f"tests/{uuid.uuid4().hex}"
    yield prefix
    uploads = s3_client.list_multipart_uploads(Bucket=S3_BUCKET, Prefix=prefix + "/")
    for upload in uploads.get("Uploads", ()):
        s3_client.abort_multipart_upload(Bucket=S3_BUCKET, Key=upload["Key"],
                                         UploadId=upload["UploadId"])
    pages = s3_client.get_paginator("list_objects_v2").paginate(Bucket=S3_BUCKET,
                                                                Prefix=prefix + "/")
    for page in pages:
        for item in page.get("Contents", ()):
            s3_client.delete_object(Bucket=S3_BUCKET, Key=item["Key"])


@pytest.fixture
def s3_store(s3_client, s3_prefix):
    from slurm_geo.ckpt.stores.s3store import S3Store

    return S3Store(S3_BUCKET, s3_prefix, s3_client)


# --- an S3 server of the test module's own, no sandbox needed ------------------------------

@pytest.fixture(scope="module")
def weed(tmp_path_factory):
    """A `weed server` on free ports in a temporary directory (tests.seaweed_server); tests
    using it are marked `needs_weed`."""
    from tests.seaweed_server import RunningServer

    running = RunningServer(tmp_path_factory.mktemp("seaweed"))
    running.start()
    try:
        yield running
    finally:
        running.kill()


# --- real etcd ----------------------------------------------------------------------------

@pytest.fixture(scope="session")
def etcd(tmp_path_factory) -> Iterator[EtcdMember]:
    """One etcd member for the whole session; each test takes a prefix of its own."""
    members = start_cluster(tmp_path_factory.mktemp("etcd"), 1)
    yield members[0]
    stop_cluster(members)


@pytest.fixture
def etcd_cluster(tmp_path) -> Iterator[list[EtcdMember]]:
    """Three members on loopback, for a test that loses one (about 2 s to start)."""
    root = tmp_path / "etcd"
    root.mkdir()
    members = start_cluster(root, 3)
    yield members
    stop_cluster(members)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked `root` needs root (other users' ids, chown, namespaces, mounts): as
    anyone else it is skipped, saying why. `make test-unit` deselects them all."""
    mark = item.get_closest_marker("root")
    if mark is not None and os.geteuid() != 0:
        pytest.skip(mark.kwargs.get("reason", "needs root"))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that uses the sandbox (the `sandbox` fixture, itself or through another) is
    marked `sandbox` where its module forgot to: `-m "not sandbox"` (make test-unit) then
    leaves it out instead of starting munge, MariaDB and Slurm. Runs before -m selects."""
    for item in items:
        if "sandbox" in getattr(item, "fixturenames", ()) and \
                item.get_closest_marker("sandbox") is None:
            item.add_marker(pytest.mark.sandbox)
