"""`#SBATCH --geo-*` against the real sandbox: plain sbatch, the SPANK plugin, the
controller's job_submit.lua, the node prolog."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

import pytest
from helpers import eventually, sbatch_as

from slurm_geo.policy.directives import Directives, to_environment
from slurm_geo.sandbox import Sandbox
from slurm_geo.sandbox.users import ALICE
from slurm_geo.slurm import JobSpec, SlurmRejected, connect
from slurm_geo.slurm.models import JobState
from tests.kit.sandbox import connect_onprem, user_dir, wait_done

pytestmark = pytest.mark.sandbox


@pytest.fixture
def job_dir(sandbox: Sandbox, request) -> Path:
    """A fresh directory of alice's, whose jobs these are."""
    return user_dir(sandbox, ALICE, f"geo-{request.node.name}")


def sbatch(sandbox: Sandbox, *args: str, script: str = "#!/bin/bash\ntrue\n",
           slurm_conf: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Plain sbatch against onprem, as alice runs it at her shell."""
    return sbatch_as(sandbox, ALICE, script, *args, slurm_conf=slurm_conf)


def squeue_names(sandbox: Sandbox) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%j"], capture_output=True, text=True,
                         env={**os.environ, "SLURM_CONF": str(sandbox.layout.onprem.slurm_conf)},
                         timeout=30, check=True).stdout
    return out.split()


GOOD = ["--geo-residency=home,remote", "--geo-data-class=internal",
        "--geo-cost-center=ml-research", "--geo-max-cost=120.50", "--geo-failover=auto",
        "--geo-clusters=onprem,rented", "--geo-ckpt-interval=15"]


def test_valid_directives_reach_the_job_and_the_prolog(sandbox, job_dir):
    ckpt = job_dir / "ckpt dir 'quoted'"
    out = job_dir / "out.txt"
    script = "\n".join([
        "#!/bin/bash",
        f'#SBATCH --geo-ckpt-dir="{ckpt}"',
        *[f"#SBATCH {arg}" for arg in GOOD],
        f"#SBATCH --output={job_dir}/slurm-%j.out",
        f'env | grep "^SLURM_GEO_" | sort > "{out}"',
    ]) + "\n"
    result = sbatch(sandbox, script=script)
    assert result.returncode == 0, result.stderr
    job_id = int(result.stdout.strip())
    assert wait_done(sandbox, job_id) is JobState.COMPLETED
    seen = dict(line.split("=", 1) for line in out.read_text().splitlines())
    assert seen.pop("SLURM_GEO_CONFIG") == str(sandbox.layout.site_config)  # alice's shell's
    assert seen == {
        "SLURM_GEO_CKPT_DIR": str(ckpt), "SLURM_GEO_RESIDENCY": "home,remote",
        "SLURM_GEO_DATA_CLASS": "internal", "SLURM_GEO_COST_CENTER": "ml-research",
        "SLURM_GEO_MAX_COST": "120.50", "SLURM_GEO_FAILOVER": "auto",
        "SLURM_GEO_CLUSTERS": "onprem,rented", "SLURM_GEO_CKPT_INTERVAL": "15",
    }
    marker = json.loads((ckpt / ".slurm-geo" / f"prolog-onprem-{job_id}-0.json").read_text())
    assert marker["directives"]["geo-residency"] == "home,remote"
    assert marker["directives"]["geo-ckpt-dir"] == str(ckpt)
    record = json.loads((ckpt / ".slurm-geo" / f"job-onprem-{job_id}.json").read_text())
    assert record["incarnations"][0]["reason"] == "completed"


CC = "--geo-cost-center=ml-research"
BAD = [
    ("relative-dir", [CC, "--geo-ckpt-dir=ckpt"],
     "geo: --geo-ckpt-dir: 'ckpt' is not an absolute path"),
    ("bad-interval", [CC, "--geo-ckpt-interval=soon"],
     "geo: --geo-ckpt-interval: 'soon' is not a whole number of minutes from 1 to 10080"),
    ("unknown-region", [CC, "--geo-residency=mars"],
     "geo: --geo-residency: unknown region 'mars' (known: home, remote)"),
    ("unknown-cluster", [CC, "--geo-clusters=onprem,atlantis"],
     "geo: --geo-clusters: unknown cluster 'atlantis' (known: onprem, rented)"),
    ("bad-data-class", [CC, "--geo-data-class=secret"],
     "geo: --geo-data-class: 'secret' is not one of public, internal, restricted"),
    ("bad-cost", [CC, "--geo-max-cost=lots"],
     "geo: --geo-max-cost: 'lots' is not an amount of USD greater than 0, with at most 6 "
     "decimals (e.g. 250, 99.50 or 0.001)"),
    ("bad-failover", [CC, "--geo-failover=maybe"],
     "geo: --geo-failover: 'maybe' is not one of auto, manual, never"),
    ("auto-without-ckpt", [CC, "--geo-failover=auto"],
     "geo: --geo-failover=auto needs --geo-ckpt-dir=PATH: a job moves with its checkpoints"),
    ("no-cost-center", ["--geo-residency=home"],
     "geo: this site requires --geo-cost-center=NAME on jobs with --geo-* directives"),
    ("restricted-abroad", [CC, "--geo-data-class=restricted", "--geo-residency=home,remote"],
     "geo: data class 'restricted' may not reside in region 'remote' (allowed: home)"),
    ("over-budget", [CC, "--geo-max-cost=900"],
     "geo: --geo-max-cost=900 exceeds the budget of cost center 'ml-research' (500 USD)"),
    # Issue 29: Slurm alone says only "unrecognized option"; the plugin names the fix.
    ("typo", [CC, "--geo-failovr=auto"],
     "geo: unknown option --geo-failovr; did you mean --geo-failover?"),
    ("auto-that-never-moves", [CC, "--geo-ckpt-dir=/tmp/x", "--geo-failover=auto",
                               "--geo-residency=home"],
     "geo: --geo-failover=auto can never move this job: its residency (home) leaves no "
     "cluster but 'onprem'; write --geo-failover=never, or allow another cluster"),
]


def test_a_typo_in_the_scripts_sbatch_lines_names_the_directive_meant(sandbox, job_dir):
    script = job_dir / "typo.sh"
    script.write_text("#!/bin/bash\n#SBATCH --geo-cost-center=ml-research\n"
                      "#SBATCH --geo-resdency=home\ntrue\n")
    os.chown(script, ALICE.uid, ALICE.uid)
    result = sbatch_as(sandbox, ALICE, "", str(script))
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.strip() == ("sbatch: error: geo: unknown option --geo-resdency; "
                                     "did you mean --geo-residency?")


@pytest.mark.parametrize(("case", "args", "message"), BAD, ids=[b[0] for b in BAD])
def test_each_bad_directive_is_refused_with_its_own_message(sandbox, case, args, message):
    name = f"bad-{case}-{uuid.uuid4().hex[:6]}"
    before = len(squeue_names(sandbox))
    result = sbatch(sandbox, f"--job-name={name}", *args)
    assert result.returncode != 0
    assert result.stdout == ""
    assert result.stderr.strip() == f"sbatch: error: {message}"
    names = squeue_names(sandbox)
    assert name not in names
    assert len(names) <= before


def test_controller_refuses_what_a_client_without_the_check_lets_through(sandbox, job_dir):
    """Another slurm.conf whose plugstack loads the plugin without its validator (and no
    client-side Lua): the controller's job_submit.lua still refuses the forbidden
    residency."""
    layout = sandbox.layout.onprem
    plugstack = job_dir / "plugstack.conf"
    original = (layout.etc / "plugstack.conf").read_text().split()
    plugstack.write_text(f"required {original[1]}\n")  # no validator= argument
    conf = job_dir / "slurm.conf"
    conf.write_text("".join(
        f"PlugStackConfig={plugstack}\n" if line.startswith("PlugStackConfig=") else line
        for line in layout.slurm_conf.read_text().splitlines(keepends=True)
        if not line.startswith("CliFilterPlugins=")))
    name = f"bypass-{uuid.uuid4().hex[:6]}"
    result = sbatch(sandbox, f"--job-name={name}", "--geo-cost-center=ml-research",
                    "--geo-data-class=restricted", "--geo-residency=home,remote",
                    slurm_conf=conf)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert lines[0] == "sbatch: error: geo: data class 'restricted' may not reside in " \
                       "region 'remote' (allowed: home)"
    assert "Access/permission denied" in lines[-1]
    assert name not in squeue_names(sandbox)


def test_rest_submissions_are_checked_by_the_controller(sandbox, site, job_dir):
    """slurmrestd runs no SPANK plugin: directives travel as SLURM_GEO_* and the rented
    cluster's job_submit.lua enforces the policy on them."""
    from slurm_geo.sandbox import remote_site

    if remote_site.is_provider(sandbox.layout):
        pytest.skip("rented is the provider's stock Slurm: no job_submit.lua of ours checks "
                    "directives there (docs/sandbox.md)")
    rented = connect(site.cluster("rented"))
    forbidden = Directives(ckpt_dir=str(job_dir / "rest"), cost_center="ml-research",
                           residency=("home",))
    with pytest.raises(SlurmRejected, match="Access/permission denied"):
        rented.submit(JobSpec(script="#!/bin/bash\ntrue\n", name="rest-forbidden",
                              environment=to_environment(forbidden), working_dir=job_dir,
                              owner=ALICE.owner))
    out = job_dir / "rest.txt"
    allowed = Directives(ckpt_dir=str(job_dir / "rest"), cost_center="ml-research",
                         residency=("home", "remote"))
    job_id = rented.submit(JobSpec(
        script=f'#!/bin/bash\nenv | grep "^SLURM_GEO_" | sort > "{out}"\n', name="rest-ok",
        environment=to_environment(allowed), working_dir=job_dir, owner=ALICE.owner))
    eventually(lambda: rented.job(job_id), lambda j: j.state.is_terminal(), 90)
    assert "SLURM_GEO_RESIDENCY=home,remote" in out.read_text().splitlines()


def test_a_failing_geo_prolog_never_fails_a_job_without_directives(sandbox, job_dir):
    """A geo job whose checkpoint directory cannot be created next to a plain job on the
    same node: the prolog logs and lets both run; the node is not drained."""
    blocker = job_dir / "not-a-directory"
    blocker.write_text("")
    geo = sbatch(sandbox, "--geo-cost-center=ml-research", f"--geo-ckpt-dir={blocker}/ckpt",
                 "--nodelist=onprem-n1", f"--output={job_dir}/geo-%j.out",
                 script="#!/bin/bash\necho geo ran\n")
    plain = sbatch(sandbox, "--nodelist=onprem-n1", f"--output={job_dir}/plain-%j.out",
                   script="#!/bin/bash\necho plain ran\n")
    assert geo.returncode == 0 and plain.returncode == 0, geo.stderr + plain.stderr
    geo_id, plain_id = int(geo.stdout), int(plain.stdout)
    assert wait_done(sandbox, plain_id) is JobState.COMPLETED
    assert wait_done(sandbox, geo_id) is JobState.COMPLETED
    assert (job_dir / f"plain-{plain_id}.out").read_text() == "plain ran\n"
    nodes = {n.name: n for n in connect_onprem(sandbox).nodes()}
    assert nodes["onprem-n1"].available
    log = (sandbox.layout.root / "log" / "geo-hooks.log").read_text()
    assert f"prolog of job {geo_id} failed" in log
