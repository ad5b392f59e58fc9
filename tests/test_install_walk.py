"""docs/install.md followed step by step, from the wheel, on a machine that has only Slurm.

The machine: Debian 13 with Slurm 24.11 installed and configured for one cluster (a
slurm.conf with none of slurm-geo's lines), no slurm-geo, no compiler, no Slurm headers,
no MUNGE: sandbox.rootfs.HOME_2411's image as the lower layer of an overlay, in a mount
and UTS namespace of its own, entered by chroot (tests/install_walk.py; the image is
never changed). The wheel is built from this checkout as a release is
(tests/wheel_build.py) and copied there with docs/examples/site.toml, as an admin would.

Two walks, each in a root of its own: a daemon host that is also the controller, and a
compute node. The daemon host's runs install.md's blocks marked `<!-- walk: NAME -->`,
as written, in install_walk.ORDER: the packages (apt-get, the venv, the wheel, the symlink
on PATH), the service account (section 4, which section 1 says to create before site
install), `slurm-geo site install`, the site config from docs/examples/site.toml with
`slurm-geo config check`, then what site install printed for the admin (the slurm.conf and
plugstack.conf lines added, the commands run: section 1 says to, once the config is in
place), `slurm-geo keys init` and its chown, the federation daemon's key, certificate
request and a site CA signing it (section 6). pip gets slurm-geo's dependencies from a
wheelhouse (PIP_NO_INDEX, PIP_FIND_LINKS: the doc's pip commands are unchanged), fetched
beforehand for the root's Python; apt reaches Debian's registry. The compute node's runs
what install.md asks of every host (install_walk.COMPUTE_ORDER) and none of the printed
commands marked for the daemons' hosts. Then `slurm-geo --help`, `man slurm-geo`, bash
completion, and `slurm-geo doctor --json` with the roles it finds, whose every problem must
be one the test names (EXPECTED_ERRORS, COMPUTE_ERRORS) and whose checks of what the walk
put in place must pass.

What is not run as written, and what the walk does or checks instead:
- `pip install 'torch==...'`: training nodes only (install_walk.NOT_WALKED).
- `apt-get install` has no -y: the walk answers yes (APT::Get::Assume-Yes); `apt-get update`
  runs first, as on any machine whose lists are current.
- `scontrol reconfigure` (printed by site install): no slurmctld runs here; doctor reads
  slurm.conf and plugstack.conf as they are on disk.
- `systemctl daemon-reload && systemctl enable --now ...` (printed by site install):
  systemd does not run in the root, so `systemctl enable UNITS` (install.md says so for an
  image or a chroot); the test checks the wants links and doctor's unit checks pass.
- munge.service: the walk starts munged as systemd would at boot (and stops it).
- man-db is installed first: an admin's machine has `man`, Debian's minimal image not.
- section 1's first block (`pip wheel` from the source) runs on a build host: the wheel is
  built by tests/wheel_build.py, as tests/test_site_install.py builds it.
- the blocks of sections 3 and 5-9 that reach other sites, S3, etcd or a systemd that runs
  (tokens from a provider, sealed keys, `ckpt reseal`, etcd, `federation status`) are not
  walked; doctor names what they leave missing (EXPECTED_ERRORS).

Needs root (namespaces, mounts, chroot), the image (built when missing: Debian's
registry) and the registries (apt, and PyPI for the wheelhouse): skipped, saying so, when
they cannot be reached. About a minute; the roots (0.8 GB each) are removed after.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_geo.sandbox import rootfs
from tests import install_walk
from tests.install_walk import COMPUTE_ORDER, ORDER, blocks, follow_up, printed, walked
from tests.wheel_build import REPO, build_artifacts

INSTALL_MD = REPO / "docs" / "install.md"
# trixie's python3 (python3-venv, as install.md installs it): the wheelhouse is for it.
ROOT_PYTHON = "3.13"
# Every error doctor reports after the walk, by check, and why the walk leaves it: the
# example config's pieces that come from outside this host, and daemons that do not run.
EXPECTED_ERRORS = {
    "secret [clusters.rented] token_file": "the provider's JWT (section 3): not on this host",
    "secret [clusters.rented.users.alice] token_file": "likewise, alice's account's JWT",
    "token ([clusters.rented] token_file)": "likewise",
    "token ([clusters.rented.users.alice])": "likewise",
    "tls (CA provider-ca.pem)": "the provider's CA (section 3): not on this host",
    "tls (CA s3-ca.pem)": "the S3 endpoint's CA (section 2): not on this host",
    "account (onprem)": "no accounting here (sacctmgr asks slurmdbd)",
    "store pfs": "no /lustre here",
    "store offsite": "no S3 endpoint nor credentials here",
    "federation daemon": "it does not run here (systemd does not)",
}

pytestmark = pytest.mark.root(reason="namespaces, mounts and chroot need root")


def test_the_walked_blocks_are_marked_in_install_md() -> None:
    found = blocks(INSTALL_MD.read_text())
    assert set(found) == set(ORDER) - {"conf"}
    assert all(body.strip() for body in found.values())
    assert "site install" in found["site-install"]
    assert "torch" not in walked(found["packages"])
    assert "PIP_" not in "".join(found.values())  # the doc's commands, unchanged


def test_what_site_install_prints_becomes_the_admins_follow_up() -> None:
    output = """72 items, 72 changed

