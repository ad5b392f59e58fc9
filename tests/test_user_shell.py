"""A user's shell on the sandbox (issue 29): `slurm-geo sandbox env` works for alice, with
the site Python every user runs, and tells her in one comment line what only root gets;
nothing secret is printed to her."""

from __future__ import annotations

import pytest

from slurm_geo.sandbox import Sandbox
from slurm_geo.sandbox.users import ALICE, job_environment, run_as


@pytest.mark.parametrize("cluster", ["onprem", "rented"])
def test_sandbox_env_works_for_alice_and_gives_her_no_secret(sandbox: Sandbox, cluster):
    done = run_as(ALICE, [str(sandbox.layout.site_python), "-m", "slurm_geo", "sandbox",
                          "env", "--dir", str(sandbox.layout.root), cluster],
                  env=job_environment(sandbox.layout, ALICE),
                  capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    lines = done.stdout.splitlines()
    assert f"export SLURM_CONF={sandbox.layout.cluster(cluster).slurm_conf}" in lines
    assert lines[-1].startswith("# the daemons' S3 key, the master key and the daemon's JWT")
    secrets = sandbox.s3_env()["AWS_SECRET_ACCESS_KEY"]
    assert secrets not in done.stdout
    for name in ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "SLURM_JWT",
                 "SLURM_GEO_KEY_FILE"):
        assert f"export {name}=" not in done.stdout
