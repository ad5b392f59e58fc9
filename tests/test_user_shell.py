"""A user's shell on the sandbox (issue 29): `slurm-geo sandbox env` works for alice, with
the site Python every user runs, and tells her in one comment line what only root gets;
nothing secret is printed to her. Her login shell (`su - alice`) has `slurm-geo`, the
site Python and the config, as a site's /etc/profile.d gives them, and a job she submits
with plain sbatch runs that Python."""

from __future__ import annotations

import os
import subprocess

import pytest

from slurm_geo.sandbox import Sandbox, login
from slurm_geo.sandbox.layout import SandboxLayout
from slurm_geo.sandbox.users import ALICE, job_environment, run_as
from tests.helpers import eventually
from tests.kit.sandbox import user_dir


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


# --- a login shell, as the site's /etc/profile.d gives it (slurm_geo.sandbox.login) -------

def _login_shell(sandbox: Sandbox, command: str) -> subprocess.CompletedProcess:
    """`su - alice -c COMMAND`: her login shell, nothing of root's environment."""
    # The profile names the sandbox brought up last: this one, for this test.
    login.ensure_profile(sandbox.layout, sandbox.env_lines(sandbox.layout.onprem.name, False))
    return subprocess.run(["su", "-", ALICE.name, "-c", command], capture_output=True,
                          text=True, timeout=120, check=False, env={"PATH": "/usr/bin:/bin"})


@pytest.mark.slow
def test_alices_login_shell_has_slurm_geo_the_site_python_and_config(sandbox: Sandbox):
    done = _login_shell(sandbox, 'slurm-geo --help >/dev/null && echo "help ok"; '
                                 'command -v slurm-geo; command -v python; '
                                 'python -c "import slurm_geo; print(slurm_geo.__name__)"; '
                                 'echo "config=$SLURM_GEO_CONFIG conf=$SLURM_CONF"')
    assert done.returncode == 0, done.stderr
    bin_dir = sandbox.layout.site_python.parent
    assert done.stdout.splitlines() == [
        "help ok", str(bin_dir / "slurm-geo"), str(bin_dir / "python"), "slurm_geo",
        f"config={sandbox.layout.site_config} conf={sandbox.layout.onprem.slurm_conf}"]


@pytest.mark.slow
def test_a_job_alice_submits_with_plain_sbatch_finds_the_site_python(sandbox: Sandbox,
                                                                     request):
    work = user_dir(sandbox, ALICE, request.node.name)
    (work / "job.sh").write_text("#!/bin/bash\npython -c 'import slurm_geo, sys; "
                                 "print(\"imported\", sys.executable)'\n")
    os.chown(work / "job.sh", ALICE.uid, ALICE.uid)
    done = _login_shell(sandbox, f"cd {work} && sbatch --parsable -o job.out job.sh")
    assert done.returncode == 0, done.stderr
    out = work / "job.out"
    text = eventually(lambda: out.read_text() if out.exists() else "",
                      lambda seen: "\n" in seen, timeout_s=120)
    assert text == f"imported {sandbox.layout.site_python.parent / 'python'}\n"


def test_the_profile_names_one_sandbox_and_purge_removes_only_its_own(tmp_path):
    ours, theirs = SandboxLayout(tmp_path / "ours", 16800), SandboxLayout(tmp_path / "b", 16900)
    profile = tmp_path / "profile.d" / "slurm-geo-sandbox.sh"
    exports = ["export SLURM_GEO_CONFIG=/x/slurm-geo.toml", "# root's: not for users"]
    assert login.ensure_profile(ours, exports, profile)
    text = profile.read_text()
    assert f'PATH={ours.site_python.parent}:"$PATH"' in text
    assert "export SLURM_GEO_CONFIG=/x/slurm-geo.toml" in text and "root's" not in text
    assert oct(profile.stat().st_mode & 0o777) == "0o644"
    login.remove_profile(theirs, profile)
    assert profile.exists()
    login.remove_profile(ours, profile)
    assert not profile.exists()
