"""What a site installs, end to end: the sdist and the wheel built by the standard backend
(setuptools.build_meta; the wheel from the unpacked sdist, so the sdist is complete) carry
the hooks, the units, the SPANK plugin's and submit-as's sources and the Lua; the wheel,
installed into a fresh virtualenv, runs `slurm-geo site install --root` twice (the second
time everything is unchanged), and what it put there is complete, with the right modes:
the units pass `systemd-analyze verify` with their Documentation= man pages, the hooks run
with the venv's Python, `--help`, `man` and bash completion work from the installed package.

The checkout is copied first (tests/wheel_build.py), so nothing is built in it,
and the venv sees this machine's packages (--system-site-packages, no network) but its own
slurm_geo: the editable install of the checkout stays as it is.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from slurm_geo.site import plan
from tests.wheel_build import REPO, build_artifacts, run

VERSION = "0.1.0"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("cc") is None
                       or not Path("/usr/include/slurm/spank.h").exists(),
                       reason="needs cc and Slurm's headers (apt-get install gcc libslurm-dev)"),
]

SHIPPED = (
    *(f"slurm_geo/share/hooks/{name}.py" for name in plan.HOOK_NAMES),
    "slurm_geo/share/spank/geo_directives.c",
    "slurm_geo/share/libexec/submit_as.c",
    "slurm_geo/share/systemd/slurm-geo-federation.service",
    "slurm_geo/share/systemd/slurm-geo-checkpoint-sync.service",
    "slurm_geo/share/systemd/slurm-geo-billing-ingest.service",
    "slurm_geo/share/systemd/slurm-geo-billing-ingest.timer",
    "slurm_geo/share/systemd/slurm-geo-etcd.service",
    "slurm_geo/share/systemd/sealed-master-key.conf",
    "slurm_geo/policy/job_submit.lua",
    "slurm_geo/policy/cli_filter.lua",
)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """The sdist built from a copy of the checkout, and the wheel built from the sdist."""
    return build_artifacts(tmp_path_factory.mktemp("artifacts"))


@pytest.fixture(scope="module")
def venv(built, tmp_path_factory) -> Path:
    """A fresh virtualenv with the wheel installed (this machine's dependencies)."""
    path = tmp_path_factory.mktemp("venv") / "v"
    done = run([sys.executable, "-m", "venv", "--system-site-packages", path])
    assert done.returncode == 0, done.stderr
    done = run([path / "bin" / "python", "-m", "pip", "install", "--no-deps", "--no-index",
                "--force-reinstall", "--disable-pip-version-check", built["wheel"]])
    assert done.returncode == 0, done.stderr[-2000:]
    return path


@pytest.fixture(scope="module")
def installed(venv, tmp_path_factory) -> tuple[Path, list[dict], list[dict]]:
    """`site install --root` run twice from the venv: the root and both runs' items."""
    root = tmp_path_factory.mktemp("site") / "root"
    runs = []
    for _ in range(2):
        done = run([venv / "bin" / "slurm-geo", "site", "install", "--root", root, "--json"],
                   cwd="/")
        assert done.returncode == 0, done.stderr
        runs.append(json.loads(done.stdout)["items"])
    return root, runs[0], runs[1]


def test_the_sdist_and_the_wheel_carry_everything_installed_around_the_package(built):
    wheel = set(zipfile.ZipFile(built["wheel"]).namelist())
    with tarfile.open(built["sdist"]) as archive:
        sdist = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    for name in SHIPPED:
        assert name in wheel, name
        assert name in sdist, name


def test_the_venv_imports_its_own_copy(venv):
    # As a unit's ExecStart runs it: no PYTHONPATH of the shell that runs the tests.
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = run([venv / "bin" / "python", "-c", "import slurm_geo; print(slurm_geo.__file__)"],
               cwd="/", env=clean)
    assert Path(done.stdout.strip()).is_relative_to(venv), done.stdout
    here = run([sys.executable, "-c", "import slurm_geo; print(slurm_geo.__file__)"], cwd="/")
    assert Path(here.stdout.strip()).is_relative_to(REPO)  # the editable install untouched


def test_a_second_install_changes_nothing(installed):
    root, first, second = installed
    assert {item["action"] for item in first} == {"create"}
    assert {item["action"] for item in second} == {"unchanged"}
    assert [item["path"] for item in first] == [item["path"] for item in second]


def test_every_hook_unit_and_plugin_is_there_with_its_mode(installed, venv):
    root, first, _ = installed
    prefix = root / "usr/local"
    expected = {
        **{prefix / f"libexec/slurm-geo/{name}.py": 0o755 for name in plan.HOOK_NAMES},
        prefix / "lib/slurm-geo/geo_directives.so": 0o755,
        prefix / "libexec/slurm-geo/submit-as": 0o755,  # not setuid under --root
        prefix / "share/slurm-geo/sealed-master-key.conf": 0o644,
        prefix / "share/bash-completion/completions/slurm-geo": 0o644,
        prefix / "share/man/man1/slurm-geo-site-install.1": 0o644,
        **{root / "etc/systemd/system" / name: 0o644 for name in (
            "slurm-geo-federation.service", "slurm-geo-checkpoint-sync.service",
            "slurm-geo-billing-ingest.service", "slurm-geo-billing-ingest.timer",
            "slurm-geo-etcd.service")},
    }
    for path, mode in expected.items():
        assert path.is_file(), path
        assert stat.S_IMODE(path.stat().st_mode) == mode, path
    assert {Path(item["installed_at"]) for item in first} >= set(expected)
    python = str(venv / "bin" / "python")
    for name in plan.HOOK_NAMES:
        text = (prefix / f"libexec/slurm-geo/{name}.py").read_text()
        assert text.splitlines()[0] == f"#!{python}"
    symbols = run(["nm", "-D", "--defined-only", prefix / "lib/slurm-geo/geo_directives.so"])
    assert " slurm_spank_init\n" in symbols.stdout


def test_the_hooks_run_with_the_venvs_python(installed):
    root, _, _ = installed
    for name in plan.HOOK_SETTINGS:  # a job without directives: exit 0 at once
        done = run([root / f"usr/local/libexec/slurm-geo/{name}.py"], env={}, cwd="/")
        assert done.returncode == 0, (name, done.stderr)


def test_the_units_pass_systemd_analyze_verify_with_their_man_pages(installed, venv):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("needs systemd-analyze")
    root, _, _ = installed
    units = root / "etc/systemd/system"
    for unit in units.iterdir():
        for line in unit.read_text().splitlines():
            if line.startswith("ExecStart=/") and "slurm-geo" in line.split()[0]:
                assert line.split("=", 1)[1].startswith(str(venv / "bin")), line
    # No running systemd needed. Documentation=man:... pages are looked up with man, on
    # MANPATH: the root's pages, so a page the install did not put there fails.
    env = {**os.environ, "MANPATH": str(root / "usr/local/share/man")}
    done = run(["systemd-analyze", "verify", *sorted(p.name for p in units.iterdir())],
               cwd=units, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == ""


def test_help_man_and_completion_work_from_the_installed_package(installed, venv):
    root, _, _ = installed
    done = run([venv / "bin" / "slurm-geo", "site", "install", "--help"], cwd="/")
    assert done.returncode == 0 and "Usage: slurm-geo site install" in done.stdout
    page = root / "usr/local/share/man/man1/slurm-geo-site-install.1"
    if shutil.which("man") is not None:
        shown = run(["man", "-l", page], env={**os.environ, "MANPAGER": "cat",
                                             "MANWIDTH": "100"})
        assert shown.returncode == 0, shown.stderr
        assert "slurm-geo site install" in shown.stdout and "--slurm-include" in shown.stdout
    else:
        assert page.read_text().startswith(".TH SLURM-GEO-SITE-INSTALL 1")
    completion = root / "usr/local/share/bash-completion/completions/slurm-geo"
    script = (f"source {completion}; COMP_WORDS=(slurm-geo si); COMP_CWORD=1; "
              "_slurm_geo_completion slurm-geo; printf '%s\\n' \"${COMPREPLY[@]}\"")
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": "/nonexistent"}
    done = run(["bash", "--norc", "--noprofile", "-c", script], env=env, cwd="/")
    assert done.returncode == 0, done.stderr
    assert "site" in done.stdout.split(), done.stdout
