"""A job's world (issue 31): `--geo-inputs`, `--geo-env`, `--geo-outputs`.

Their syntax and the rules between them run through Python and job_submit.lua in
tests/test_policy_geo.py (one table for both). Here: the typed view the daemon keeps
(`World`), the submit-time look at `--geo-env` as the submitting user (never as root), the
option tables of the SPANK plugin and job_submit.lua against Python's, and `slurm-geo
status`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from helpers import as_uid

from slurm_geo.federation.model import JobStatus, LogicalJob
from slurm_geo.federation.state.sqlite import FederationState
from slurm_geo.hooks.validator import check_on_disk, path_kind, run
from slurm_geo.policy.directives import DIRECTIVES, DirectiveError, parse_options
from slurm_geo.policy.world import Input, World, env_refusal
from slurm_geo.site import SPANK_SOURCE
from tests.kit.site import write_site

REPO = Path(__file__).resolve().parent.parent
NOBODY = 65534


def test_world_of_directives():
    directives = parse_options({"geo-inputs": "//pfs/ds/:restricted,/home/a/p,/x/a:b:public",
                                "geo-env": "/v/torch.sif", "geo-outputs": "/o/a:b,/o/c"})
    world = World.of(directives)
    assert world.inputs == (Input("/pfs/ds", "restricted"), Input("/home/a/p"),
                            Input("/x/a:b", "public"))
    assert world.env == "/v/torch.sif" and world.outputs == ("/o/a:b", "/o/c")
    assert world.inputs[1].class_given("internal") == "internal"
    assert World.from_options(directives.as_options()) == world
    assert World.from_options({"geo-ckpt-dir": "/c"}).empty
    assert world.to_json() == {
        "inputs": [{"path": "/pfs/ds", "data_class": "restricted"},
                   {"path": "/home/a/p", "data_class": None},
                   {"path": "/x/a:b", "data_class": "public"}],
        "env": "/v/torch.sif", "outputs": ["/o/a:b", "/o/c"]}
    assert world.lines() == [("inputs", "/pfs/ds (restricted), /home/a/p, /x/a:b (public)"),
                             ("env", "/v/torch.sif"), ("outputs", "/o/a:b, /o/c")]
    assert World().lines() == [("inputs", "-"), ("env", "-"), ("outputs", "-")]
    with pytest.raises(DirectiveError):
        World.from_options({"geo-inputs": "relative"})


def test_a_logical_job_lists_its_world():
    job = LogicalJob(logical_job="onprem-1", run="r", home="onprem", script="#!/bin/sh\n",
                     spec={}, directives={"geo-ckpt-dir": "/c",
                                          "geo-inputs": "/pfs/ds:restricted", "geo-env": "/v"},
                     generation=0, cluster="onprem", job_id=1, resume_step=None,
                     status=JobStatus.RUNNING)
    assert job.world == World((Input("/pfs/ds", "restricted"),), "/v", ())


@pytest.mark.parametrize(("path", "kind", "message"), [
    ("/v/venv", "directory", None),
    ("/v/torch.sqsh", "file", None),
    ("/v/torch.squashfs", "file", None),
    ("/v/torch.sif", "file", None),
    ("/v/torch.tar", "file", "geo: --geo-env: '/v/torch.tar' is a file but no container "
                             "image (a name ending in .sqsh, .squashfs, .sif); name a "
                             "virtualenv or conda directory, or the image"),
    ("/v/gone", "missing", "geo: --geo-env: '/v/gone' does not exist; name your virtualenv "
                           "or conda directory, or container image"),
    ("/v/x", "unreadable", "geo: --geo-env: '/v/x' cannot be looked at by you; check its "
                           "permissions"),
    ("/dev/null", "other", "geo: --geo-env: '/dev/null' is neither a directory nor a regular "
                           "file; name a virtualenv or conda directory, or a container image"),
])
def test_env_refusal(path, kind, message):
    assert env_refusal(path, kind) == message


@pytest.fixture
def world_dir():
    """A directory anyone may look into, with a venv, an image, a tarball and a locked
    directory holding a venv."""
    root = Path(tempfile.mkdtemp(prefix="geo-world-", dir="/var/tmp"))
    root.chmod(0o755)
    (root / "venv" / "bin").mkdir(parents=True)
    (root / "torch.sqsh").write_bytes(b"hsqs")
    (root / "torch.tar").write_bytes(b"")
    (root / "locked" / "venv").mkdir(parents=True)
    (root / "locked").chmod(0o700)
    (root / "link").symlink_to(root / "venv")
    yield root
    subprocess.run(["rm", "-rf", str(root)], check=True)


def test_path_kind(world_dir):
    assert path_kind(str(world_dir / "venv")) == "directory"
    assert path_kind(str(world_dir / "link")) == "directory"  # the user's own view
    assert path_kind(str(world_dir / "torch.sqsh")) == "file"
    assert path_kind(str(world_dir / "gone")) == "missing"
    assert path_kind(str(world_dir / "torch.tar" / "x")) == "missing"
    assert path_kind("/dev/null") == "other"


@pytest.mark.root(reason="switches to another uid")
@pytest.mark.parametrize(("name", "answer"), [
    ("venv", "ok"),
    ("link", "ok"),
    ("torch.sqsh", "ok"),
    ("torch.tar", "DirectiveError: geo: --geo-env: '{root}/torch.tar' is a file but no "
                  "container image"),
    ("gone", "DirectiveError: geo: --geo-env: '{root}/gone' does not exist"),
    ("locked/venv", "DirectiveError: geo: --geo-env: '{root}/locked/venv' cannot be looked "
                    "at by you"),
])
def test_env_is_looked_at_as_the_submitting_user(world_dir, name, answer):
    """What another user cannot see is refused: the job would not find it either."""
    got = as_uid(NOBODY, lambda: check_on_disk(str(world_dir / name)))
    assert got.startswith(answer.format(root=world_dir))


@pytest.mark.root(reason="needs root")
def test_root_looks_at_nothing_on_disk(world_dir):
    check_on_disk(str(world_dir / "gone"))  # root never follows a user's path
    check_on_disk(None)


def test_the_validator_checks_env_after_the_rules(tmp_path):
    config = write_site(tmp_path)
    out = tmp_path / "said"
    with out.open("w") as said:
        code = run([f"--config={config}", "--geo-env=/v", "--geo-outputs=/v/out"], said)
    assert code == 5
    assert out.read_text() == ("geo: --geo-outputs: '/v/out' is inside the --geo-env '/v', "
                               "read-only where the job moves; write the outputs outside "
                               "it\n")


# --- every place a directive is named ----------------------------------------------------

def _c_array(source: str, name: str) -> list[str]:
    body = re.search(rf"{name}\[GEO_OPTION_COUNT\] = \{{(.*?)\}};", source, re.S)
    assert body is not None, name
    return re.findall(r'"((?:[^"\\]|\\.)*)"', body.group(1))


def test_the_spank_plugin_registers_every_directive():
    source = SPANK_SOURCE.read_text()
    count = int(re.search(r"#define GEO_OPTION_COUNT (\d+)", source).group(1))
    assert count == len(DIRECTIVES)
    assert _c_array(source, "option_names") == [spec.option for spec in DIRECTIVES]
    assert _c_array(source, "env_names") == [spec.env for spec in DIRECTIVES]
    for array in ("arg_info", "usage"):
        assert len(_c_array(source, array)) == count


@pytest.fixture(scope="module")
def spank_harness(tmp_path_factory) -> Path:
    """tests/spank_harness.c (the plugin's source with Slurm's calls stubbed), built with
    the Makefile's flags."""
    from slurm_geo.sandbox import render

    if not Path("/usr/include/slurm/spank.h").exists():
        pytest.skip("no Slurm headers (apt-get install libslurm-dev)")
    out = tmp_path_factory.mktemp("spank") / "harness"
    argv = [*render.spank_build_argv("cc", REPO / "tests" / "spank_harness.c", out)]
    argv.remove("-shared")
    subprocess.run(argv, check=True, capture_output=True, text=True)
    return out


