"""--geo-* directives: parsing and the site's rules, table-driven, without Slurm.

The same cases run through the Python check (the SPANK plugin's validator) and through
job_submit.lua under a stock Lua 5.1 with a stub `slurm` table: both must accept and
refuse alike, with the same message.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from slurm_geo.config.tables import parse_policy
from slurm_geo.errors import ConfigError
from slurm_geo.policy.directives import (
    DIRECTIVES,
    DirectiveError,
    Directives,
    PolicyViolation,
    from_environment,
    parse_arguments,
    parse_options,
    to_environment,
)
from slurm_geo.policy.geo import GeoPolicy, check, effective_residency
from slurm_geo.policy.lua import export_files, lua_string, policy_lua
from tests.kit.policy import REGIONS, RULES

OK = {"geo-ckpt-dir": "/pfs/ckpt/run1", "geo-cost-center": "ml"}

# (id, directives, cluster, exit code: 0 accepted / 5 mistake / 6 forbidden, message part)
CASES = [
    ("no-directives", {}, "onprem", 0, ""),
    ("minimal", OK, "onprem", 0, ""),
    ("everything", {**OK, "geo-ckpt-interval": "30", "geo-residency": "home,remote",
                    "geo-data-class": "internal", "geo-max-cost": "99.50",
                    "geo-failover": "auto", "geo-clusters": "onprem,rented"}, "rented", 0, ""),
    ("restricted-at-home", {**OK, "geo-data-class": "restricted"}, "onprem", 0, ""),
    ("relative-dir", {**OK, "geo-ckpt-dir": "ckpt"}, "onprem", 5,
     "geo: --geo-ckpt-dir: 'ckpt' is not an absolute path"),
    ("newline-dir", {**OK, "geo-ckpt-dir": "/a\nb"}, "onprem", 5,
     "geo: --geo-ckpt-dir: '/a?b' is not an absolute path"),
    ("interval-zero", {**OK, "geo-ckpt-interval": "0"}, "onprem", 5,
     "geo: --geo-ckpt-interval: '0' is not a whole number of minutes from 1 to 10080"),
    ("interval-words", {**OK, "geo-ckpt-interval": "ten"}, "onprem", 5,
     "'ten' is not a whole number of minutes"),
    ("interval-huge", {**OK, "geo-ckpt-interval": "99999"}, "onprem", 5,
     "'99999' is not a whole number of minutes"),
    ("residency-empty-item", {**OK, "geo-residency": "home,,remote"}, "onprem", 5,
     "geo: --geo-residency: 'home,,remote' is not a comma-separated list of names"),
    ("residency-twice", {**OK, "geo-residency": "home,home"}, "onprem", 5,
     "geo: --geo-residency: 'home,home' names one entry twice"),
    ("unknown-region", {**OK, "geo-residency": "mars"}, "onprem", 5,
     "geo: --geo-residency: unknown region 'mars' (known: home, remote)"),
    ("bad-data-class", {**OK, "geo-data-class": "secret"}, "onprem", 5,
     "geo: --geo-data-class: 'secret' is not one of public, internal, restricted"),
    ("bad-cost-center", {**OK, "geo-cost-center": "a b"}, "onprem", 5,
     "geo: --geo-cost-center: 'a b' must be 1-64 letters"),
    ("cost-center-brackets", {**OK, "geo-cost-center": "x]]"}, "onprem", 5,
     "geo: --geo-cost-center: 'x]]' must be 1-64 letters"),
    ("cost-center-newline", {**OK, "geo-cost-center": "ml\nx"}, "onprem", 5,
     "geo: --geo-cost-center: 'ml?x' must be 1-64 letters"),
    ("cost-center-dashes", {**OK, "geo-cost-center": "-ml"}, "onprem", 5,
     "geo: --geo-cost-center has no value (it took the next option, '-ml'); write "
     "--geo-cost-center=VALUE on one line"),
    ("cost-center-too-long", {**OK, "geo-cost-center": "m" * 65}, "onprem", 5,
     "must be 1-64 letters"),
    ("cluster-quote", {**OK, "geo-clusters": "onprem,x'y"}, "onprem", 5,
     "geo: --geo-clusters: 'onprem,x'y' is not a comma-separated list of names"),
    ("negative-cost", {**OK, "geo-max-cost": "-5"}, "onprem", 5,
     "geo: --geo-max-cost: '-5' is not an amount of USD greater than 0"),
    ("zero-cost", {**OK, "geo-max-cost": "0"}, "onprem", 5, "'0' is not an amount of USD"),
    ("tenth-of-a-cent", {**OK, "geo-max-cost": "0.001"}, "onprem", 0, ""),
    ("six-decimals", {**OK, "geo-cost-center": "ops", "geo-max-cost": "99.499999"}, "onprem",
     0, ""),
    ("seven-decimals", {**OK, "geo-max-cost": "0.0000001"}, "onprem", 5,
     "geo: --geo-max-cost: '0.0000001' is not an amount of USD greater than 0, with at most "
     "6 decimals (e.g. 250, 99.50 or 0.001)"),
    ("tiny-over-budget", {**OK, "geo-cost-center": "ops", "geo-max-cost": "99.500001"},
     "onprem", 6, "geo: --geo-max-cost=99.5 exceeds the budget of cost center 'ops' (99.5 USD)"),
    ("leading-dot-cost", {**OK, "geo-max-cost": ".5"}, "onprem", 5, "'.5' is not an amount"),
    ("bad-failover", {**OK, "geo-failover": "sometimes"}, "onprem", 5,
     "geo: --geo-failover: 'sometimes' is not one of auto, manual, never"),
    ("unknown-cluster", {**OK, "geo-clusters": "onprem,nowhere"}, "onprem", 5,
     "geo: --geo-clusters: unknown cluster 'nowhere' (known: onprem, rented)"),
    ("auto-without-ckpt", {"geo-cost-center": "ml", "geo-failover": "auto"}, "onprem", 5,
     "geo: --geo-failover=auto needs --geo-ckpt-dir=PATH: a job moves with its checkpoints"),
    ("no-cost-center", {"geo-ckpt-dir": "/pfs/x"}, "onprem", 5,
     "geo: this site requires --geo-cost-center=NAME on jobs with --geo-* directives"),
    ("restricted-abroad", {**OK, "geo-data-class": "restricted",
                           "geo-residency": "home,remote"}, "onprem", 6,
     "geo: data class 'restricted' may not reside in region 'remote' (allowed: home)"),
    ("restricted-on-rented", {**OK, "geo-data-class": "restricted"}, "rented", 6,
     "geo: cluster 'rented' is in region 'remote', outside the job's residency (home)"),
    ("residency-excludes-cluster", {**OK, "geo-residency": "home"}, "rented", 6,
     "geo: cluster 'rented' is in region 'remote', outside the job's residency (home)"),
    ("clusters-outside-residency", {**OK, "geo-residency": "home",
                                    "geo-clusters": "onprem,rented"}, "onprem", 6,
     "geo: --geo-clusters: cluster 'rented' is in region 'remote', outside the job's "
     "residency (home)"),
    ("unknown-cost-center", {**OK, "geo-cost-center": "marketing"}, "onprem", 6,
     "geo: --geo-cost-center: unknown cost center 'marketing' (known: ml, ops)"),
    ("over-budget", {**OK, "geo-cost-center": "ops", "geo-max-cost": "100"}, "onprem", 6,
     "geo: --geo-max-cost=100 exceeds the budget of cost center 'ops' (99.5 USD)"),
    # An option without =VALUE took the next #SBATCH line's option as its value.
    ("dir-took-next-line", {**OK, "geo-ckpt-dir": "--time=5"}, "onprem", 5,
     "geo: --geo-ckpt-dir has no value (it took the next option, '--time=5'); write "
     "--geo-ckpt-dir=VALUE on one line"),
    ("cost-center-took-short-option", {**OK, "geo-cost-center": "-t"}, "onprem", 5,
     "geo: --geo-cost-center has no value (it took the next option, '-t')"),
    ("interval-took-next-line", {**OK, "geo-ckpt-interval": "--geo-residency=home"},
     "onprem", 5, "geo: --geo-ckpt-interval has no value (it took the next option, "
     "'--geo-residency=home')"),
    ("empty-value", {**OK, "geo-residency": ""}, "onprem", 5,
     "geo: --geo-residency has no value; write --geo-residency=VALUE"),
    ("negative-is-a-value", {**OK, "geo-ckpt-interval": "-5"}, "onprem", 5,
     "geo: --geo-ckpt-interval: '-5' is not a whole number of minutes"),
    # Checkpoint paths: absolute, normalised, no '..', within PATH_MAX and NAME_MAX.
    ("dir-normalised", {**OK, "geo-ckpt-dir": "//pfs/./ckpt//run1/"}, "onprem", 0, ""),
    ("dir-root", {**OK, "geo-ckpt-dir": "/"}, "onprem", 0, ""),
    ("dir-dotdot", {**OK, "geo-ckpt-dir": "/pfs/ckpt/../../etc"}, "onprem", 5,
     "geo: --geo-ckpt-dir: '/pfs/ckpt/../../etc' contains '..'; name the directory without "
     "it"),
    ("dir-dotdot-at-end", {**OK, "geo-ckpt-dir": "/pfs/.."}, "onprem", 5, "contains '..'"),
    ("dir-dots-in-a-name", {**OK, "geo-ckpt-dir": "/pfs/run..2/..."}, "onprem", 0, ""),
    ("dir-5000", {**OK, "geo-ckpt-dir": "/pfs/" + "/".join(["d" * 99] * 50)}, "onprem", 5,
     "geo: --geo-ckpt-dir: '/pfs/" + "d" * 43 + "..." + "d" * 16 + "' is 5004 bytes long; "
     "paths are at most 4095 (PATH_MAX)"),
    ("dir-just-fits", {**OK, "geo-ckpt-dir": "/" + "/".join(["d" * 255] * 16)[:4094]},
     "onprem", 0, ""),
    ("dir-one-past", {**OK, "geo-ckpt-dir": "/" + "/".join(["d" * 255] * 16)[:4095]},
     "onprem", 5, "is 4096 bytes long; paths are at most 4095 (PATH_MAX)"),
    ("dir-long-component", {**OK, "geo-ckpt-dir": "/pfs/" + "x" * 256}, "onprem", 5,
     "has a component longer than 255 bytes (NAME_MAX)"),
    ("dir-long-utf8-elided", {**OK, "geo-ckpt-dir": "/pfs/" + "é" * 200}, "onprem", 5,
     "geo: --geo-ckpt-dir: '/pfs/" + "é" * 21 + "..." + "é" * 8 + "' has a component "
     "longer than 255 bytes (NAME_MAX)"),
    ("long-name-elided", {**OK, "geo-residency": "home," + "r" * 300}, "onprem", 5,
     "geo: --geo-residency: 'home," + "r" * 43 + "..." + "r" * 16 + "' is not a "
     "comma-separated list of names"),
    # --geo-clusters must name the cluster the job is submitted to.
    ("clusters-elsewhere-only", {**OK, "geo-clusters": "rented"}, "onprem", 5,
     "geo: --geo-clusters: 'rented' leaves out 'onprem', the cluster this job is submitted "
     "to: name it too, or submit the job to a cluster it names"),
    ("clusters-here-only", {**OK, "geo-clusters": "rented"}, "rented", 0, ""),
    ("clusters-unknown-before-elsewhere", {**OK, "geo-clusters": "nowhere"}, "onprem", 5,
     "geo: --geo-clusters: unknown cluster 'nowhere'"),
    ("first-mistake-wins", {**OK, "geo-ckpt-dir": "x", "geo-residency": "mars"}, "onprem", 5,
     "geo: --geo-ckpt-dir: 'x' is not an absolute path"),
    # An auto failover that can never happen (issue 29): no other cluster is eligible.
    ("auto-residency-home", {**OK, "geo-failover": "auto", "geo-residency": "home"},
     "onprem", 5, "geo: --geo-failover=auto can never move this job: its residency (home) "
     "leaves no cluster but 'onprem'; write --geo-failover=never, or allow another cluster"),
    ("auto-restricted-data", {**OK, "geo-failover": "auto", "geo-data-class": "restricted"},
     "onprem", 5, "geo: --geo-failover=auto can never move this job: its residency (home)"),
    ("auto-clusters-here-only", {**OK, "geo-failover": "auto", "geo-clusters": "onprem"},
     "onprem", 5, "geo: --geo-failover=auto can never move this job: its residency (home, "
     "remote) and --geo-clusters (onprem) leave no cluster but 'onprem'"),
    ("auto-anywhere", {**OK, "geo-failover": "auto"}, "onprem", 0, ""),
    ("auto-from-rented-home", {**OK, "geo-failover": "auto", "geo-residency": "home,remote",
                               "geo-clusters": "rented,onprem"}, "rented", 0, ""),
    ("manual-residency-home", {**OK, "geo-failover": "manual", "geo-residency": "home"},
     "onprem", 0, ""),
    ("never-residency-home", {**OK, "geo-failover": "never", "geo-residency": "home"},
     "onprem", 0, ""),
    ("residency-mistake-before-auto", {**OK, "geo-failover": "auto", "geo-residency": "mars"},
     "onprem", 5, "geo: --geo-residency: unknown region 'mars'"),
    # A job's world (issue 31): --geo-inputs, --geo-env, --geo-outputs.
    ("world", {**OK, "geo-inputs": "//pfs/ds/:restricted,/home/alice/proj,/x/a:b:public",
               "geo-env": "/home/alice/venv/", "geo-outputs": "/pfs/out,/pfs/o:1"},
     "onprem", 0, ""),
    ("world-image", {**OK, "geo-env": "/images/torch.sqsh"}, "onprem", 0, ""),
    ("inputs-relative", {**OK, "geo-inputs": "/pfs/ds,data"}, "onprem", 5,
     "geo: --geo-inputs: 'data' is not an absolute path"),
    ("inputs-dotdot", {**OK, "geo-inputs": "/pfs/ds/../../etc"}, "onprem", 5,
     "geo: --geo-inputs: '/pfs/ds/../../etc' contains '..'"),
    ("inputs-newline", {**OK, "geo-inputs": "/pfs/a\nb"}, "onprem", 5,
     "geo: --geo-inputs: '/pfs/a?b' is not an absolute path"),
    ("inputs-nul", {**OK, "geo-outputs": "/pfs/a\0b"}, "onprem", 5,
     "geo: --geo-outputs: '/pfs/a?b' is not an absolute path"),
    ("inputs-empty-entry", {**OK, "geo-inputs": "/a,,/b"}, "onprem", 5,
     "geo: --geo-inputs: '/a,,/b' has an empty entry (two commas, or one at an end)"),
    ("inputs-trailing-comma", {**OK, "geo-outputs": "/a,"}, "onprem", 5,
     "geo: --geo-outputs: '/a,' has an empty entry"),
    ("inputs-twice", {**OK, "geo-inputs": "/pfs/ds,//pfs/ds/:public"}, "onprem", 5,
     "geo: --geo-inputs: '/pfs/ds,//pfs/ds/:public' names '/pfs/ds' twice"),
    ("inputs-root", {**OK, "geo-inputs": "/pfs,/"}, "onprem", 5,
     "geo: --geo-inputs: '/' is the root directory; name the directories and files the job "
     "uses"),
    ("inputs-bad-class", {**OK, "geo-inputs": "/pfs/ds:secret"}, "onprem", 5,
     "geo: --geo-inputs: '/pfs/ds:secret' ends in ':secret', not a data class (public, "
     "internal, restricted): write PATH or PATH:CLASS (a path with ':' needs its class after "
     "it)"),
    ("inputs-colon-path", {**OK, "geo-inputs": "/pfs/run:12"}, "onprem", 5,
     "geo: --geo-inputs: '/pfs/run:12' ends in ':12', not a data class"),
    ("inputs-class-only", {**OK, "geo-inputs": ":restricted"}, "onprem", 5,
     "geo: --geo-inputs: ':restricted' is not an absolute path"),
    ("inputs-too-many", {**OK, "geo-inputs": ",".join(f"/d/{i}" for i in range(33))},
     "onprem", 5, "names 33 paths; at most 32: name the directories that hold them"),
    ("inputs-too-long", {**OK, "geo-outputs": ",".join(["/" + "o" * 1000] * 17)}, "onprem",
     5, "is 17033 bytes long; a list is at most 16384: name the directories that hold the "
     "files"),
    ("inputs-took-next-line", {**OK, "geo-inputs": "--geo-env=/v"}, "onprem", 5,
     "geo: --geo-inputs has no value (it took the next option, '--geo-env=/v')"),
    ("env-two", {**OK, "geo-env": "/v1,/v2"}, "onprem", 5,
     "geo: --geo-env: '/v1,/v2' names more than one path; a job has one environment"),
    ("env-relative", {**OK, "geo-env": "venv"}, "onprem", 5,
     "geo: --geo-env: 'venv' is not an absolute path"),
    ("env-root", {**OK, "geo-env": "//"}, "onprem", 5, "geo: --geo-env: '//' is the root"),
    ("output-is-input", {**OK, "geo-inputs": "/pfs/proj", "geo-outputs": "/pfs/out,/pfs/proj/"},
     "onprem", 5, "geo: --geo-outputs: '/pfs/proj' is the input '/pfs/proj', read-only where "
     "the job moves; write the outputs outside it"),
    ("output-inside-input", {**OK, "geo-inputs": "/pfs/proj:internal",
                             "geo-outputs": "/pfs/proj/out"},
     "onprem", 5, "geo: --geo-outputs: '/pfs/proj/out' is inside the input '/pfs/proj'"),
    ("output-holds-env", {**OK, "geo-env": "/home/a/venv", "geo-outputs": "/home/a"},
     "onprem", 5, "geo: --geo-outputs: '/home/a' holds the --geo-env '/home/a/venv'"),
    ("output-sibling-prefix", {**OK, "geo-inputs": "/pfs/proj", "geo-outputs": "/pfs/proj2"},
     "onprem", 0, ""),
    ("restricted-input-at-home", {**OK, "geo-inputs": "/pfs/ds:restricted",
                                  "geo-residency": "home,remote"}, "onprem", 0, ""),
    ("restricted-input-on-rented", {**OK, "geo-inputs": "/pfs/a,/pfs/ds:restricted"},
     "rented", 6, "geo: --geo-inputs: '/pfs/ds' is data class 'restricted', which may not "
     "reside in region 'remote' of cluster 'rented' (allowed: home)"),
    ("restricted-input-auto", {**OK, "geo-failover": "auto",
                               "geo-inputs": "/pfs/ds:restricted"}, "onprem", 5,
     "geo: --geo-failover=auto can never move this job: its residency (home, remote) and "
     "input '/pfs/ds' of data class 'restricted' (home) leave no cluster but 'onprem'"),
    ("restricted-input-auto-clusters", {**OK, "geo-failover": "auto",
                                        "geo-clusters": "onprem,rented",
                                        "geo-inputs": "/pfs/ds:restricted"}, "onprem", 5,
     "its residency (home, remote) and input '/pfs/ds' of data class 'restricted' (home) "
     "and --geo-clusters (onprem,rented) leave no cluster but 'onprem'"),
    ("public-input-auto", {**OK, "geo-failover": "auto", "geo-inputs": "/pfs/ds:public"},
     "onprem", 0, ""),
    ("restricted-input-manual", {**OK, "geo-failover": "manual",
                                 "geo-inputs": "/pfs/ds:restricted"}, "onprem", 0, ""),
]
IDS = [case[0] for case in CASES]


def python_verdict(directives: dict[str, str], cluster: str) -> tuple[int, str]:
    try:
        check(parse_options(directives), RULES, cluster)
    except DirectiveError as exc:
        return exc.exit_code, str(exc)
    return 0, ""


@pytest.mark.parametrize(("name", "directives", "cluster", "code", "message"), CASES, ids=IDS)
def test_python_check(name, directives, cluster, code, message):
    got_code, got_message = python_verdict(directives, cluster)
    assert got_code == code
    assert message in got_message
    assert "\n" not in got_message


# --- the same table through job_submit.lua ---------------------------------------------------

LUA = shutil.which("lua5.1") or shutil.which("lua")
HARNESS = """
slurm = {SUCCESS = 0, ERROR = -1, ESLURM_ACCESS_DENIED = 2002}
function slurm.log_info(...) end
local message = ""
function slurm.log_user(fmt, ...) message = string.format(fmt, ...) end
dofile(arg[1] .. "/job_submit.lua")
for _, case in ipairs(dofile(arg[2])) do
  message = ""
  local job = {spank_job_env = case.env, requeue = 65534}
  local rc = slurm_job_submit(job, {}, 0)
  io.write(case.id, "\\t", rc, "\\t", tostring(job.requeue), "\\t",
           (string.gsub(message, "\\n", "\\\\n")), "\\n")
