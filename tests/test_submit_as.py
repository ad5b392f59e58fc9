"""slurm-geo-submit-as, the one privileged helper: a job is started as its owner, and
nothing the owner controls is read or run as root on the way (docs/security.md, "Who runs
with which rights").

The attacks are issue 28's first two findings, as alice would mount them against a daemon
that restarts her job: code in her environment (PYTHONPATH for the SPANK plugin's Python
validator, LD_PRELOAD, LD_AUDIT, LD_LIBRARY_PATH for sbatch's own libslurmfull.so) and an
`#SBATCH --export-file=` through a symlink to a root-only file. Each must run, or open,
as alice, never as root. Then the helper's own interface: whom it starts jobs for, which
options it carries, who may run it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from slurm_geo.sandbox import Sandbox
from slurm_geo.sandbox.users import ALICE, BOB, run_as
from slurm_geo.slurm import CliSlurmClient, JobSpec, Owner, SlurmError
from slurm_geo.slurm.models import DEFAULT_JOB_PATH
from slurm_geo.slurm.submit_as import (
    EXIT_MALFORMED,
    EXIT_REFUSED,
    SUBMIT_AS_PATH,
    MalformedRequest,
    request,
)
from tests.kit.sandbox import user_dir

HELPER = SUBMIT_AS_PATH


# --- the request, pure -------------------------------------------------------------------

def test_a_request_is_nul_separated_fields_then_the_script():
    data = request(Owner("alice", 2001, 2001), Path("/etc/slurm/slurm.conf"),
                   ["--parsable", "--job-name=a b"], {"PATH": "/usr/bin", "X": "1=2"},
                   "#!/bin/sh\necho hi\n")
    assert data == (b"slurm-geo-submit-as/1\0alice\x002001\x002001\0/etc/slurm/slurm.conf\0"
                    b"2\0--parsable\0--job-name=a b\0" b"2\0PATH=/usr/bin\0X=1=2\0"
                    b"#!/bin/sh\necho hi\n")


@pytest.mark.parametrize("environment", [{"A\0B": "1"}, {"A=B": "1"}, {"": "1"},
                                         {"A": "x\0y"}])
def test_a_value_that_cannot_travel_is_refused_before_anything_runs(environment):
    with pytest.raises(MalformedRequest):
        request(Owner("alice", 2001, 2001), Path("/s"), [], environment, "")


def test_options_with_a_nul_are_refused():
    with pytest.raises(MalformedRequest):
        request(Owner("alice", 2001, 2001), Path("/s"), ["--comment=a\0--uid=0"], {}, "")


# --- as the attacker, on the sandbox -----------------------------------------------------

@pytest.fixture
def onprem(sandbox: Sandbox) -> CliSlurmClient:
    layout = sandbox.layout.cluster("onprem")
    assert layout is not None
    return CliSlurmClient("onprem", layout.slurm_conf, timeout_s=30)


@pytest.fixture
def traps(sandbox: Sandbox, request) -> Path:
    """alice's directory of booby traps: each leaves a file named by the uid and euid it
    ran as (`python-UID-EUID`, `ld-UID-EUID`) in `marks/`."""
    home = user_dir(sandbox, ALICE, request.node.name)
    marks = home / "marks"
    marks.mkdir()
    (home / "py").mkdir()
    (home / "py" / "sitecustomize.py").write_text(
        "import os\n"
        f"open('{marks}/python-%d-%d' % (os.getuid(), os.geteuid()), 'w').close()\n")
    source = home / "mark.c"
    source.write_text(
        "#include <stdio.h>\n#include <unistd.h>\n"
        "__attribute__((constructor)) static void mark(void) {\n"
        f"  char p[512]; snprintf(p, sizeof p, \"{marks}/ld-%d-%d\", getuid(), geteuid());\n"
        "  FILE *f = fopen(p, \"w\"); if (f) fclose(f);\n}\n"
        "unsigned int la_version(unsigned int v) { return v; }\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(home / "libmark.so"), str(source)],
                   check=True)
    # sbatch's own library, as alice would plant it: a copy that also loads her code.
    (home / "lib").mkdir()
    real = Path("/usr/lib/x86_64-linux-gnu/slurm-wlm/libslurmfull.so")
    if real.exists():
        shutil.copy(real, home / "lib" / "libslurmfull.so")
        shutil.copy(home / "libmark.so", home / "lib" / "libmark.so")
        subprocess.run([shutil.which("patchelf") or "patchelf", "--add-needed", "libmark.so",
                        str(home / "lib" / "libslurmfull.so")], check=True)
    for path in [home, *home.rglob("*")]:
        os.chown(path, ALICE.uid, ALICE.uid)
    return home


def alices_job(script: str, **environment: str) -> JobSpec:
    return JobSpec(script=script, owner=ALICE.owner, working_dir=Path("/tmp"),
                   environment={"PATH": DEFAULT_JOB_PATH, "HOME": str(ALICE.home),
                                **environment},
                   output="/dev/null", hold=True)


GEO_SCRIPT = "#!/bin/sh\n#SBATCH --geo-cost-center=ml-research\ntrue\n"


@pytest.mark.parametrize("variable", ["PYTHONPATH", "LD_PRELOAD", "LD_AUDIT",
                                      "LD_LIBRARY_PATH"])
def test_code_in_the_owners_environment_runs_as_the_owner_never_as_root(
        onprem, traps, variable):
    """The daemon resubmits alice's job with her environment; her code in it (the SPANK
    validator's sitecustomize, a preloaded or audit library, sbatch's libslurmfull.so)
    runs, but as alice: no mark is ever made by uid or euid 0."""
    value = {"PYTHONPATH": traps / "py", "LD_PRELOAD": traps / "libmark.so",
             "LD_AUDIT": traps / "libmark.so", "LD_LIBRARY_PATH": traps / "lib"}[variable]
    if variable == "LD_LIBRARY_PATH" and not (traps / "lib" / "libslurmfull.so").exists():
        pytest.fail("libslurmfull.so not found where Debian's Slurm installs it")
    job_id = None
    try:
        job_id = onprem.submit(alices_job(GEO_SCRIPT, **{variable: str(value)}))
    except SlurmError:
        pass  # a broken library may stop sbatch: what matters is who ran it
    finally:
        if job_id is not None:
            onprem.cancel(job_id)
    marks = {path.name for path in (traps / "marks").iterdir()}
    kind = "python" if variable == "PYTHONPATH" else "ld"
    assert marks, f"{variable}: the trap never ran, so this test shows nothing"
    assert marks <= {f"{kind}-{ALICE.uid}-{ALICE.uid}"}, marks


@pytest.fixture
def root_secret(sandbox: Sandbox):
    path = sandbox.layout.root / f"root-only-{uuid.uuid4().hex[:8]}.env"
    secret = uuid.uuid4().hex
    path.write_text(f"STOLEN={secret}\n")
    path.chmod(0o600)
    yield path, secret
    path.unlink()


@pytest.mark.parametrize("option", ["--export-file", "--bbf"])
def test_a_file_the_script_names_is_opened_as_the_owner(
        sandbox, onprem, traps, root_secret, option):
    """`#SBATCH --export-file=` or `--bbf=` (the options sbatch itself opens a file for)
    through alice's symlink to a root-only file: sbatch runs as alice, so the file is read
    with her rights or not at all; the secret reaches neither the job's environment
    record nor its record in slurmctld."""
    path, secret = root_secret
    link = traps / "link"
    link.symlink_to(path)
    os.lchown(link, ALICE.uid, ALICE.uid)
    script = f"#!/bin/sh\n#SBATCH {option}={link}\nenv\n"
    job_id = None
    try:
        job_id = onprem.submit(alices_job(script))
    except SlurmError as err:
        assert secret not in str(err)
    if job_id is not None:
        conf = sandbox.layout.cluster("onprem").slurm_conf
        shown = subprocess.run(["scontrol", "show", "job", "-dd", str(job_id)],
                               capture_output=True, text=True,
                               env={**os.environ, "SLURM_CONF": str(conf)}).stdout
        onprem.cancel(job_id)
        assert secret not in shown
    assert path.read_text() == f"STOLEN={secret}\n"  # and nothing wrote to it


# --- the helper's interface ----------------------------------------------------------------

def helper_run(data: bytes, person=None) -> subprocess.CompletedProcess:
    argv = [str(HELPER)]
    if person is None:
        return subprocess.run(argv, input=data, capture_output=True, timeout=30, env={})
    return run_as(person, argv, input=data, capture_output=True, timeout=30)


def spec_request(sandbox: Sandbox, owner: Owner, options=("--parsable", "--hold"),
                 script: str = "#!/bin/sh\ntrue\n") -> bytes:
    layout = sandbox.layout.cluster("onprem")
    assert layout is not None
    return request(owner, layout.slurm_conf, list(options), {"PATH": DEFAULT_JOB_PATH},
                   script)


@pytest.mark.parametrize("owner, why", [
    (Owner("root", 0, 0), "root"),
    (Owner("daemon", 1, 1), "a system account"),
    (Owner("alice", 2002, 2001), "a uid that is not alice's"),
    (Owner("alice", 2001, 2002), "bob's group, which alice is not in"),
    (Owner("nobody-here", 2001, 2001), "no such user"),
])
def test_the_helper_starts_jobs_only_for_real_users_in_their_own_groups(sandbox, owner, why):
    done = helper_run(spec_request(sandbox, owner))
    assert done.returncode == EXIT_REFUSED, (why, done.stderr)
    assert done.stdout == b"", why
    assert done.stderr.decode().startswith("slurm-geo-submit-as: ")
    assert len(done.stderr.decode().strip().splitlines()) == 1


@pytest.mark.parametrize("option", ["--uid=0", "--gid=0", "--export-file=/etc/shadow",
                                    "--wrap=id", "--export=NONE", "--get-user-env",
                                    "--chdir=/tmp\n--uid=0", "-o/etc/x"])
def test_the_helper_carries_only_the_options_a_resubmission_has(sandbox, option):
    done = helper_run(spec_request(sandbox, ALICE.owner, ("--parsable", option)))
    assert done.returncode == EXIT_REFUSED, done.stderr
    assert done.stdout == b""


@pytest.mark.parametrize("data", [b"", b"garbage", b"slurm-geo-submit-as/2\0alice\0",
                                  b"slurm-geo-submit-as/1\0alice\0-1\0",
                                  b"slurm-geo-submit-as/1\0alice\x002001\x002001\0/s\x0099\0"])
@pytest.mark.root(reason="runs as other users or in namespaces (failed as nobody)")
def test_a_malformed_request_is_one_line_and_no_job(data):
    done = helper_run(data)
    assert done.returncode in (EXIT_MALFORMED, EXIT_REFUSED), done.stderr
    assert done.stdout == b""


def test_users_cannot_run_the_helper(sandbox):
    """Mode 4750 root:slurm-geo: bob gets no further than the kernel's permission check,
    even for a request in his own name."""
    assert HELPER.stat().st_mode & 0o7777 == 0o4750
    done = helper_run(spec_request(sandbox, BOB.owner), person=BOB)
    assert done.returncode == 126 and b"Permission denied" in done.stderr, done.stderr


def test_the_helper_ignores_its_callers_environment(sandbox, traps):
    """Its own environment is cleared first: a caller's LD_PRELOAD is dropped by the
    kernel's secure mode, and nothing else of it reaches sbatch."""
    data = spec_request(sandbox, ALICE.owner, ("--test-only",), GEO_SCRIPT)
    done = subprocess.run([str(HELPER)], input=data, capture_output=True, timeout=30,
                          env={"PYTHONPATH": str(traps / "py"),
                               "SLURM_CONF": "/nonexistent/slurm.conf"})
    assert done.returncode == 0, done.stderr
    assert b"to start at" in done.stderr
    assert list((traps / "marks").iterdir()) == []


def test_the_spank_validator_never_runs_as_root_with_the_callers_environment(
        sandbox, traps):
    """Defence in depth: should root run sbatch itself with a user's PYTHONPATH (an admin
    resubmitting a script by hand), the SPANK plugin runs its Python validator with a
    fixed environment, so alice's sitecustomize does not run as root."""
    sandbox.up(progress=lambda _msg: None)  # the plugin as built from this checkout
    conf = sandbox.layout.cluster("onprem").slurm_conf
    done = subprocess.run(["sbatch", "--parsable", "--hold", "--output=/dev/null"],
                          input=GEO_SCRIPT, capture_output=True, text=True, timeout=60,
                          env={"PATH": DEFAULT_JOB_PATH, "SLURM_CONF": str(conf),
                               "PYTHONPATH": str(traps / "py")})
    assert done.returncode == 0, done.stderr
    subprocess.run(["scancel", done.stdout.strip().split(";")[0]],
                   env={"PATH": DEFAULT_JOB_PATH, "SLURM_CONF": str(conf)}, check=True)
    assert list((traps / "marks").iterdir()) == []