def _harness(binary: Path, *args: str) -> list[str]:
    return subprocess.run([str(binary), *args], capture_output=True, text=True, check=True,
                          timeout=30).stdout.splitlines()


def test_the_built_plugin_registers_every_directive(spank_harness):
    registered = [line.split("\t")[0] for line in _harness(spank_harness, "options")]
    assert registered == [spec.option for spec in DIRECTIVES]


@pytest.mark.parametrize(("word", "unknown"), [
    ("--geo-inputs=/pfs/ds:restricted", "0"), ("--geo-env=/v", "0"), ("--geo-outputs", "0"),
    ("--geo-input", "0"),  # the start of one: getopt takes it
    ("--geo-inputz=/x", "1"), ("--geo-envs=/v", "1"), ("--geo-output-dir=/o", "1"),
])
def test_the_plugin_knows_the_world_directives(spank_harness, word, unknown):
    assert _harness(spank_harness, "unknown", word) == [unknown]


def test_the_plugin_hands_the_world_on(spank_harness):
    """To the validator as --geo-NAME=VALUE, to Slurm's hooks as GEO_NAME, to the job as
    SLURM_GEO_NAME: values untouched (the validator and job_submit.lua judge them)."""
    said = _harness(spank_harness, "hand", "geo-inputs=/pfs/ds:restricted,/home/a b",
                    "geo-env=/v/t.sif", "geo-outputs=/o")
    assert said == ["argv /bin/validator",
                    "argv --geo-inputs=/pfs/ds:restricted,/home/a b",
                    "argv --geo-env=/v/t.sif", "argv --geo-outputs=/o",
                    "control GEO_INPUTS=/pfs/ds:restricted,/home/a b",
                    "control GEO_ENV=/v/t.sif", "control GEO_OUTPUTS=/o",
                    "job SLURM_GEO_INPUTS=/pfs/ds:restricted,/home/a b",
                    "job SLURM_GEO_ENV=/v/t.sif", "job SLURM_GEO_OUTPUTS=/o"]
    validated = parse_options({a.split("=", 1)[0].removeprefix("argv --"): a.split("=", 1)[1]
                               for a in said[1:4]})
    assert World.of(validated).inputs[1] == Input("/home/a b")