end
"""


def lua_verdicts(tmp_path: Path, cases, env_prefix: str = "GEO_") -> dict[str, tuple]:
    """{case id: (rc, requeue, message)} from job_submit.lua, one Lua process per cluster."""
    by_spec = {spec.option: spec.env for spec in DIRECTIVES}
    results = {}
    for cluster in ("onprem", "rented"):
        directory = tmp_path / cluster
        directory.mkdir(exist_ok=True)
        for name, text in export_files(RULES, cluster, "test").items():
            (directory / name).write_text(text)
        rows = []
        for case_id, directives, case_cluster, *_ in cases:
            if case_cluster != cluster:
                continue
            entries = [f"{env_prefix}{by_spec[o]}={v}" for o, v in directives.items()]
            env = ", ".join(f"[{i}] = {lua_string(e)}" for i, e in enumerate(entries))
            rows.append(f"{{id = {lua_string(case_id)}, env = {{{env}}}}}")
        cases_file = directory / "cases.lua"
        cases_file.write_text("return {\n" + ",\n".join(rows) + "\n}\n")
        (directory / "harness.lua").write_text(HARNESS)
        out = subprocess.run([LUA, str(directory / "harness.lua"), str(directory),
                              str(cases_file)], capture_output=True, text=True, check=True)
        for line in out.stdout.splitlines():
            case_id, rc, requeue, message = line.split("\t")
            results[case_id] = (int(rc), requeue, message.replace("\\n", "\n"))
    return results


@pytest.fixture(scope="module")
def lua_results(tmp_path_factory) -> dict[str, tuple]:
    if LUA is None:
        pytest.skip("no Lua interpreter (apt-get install lua5.1)")
    return lua_verdicts(tmp_path_factory.mktemp("lua"), CASES)


@pytest.mark.parametrize(("name", "directives", "cluster", "code", "message"), CASES, ids=IDS)
def test_job_submit_lua_agrees_with_python(lua_results, name, directives, cluster, code,
                                           message):
    rc, requeue, lua_message = lua_results[name]
    _, python_message = python_verdict(directives, cluster)
    expected_rc = {0: 0, 5: -1, 6: 2002}[code]
    assert (rc, lua_message) == (expected_rc, python_message)
    if code == 0 and "geo-ckpt-dir" in directives:
        assert requeue == "1"  # jobs with checkpoints get --requeue by default
    elif code == 0:
        assert requeue == "65534"


def test_lua_reads_rest_jobs_environment(tmp_path):
    """Jobs from slurmrestd carry SLURM_GEO_* in their environment instead."""
    if LUA is None:
        pytest.skip("no Lua interpreter (apt-get install lua5.1)")
    (tmp_path / "c").mkdir()
    for name, text in export_files(RULES, "rented", "test").items():
        (tmp_path / "c" / name).write_text(text)
    harness = HARNESS.replace("local job = {spank_job_env = case.env, requeue = 65534}",
                              "local job = {script = '#!/bin/sh', environment = case.env, "
                              "requeue = 65534}")
    (tmp_path / "c" / "harness.lua").write_text(harness)
    cases = tmp_path / "c" / "cases.lua"
    cases.write_text('return {{id = "a", env = {SLURM_GEO_CKPT_DIR = "/x", '
                     'SLURM_GEO_COST_CENTER = "ml", SLURM_GEO_RESIDENCY = "home"}}, '
                     '{id = "b", env = {PATH = "/bin"}}}\n')
    out = subprocess.run([LUA, str(tmp_path / "c" / "harness.lua"), str(tmp_path / "c"),
                          str(cases)], capture_output=True, text=True, check=True).stdout
    lines = [line.split("\t") for line in out.splitlines()]
    assert lines[0][1:] == ["2002", "65534", "geo: cluster 'rented' is in region 'remote', "
                            "outside the job's residency (home)"]
    assert lines[1][1:] == ["0", "65534", ""]


# --- parsing and the places directives travel ---------------------------------------------

def test_arguments_environment_round_trip():
    directives = parse_arguments(["--geo-ckpt-dir=/p q/x", "--geo-residency=home,remote",
                                  "--geo-max-cost=12.5", "--geo-ckpt-interval=30"])
    assert directives == Directives(ckpt_dir="/p q/x", residency=("home", "remote"),
                                    max_cost_usd=12.5, ckpt_interval_min=30)
    env = to_environment(directives)
    assert env["SLURM_GEO_CKPT_DIR"] == "/p q/x"
    assert env["SLURM_GEO_MAX_COST"] == "12.5"
    assert from_environment(env, "SLURM_GEO_") == directives
    spank = {k.replace("SLURM_GEO_", "SPANK_GEO_"): v for k, v in env.items()}
    assert from_environment(spank, "SPANK_GEO_") == directives


@pytest.mark.parametrize(("argv", "message"), [
    (["--geo-colour=blue"], "geo: unknown option --geo-colour (known: "
                            "--geo-ckpt-dir"),
    (["geo-ckpt-dir=/x"], "geo: cannot read 'geo-ckpt-dir=/x'; expected --geo-NAME=VALUE"),
    (["--geo-ckpt-dir"], "expected --geo-NAME=VALUE"),
])
def test_unreadable_arguments(argv, message):
    with pytest.raises(DirectiveError) as caught:
        parse_arguments(argv)
    assert message in str(caught.value)


def test_values_come_back_as_a_user_would_write_them():
    """Paths normalised; every decimal of an amount kept, none invented."""
    directives = parse_arguments(["--geo-ckpt-dir=//pfs/./ckpt//run1/",
                                  "--geo-max-cost=0.001"])
    assert directives.ckpt_dir == "/pfs/ckpt/run1"
    assert directives.as_options() == {"geo-ckpt-dir": "/pfs/ckpt/run1",
                                       "geo-max-cost": "0.001"}
    assert parse_options({"geo-max-cost": "123456.789012"}).as_options() == \
        {"geo-max-cost": "123456.789012"}
    assert parse_options({"geo-max-cost": "250"}).as_options() == {"geo-max-cost": "250"}


@pytest.mark.parametrize("directives", [{}, OK])
def test_an_unknown_cluster_is_refused_with_or_without_directives(directives):
    with pytest.raises(DirectiveError) as caught:
        check(parse_options(directives), RULES, "mars")
    assert str(caught.value) == "geo: cluster 'mars' is not in the slurm-geo config " \
                                "(known: onprem, rented)"


def test_effective_residency_defaults_to_the_data_class():
    assert effective_residency(Directives(data_class="restricted"), RULES) == ("home",)
    assert effective_residency(Directives(), RULES) == ("home", "remote")
    assert effective_residency(Directives(residency=("remote",)), RULES) == ("remote",)


def test_exit_codes_are_stable():
    assert DirectiveError.exit_code == 5
    assert PolicyViolation.exit_code == 6


# --- the [policy] table -----------------------------------------------------------------------

@pytest.mark.parametrize(("table", "message"), [
    ({"colour": 1}, "[policy]: unknown key(s) colour; allowed: budgets, data_classes"),
    ({"require_cost_center": "yes"}, "require_cost_center must be true or false"),
    ({"default_data_class": "secret"}, "default_data_class must be one of public, internal"),
    ({"signal_lead_s": 5}, "signal_lead_s must be a whole number from 10 to 3600"),
    ({"max_restarts": -1}, "max_restarts must be a whole number from 0 to 1000"),
    ({"data_classes": {"secret": ["home"]}}, "[policy].data_classes: key must be one of"),
    ({"data_classes": {"restricted": "home"}}, "restricted must be a list of regions"),
    ({"data_classes": {"restricted": ["mars"]}}, "restricted names unknown region(s) mars "
                                                 "(regions of [clusters]: home, remote)"),
    ({"budgets": {"ml": 0}}, "[policy].budgets: ml must be a number of USD > 0"),
    ({"budgets": []}, "[policy].budgets must be a table of cost center = USD"),
])
def test_policy_table_mistakes(table, message):
    with pytest.raises(ConfigError) as caught:
        parse_policy(table, REGIONS, "[policy]")
    assert message in str(caught.value)


def test_policy_defaults():
    policy = parse_policy({}, REGIONS, "[policy]")
    assert policy == GeoPolicy()
    assert (policy.signal_lead_s, policy.max_restarts, policy.require_cost_center) == \
        (120, 10, False)


def test_lua_strings_escape_what_lua_needs():
    assert lua_string('a"b\\c\nd') == '"a\\"b\\\\c\\010d"'


def test_policy_lua_is_valid_lua(tmp_path):
    if LUA is None:
        pytest.skip("no Lua interpreter (apt-get install lua5.1)")
    path = tmp_path / "geo_policy.lua"
    path.write_text(policy_lua(RULES, "onprem", 'a "quoted" source'))
    out = subprocess.run(
        [LUA, "-e", f"p = dofile({lua_string(str(path))}) print(p.cluster, p.budgets.ops, "
                    "p.data_classes.restricted[1], #p.regions, p.signal_lead_s)"],
        capture_output=True, text=True, check=True).stdout
    assert out.split() == ["onprem", "99.5", "home", "2", "60"]


def test_export_refuses_unknown_cluster():
    with pytest.raises(ConfigError, match="cluster 'mars' is not in test"):
        export_files(RULES, "mars", "test")
