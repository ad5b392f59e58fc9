"""Issue 28, 4: the federation daemon reads a pending job's directives from the
SLURM_SPANK_GEO_<NAME> variables sbatch copies from the SPANK plugin's hand-over, so
job_submit.lua rejects a batch job whose environment carries one the plugin did not hand
over (a user's own export, or a client that skips the plugin). Run through the shipped
job_submit.lua with a stand-in `slurm` table."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from slurm_geo.policy.lua import export_files, lua_string
from tests.kit.policy import RULES

LUA = shutil.which("lua5.1") or shutil.which("lua")
HARNESS = """
slurm = {SUCCESS = 0, ERROR = -1, ESLURM_ACCESS_DENIED = 2002}
function slurm.log_info(...) end
local message = ""
function slurm.log_user(fmt, ...) message = string.format(fmt, ...) end
dofile(arg[1] .. "/job_submit.lua")
for _, case in ipairs(dofile(arg[2])) do
  message = ""
  local job = {spank_job_env = case.spank, environment = case.env, script = case.script,
               requeue = 65534}
  io.write(case.id, "\\t", slurm_job_submit(job, {}, 0), "\\t", message, "\\n")
end
"""
HANDED = {"GEO_CKPT_DIR": "/pfs/ckpt/run1", "GEO_COST_CENTER": "ml"}
COPIED = {f"SLURM_SPANK_{k}": v for k, v in HANDED.items()}  # as sbatch copies them
FORGED = "geo: {} is in the job's environment but the SPANK plugin did not set it; unset " \
         "it (a job started from a geo job inherits it) and ask with #SBATCH --{}"

# id, the plugin's hand-over (spank_job_env), the job's environment, batch?, rc, message
CASES = [
    ("the plugin's own, copied by sbatch", HANDED, COPIED, True, 0, ""),
    ("no directives anywhere", {}, {"PATH": "/bin"}, True, 0, ""),
    ("exported by the user, no plugin", {}, {"SLURM_SPANK_GEO_FAILOVER": "auto"}, True, -1,
     FORGED.format("SLURM_SPANK_GEO_FAILOVER", "geo-failover")),
    ("one more beside the plugin's", HANDED,
     {**COPIED, "SLURM_SPANK_GEO_CLUSTERS": "onprem,rented"}, True, -1,
     FORGED.format("SLURM_SPANK_GEO_CLUSTERS", "geo-clusters")),
    ("another value than the plugin's", HANDED,
     {**COPIED, "SLURM_SPANK_GEO_COST_CENTER": "ops"}, True, -1,
     FORGED.format("SLURM_SPANK_GEO_COST_CENTER", "geo-cost-center")),
    ("through slurmrestd (no plugin)", {}, {"SLURM_SPANK_GEO_RESIDENCY": "home,remote"},
     True, -1, FORGED.format("SLURM_SPANK_GEO_RESIDENCY", "geo-residency")),
    ("not a batch job: no stored environment", {}, {"SLURM_SPANK_GEO_FAILOVER": "auto"},
     False, 0, ""),
]


def lua_table(entries: dict[str, str], as_list: bool) -> str:
    if as_list:
        return "{" + ", ".join(lua_string(f"{k}={v}") for k, v in entries.items()) + "}"
    return "{" + ", ".join(f"[{lua_string(k)}] = {lua_string(v)}"
                           for k, v in entries.items()) + "}"


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory) -> dict[str, tuple[int, str]]:
    if LUA is None:
        pytest.skip("no Lua interpreter (apt-get install lua5.1)")
    directory = tmp_path_factory.mktemp("lua")
    for name, text in export_files(RULES, "onprem", "test").items():
        (directory / name).write_text(text)
    rows = [f"{{id = {lua_string(case_id)}, spank = {lua_table(spank, True)}, "
            f"env = {lua_table(env, False)}, "
            f"script = {lua_string('#!/bin/sh') if batch else 'nil'}}}"
            for case_id, spank, env, batch, _, _ in CASES]
    (directory / "cases.lua").write_text("return {\n" + ",\n".join(rows) + "\n}\n")
    (directory / "harness.lua").write_text(HARNESS)
    out = subprocess.run([LUA, str(directory / "harness.lua"), str(directory),
                          str(directory / "cases.lua")], capture_output=True, text=True,
                         check=True).stdout
    return {line.split("\t")[0]: (int(line.split("\t")[1]), line.split("\t")[2])
            for line in out.splitlines()}


@pytest.mark.parametrize("case_id, spank, env, batch, rc, message", CASES,
                         ids=[case[0] for case in CASES])
def test_a_spank_variable_the_plugin_did_not_hand_over_is_rejected(
        verdicts, case_id, spank, env, batch, rc, message):
    assert verdicts[case_id] == (rc, message)