def test_job_submit_lua_reads_every_directive():
    source = (REPO / "slurm_geo" / "policy" / "job_submit.lua").read_text()
    specs = re.findall(r'\{ option = "([a-z-]+)", env = "([A-Z_]+)" \}', source)
    assert specs == [(spec.option, spec.env) for spec in DIRECTIVES]
    for spec in DIRECTIVES:
        assert f'PARSE["{spec.option}"] =' in source


# --- slurm-geo status ---------------------------------------------------------------------



def _status(*args: str, config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "slurm_geo", "status", *args],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SLURM_GEO_CONFIG": str(config)})


def test_status_shows_the_declared_world(tmp_path):
    config = write_site(tmp_path)
    now = time.time()
    state = FederationState(tmp_path / "fed.db")
    world = {"geo-ckpt-dir": "/pfs/c", "geo-inputs": "/pfs/ds:restricted,/home/alice/p",
             "geo-outputs": "/pfs/out"}
    for number, directives in ((7, world), (8, {"geo-ckpt-dir": "/pfs/c"})):
        state.add_job(LogicalJob(logical_job=f"onprem-{number}", run=f"run-{number}", home="onprem",
                                 script="#!/bin/bash\n", spec={}, directives=directives,
                                 generation=0, cluster="onprem", job_id=number, resume_step=None,
                                 status=JobStatus.RUNNING, created_at=now, updated_at=now))
    state.close()
    shown = _status("onprem-7", config=config)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert "  inputs  /pfs/ds (restricted), /home/alice/p" in lines
    assert "  env     -" in lines and "  outputs /pfs/out" in lines
    none = _status("onprem-8", config=config).stdout.splitlines()
    assert ["  inputs  -", "  env     -", "  outputs -"] == [
        line for line in none if line.split()[0] in ("inputs", "env", "outputs")]
    as_json = json.loads(_status("onprem-7", "--json", config=config).stdout)
    assert as_json["world"] == {"inputs": [{"path": "/pfs/ds", "data_class": "restricted"},
                                           {"path": "/home/alice/p", "data_class": None}],
                                "env": None, "outputs": ["/pfs/out"]}