Add to slurm.conf (nothing was edited):
  PlugStackConfig=/etc/slurm/plugstack.conf
  JobRequeue=1

Add to plugstack.conf (CLUSTER: this cluster's name in [clusters]):
  required /usr/local/lib/slurm-geo/geo_directives.so cluster=CLUSTER

Then:
  slurm-geo policy export-lua --cluster CLUSTER --dir /etc/slurm   # job_submit.lua
  scontrol reconfigure   # after adding the lines above
  systemctl daemon-reload && systemctl enable --now a b.timer   # on the daemons' hosts
"""
    lines = printed(output)
    assert lines["slurm.conf"] == ["PlugStackConfig=/etc/slurm/plugstack.conf", "JobRequeue=1"]
    assert follow_up(lines, daemon_host=False)[0].count("systemctl") == 0
    script, changed = follow_up(lines)
    assert "cluster=onprem\n" in script and "PlugStackConfig=/etc/slurm/plugstack.conf\n" in script
    assert "slurm-geo policy export-lua --cluster onprem --dir /etc/slurm\n" in script
    assert "systemctl enable a b.timer\n" in script
    assert "scontrol" not in script and "--now" not in script
    assert len(changed) == 2


# --- the walk ------------------------------------------------------------------------------


def _wheelhouse(wheel: Path, target: Path) -> None:
    """slurm-geo's dependencies as wheels for the root's Python (pip download, binary only,
    for CPython ROOT_PYTHON on glibc Linux of this machine's architecture)."""
    import platform

    machine = platform.machine()
    platforms = [f"manylinux_2_{minor}_{machine}" for minor in range(17, 42)]
    platforms += [f"manylinux2014_{machine}", f"linux_{machine}"]
    tag = ROOT_PYTHON.replace(".", "")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
         "--only-binary=:all:", "--python-version", ROOT_PYTHON, "--implementation", "cp",
         "--abi", f"cp{tag}", "--abi", "abi3", "--abi", "none",
         *(arg for p in platforms for arg in ("--platform", p)), "-d", str(target),
         str(wheel)], capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        if any(marker in done.stderr for marker in ("Could not fetch", "NewConnectionError",
                                                    "Temporary failure", "No matching")):
            pytest.skip(f"the wheelhouse cannot be fetched: {done.stderr.strip()[-300:]}")
        raise AssertionError(done.stderr[-2000:])
    (target / wheel.name).unlink(missing_ok=True)  # the wheel itself comes from /walk


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The image (built when missing), the wheel, and the wheelhouse for the root's Python."""
    try:
        rootfs.ensure_image(rootfs.HOME_2411_IMAGE_DIR, rootfs.HOME_2411)
    except rootfs.RegistryUnreachable as exc:
        pytest.skip(str(exc))
    tmp = tmp_path_factory.mktemp("artifacts")
    wheel = build_artifacts(tmp / "build")["wheel"]
    (tmp / "wheelhouse").mkdir()
    _wheelhouse(wheel, tmp / "wheelhouse")
    return wheel, tmp / "wheelhouse"


def _walk(tmp: Path, artifacts: tuple[Path, Path], steps: tuple[str, ...]) -> Path:
    """One walk, in a root of its own: its /walk directory (out/STEP.out, .rc;
    out/probe-NAME.out, .err, .rc)."""
    wheel, wheelhouse = artifacts
    here = tmp / "walk"
    for name in ("out", "steps"):
        (here / name).mkdir(parents=True)
    shutil.copytree(wheelhouse, here / "wheelhouse")
    shutil.copy2(wheel, here / wheel.name)
    shutil.copy2(REPO / "docs/examples/site.toml", here / "site.toml")
    shutil.copy2(Path(install_walk.__file__), here / "install_walk.py")
    (here / "follow_up.py").write_text(install_walk.FOLLOW_UP)
    found = blocks(INSTALL_MD.read_text())
    for name in steps:
        if name in found:
            (here / "steps" / f"{name}.sh").write_text(walked(found[name]))
    (here / "walk.sh").write_text(install_walk.walk_script(steps))
    (here / "probes.sh").write_text(install_walk.probes_script())
    host = tmp / "root.sh"
    host.write_text(install_walk.root_script(rootfs.HOME_2411_IMAGE_DIR, tmp / "root", here))
    done = subprocess.run(["unshare", "--mount", "--uts", "--propagation", "private",
                           "bash", str(host)], capture_output=True, text=True, timeout=900,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    # The root's files are 0.8 GB (apt's packages, the venv): kept only as far as the tests
    # read them, which absolute path each line site install printed names exists there.
    root = tmp / "root"
    named = {path: (root / "upper" / path.lstrip("/")).exists()
             or (rootfs.HOME_2411_IMAGE_DIR / path.lstrip("/")).exists()
             for path in _named_paths(_read(here, "site-install.out"))}
    (here / "out" / "named.json").write_text(json.dumps(named))
    (here / "out" / "config.exists").write_text(
        str((root / "upper/etc/slurm-geo/config.toml").is_file()))
    shutil.rmtree(root)
    shutil.rmtree(here / "wheelhouse")
    if _read(here, "apt-update.rc") == "75":
        pytest.skip(f"apt-get update cannot reach Debian's registry: "
                    f"{_read(here, 'apt-update.out')[-300:]}")
    return here


@pytest.fixture(scope="module")
def walk(tmp_path_factory: pytest.TempPathFactory, artifacts: tuple[Path, Path]) -> Path:
    """install.md walked on a daemon host that is also the controller (ORDER)."""
    return _walk(tmp_path_factory.mktemp("walk"), artifacts, ORDER)


@pytest.fixture(scope="module")
def compute_walk(tmp_path_factory: pytest.TempPathFactory,
                 artifacts: tuple[Path, Path]) -> Path:
    """install.md walked on a compute node: what it asks of every host (COMPUTE_ORDER)."""
    return _walk(tmp_path_factory.mktemp("compute"), artifacts, COMPUTE_ORDER)


def _named_paths(output: str) -> set[str]:
    """The absolute paths in the slurm.conf and plugstack.conf lines site install printed."""
    lines = printed(output)
    return {path for line in lines["slurm.conf"] + lines["plugstack.conf"]
            for path in re.findall(r"(?<![\w.])(/[\w./-]+)", line)}


def _read(walk_dir: Path, name: str) -> str:
    path = walk_dir / "out" / name
    return path.read_text().strip() if path.exists() else ""


def _probe(walk_dir: Path, name: str) -> str:
    assert _read(walk_dir, f"probe-{name}.rc") == "0", (
        _read(walk_dir, f"probe-{name}.out"), _read(walk_dir, f"probe-{name}.err"))
    return _read(walk_dir, f"probe-{name}.out")


@pytest.mark.slow
def test_every_step_of_install_md_runs_as_written(walk: Path) -> None:
    for step in ORDER:
        assert _read(walk, f"{step}.rc") == "0", (step, _read(walk, f"{step}.out")[-3000:])
    version, where = _probe(walk, "python").split(") ")
    assert version == "(" + ", ".join(ROOT_PYTHON.split(".")), version
    assert where.startswith("/opt/slurm-geo/lib/"), where
    assert "/etc/slurm-geo/config.toml: ok" in _read(walk, "config.out")


@pytest.mark.slow
def test_the_lines_site_install_prints_name_files_that_now_exist(walk: Path) -> None:
    lines = printed(_read(walk, "site-install.out"))
    assert lines["slurm.conf"] and lines["plugstack.conf"] and lines["then"]
    named = json.loads(_read(walk, "named.json"))
    assert "/usr/local/lib/slurm-geo/geo_directives.so" in named
    assert "/usr/local/libexec/slurm-geo/check_directives.py" in named
    assert [path for path, there in named.items() if not there] == [], named
    assert _read(walk, "config.exists") == "True"
    assert _probe(walk, "submit-as") == "root:slurm-geo 4750"  # the account came first
    wants = _probe(walk, "wants").split()
    for unit in ("slurm-geo-federation.service", "slurm-geo-checkpoint-sync.service",
                 "slurm-geo-billing-ingest.timer"):
        assert unit in wants, wants


@pytest.mark.slow
def test_the_master_key_is_the_daemons_accounts_alone(walk: Path) -> None:
    assert _probe(walk, "key") == "slurm-geo:slurm-geo 600"


@pytest.mark.slow
def test_help_man_and_completion_work_on_the_walked_host(walk: Path) -> None:
    assert _probe(walk, "help").startswith("Usage: slurm-geo")
    shown = _probe(walk, "man")
    assert "SLURM-GEO(1)" in shown and "NAME" in shown
    assert "site" in _probe(walk, "completion").split()


@pytest.mark.slow
def test_doctor_reports_only_what_the_walk_leaves_missing(walk: Path) -> None:
    assert _read(walk, "probe-doctor.rc") == "60"  # DOCTOR_FAILED: the expected errors
    report = json.loads(_read(walk, "probe-doctor.out"))
    assert set(report["roles"]) == {"login", "compute", "controller", "daemon"}
    problems = {f["check"]: f["what"] for f in report["findings"] if f["level"] != "ok"}
    assert set(problems) == set(EXPECTED_ERRORS), json.dumps(problems, indent=1)
    assert {f["level"] for f in report["findings"] if f["check"] in problems} == {"error"}
    # What the walk put in place passes: slurm.conf's lines and plugstack.conf's, the
    # plugin built against this Slurm (24.11), munge, the master key, the federation
    # daemon's key and certificate from section 6, the units enabled.
    assert _probe(walk, "slurm").startswith("slurm-wlm 24.11.")
    levels = {f["check"]: f["level"] for f in report["findings"]}
    for check in ("slurm.conf (onprem)", "spank plugin (onprem)", "munge", "master key",
                  "secret [federation] tls_key", "tls ([federation] tls_cert)",
                  "tls (CA site-ca.pem)", "unit slurm-geo-federation.service",
                  "unit slurm-geo-checkpoint-sync.service"):
        assert levels.get(check) == "ok", (check, levels)


# What doctor reports on the compute node, and why.
COMPUTE_ERRORS = {
    "tls (CA provider-ca.pem)": EXPECTED_ERRORS["tls (CA provider-ca.pem)"],
    "tls (CA s3-ca.pem)": EXPECTED_ERRORS["tls (CA s3-ca.pem)"],
    "tls (CA site-ca.pem)": "the site CA's certificate comes from the daemon host "
                            "(section 6): not copied here",
    "federation daemon": "not asked: the site CA's certificate is not here (above)",
}


@pytest.mark.slow
def test_a_compute_node_walked_is_no_daemon_host(compute_walk: Path) -> None:
    """Every host runs site install, which puts the daemons' units in place, and gets the
    same site config: doctor must not take a compute node for a daemon host (and fail it
    for the master key and units it must not have)."""
    for step in COMPUTE_ORDER:
        assert _read(compute_walk, f"{step}.rc") == "0", (
            step, _read(compute_walk, f"{step}.out")[-3000:])
    assert _read(compute_walk, "probe-doctor.rc") == "60"
    report = json.loads(_read(compute_walk, "probe-doctor.out"))
    assert set(report["roles"]) == {"login", "compute", "controller"}
    problems = {f["check"]: f["what"] for f in report["findings"] if f["level"] != "ok"}
    assert set(problems) == set(COMPUTE_ERRORS), json.dumps(problems, indent=1)
    assert "cannot be asked: its CA file /etc/slurm-geo/site-ca.pem" in \
        problems["federation daemon"]
    levels = {f["check"]: f["level"] for f in report["findings"]}
    for check in ("slurm.conf (onprem)", "spank plugin (onprem)", "munge", "master key"):
        assert levels.get(check) == "ok", (check, levels)
    assert _probe(compute_walk, "submit-as") == "root:root 755"  # no service account here
