"""Reading a script's #SBATCH block as sbatch does, and building the resubmission (as its
owner, with the four parts of its environment), table-driven."""

from __future__ import annotations

import pathlib

import pytest

from slurm_geo.federation.act.resubmit import (
    ENV_GENERATION,
    ENV_KEY_TOKEN,
    ENV_RESUME_STEP,
    Incoming,
    ScriptOptions,
    fitted,
    needs_preamble,
    resubmission,
    script_options,
    wrapped_script,
)
from slurm_geo.policy.directives import DirectiveError
from slurm_geo.slurm.models import Owner

VALIDATED = {"geo-ckpt-dir": "/pfs/ckpt", "geo-failover": "auto",
             "geo-clusters": "onprem,rented"}
ALICE = Owner("alice", 2001, 2100)

SCRIPT = """#!/bin/bash
# a comment line is not the end of the block
#SBATCH --job-name="train llm"
#SBATCH -t 1-02:30:00
#SBATCH --nodes=2 --cpus-per-task 4
#SBATCH --partition=gpu
#SBATCH --output=/data/%x-%j.out
#SBATCH --gres=gpu:a100:4
#SBATCH --geo-ckpt-dir=/pfs/ckpt
#SBATCH --geo-failover=auto
#SBATCH --geo-clusters=onprem,rented
python train.py
#SBATCH --time=5
"""


def test_the_sbatch_block_is_read_until_the_first_command():
    options = script_options(SCRIPT)
    assert options.name == "train llm"
    assert options.time_limit_minutes == 1590
    assert (options.nodes, options.cpus_per_task, options.gpus) == (2, 4, 8)
    assert options.partition == "gpu"
    assert options.output == "/data/%x-%j.out"
    assert options.geo == ()  # never from the script: Slurm's validated ones count
    validated = options.with_directives(VALIDATED)
    assert validated.geo == ("--geo-ckpt-dir=/pfs/ckpt", "--geo-clusters=onprem,rented",
                             "--geo-failover=auto")
    assert validated.directives().clusters == ("onprem", "rented")


def test_an_indented_sbatch_line_is_a_comment_as_for_sbatch():
    options = script_options("#!/bin/bash\n#SBATCH --time=30\n  #SBATCH --nodes=4\n"
                             "\t#SBATCH --geo-failover=auto\n#SBATCH --partition=gpu\n"
                             "true\n")
    assert (options.time_limit_minutes, options.nodes, options.partition) == (30, 1, "gpu")
    assert options.geo == () and options.directives().failover is None


@pytest.mark.parametrize("time, minutes", [
    ("30", 30), ("30:01", 31), ("1:00:00", 60), ("2-0", 2880), ("1-1:1", 1501),
    ("0:30", 1)])
def test_time_limits(time, minutes):
    assert script_options(f"#!/bin/bash\n#SBATCH --time={time}\n").time_limit_minutes == minutes


@pytest.mark.parametrize("line, gpus", [
    ("--gpus=3", 3), ("--gpus-per-node=2 --nodes=3", 6), ("--gres=gpu:2", 2),
    ("--gres=gpu:h100:1,shard:2", 1), ("--gres=gpu", 1), ("", 0)])
def test_gpu_counts(line, gpus):
    assert script_options(f"#!/bin/bash\n#SBATCH {line}\ntrue\n").gpus == gpus


def test_bad_directives_are_refused_not_carried():
    options = ScriptOptions().with_directives({"geo-failover": "sometimes"})
    with pytest.raises(DirectiveError, match="sometimes"):
        options.directives()


def test_options_survive_json():
    options = script_options(SCRIPT).with_directives(VALIDATED)
    assert ScriptOptions.from_json(options.to_json()) == options


def test_the_resubmission_carries_script_directives_and_resume_pointer():
    incoming = Incoming("onprem-9", 2, "run-a", 120, "http://fed:9852", "tok", "s3://b/c",
                        "http://s3:9000")
    spec = resubmission(SCRIPT, script_options(SCRIPT).with_directives(VALIDATED), incoming,
                        ("batch",), owner=ALICE, store_env={"AWS_ACCESS_KEY_ID": "scoped"})
    assert spec.script == SCRIPT
    assert spec.owner == ALICE
    assert spec.partition is None  # rented has no "gpu" partition: its default takes it
    assert (spec.nodes, spec.cpus_per_task, spec.time_limit_minutes) == (2, 4, 1590)
    assert spec.requeue is True
    env = spec.environment
    assert env[ENV_GENERATION] == "2" and env[ENV_RESUME_STEP] == "120"
    assert env[ENV_KEY_TOKEN] == "tok" and env["AWS_ACCESS_KEY_ID"] == "scoped"
    assert env["SLURM_GEO_FAILOVER"] == "auto"
    assert env["SLURM_GEO_CLUSTERS"] == "onprem,rented"


@pytest.mark.parametrize("chdir, submit_dir, at_home, runs_in", [
    (None, "/home/a/w", True, "/home/a/w"),   # a restart at home: where she ran sbatch
    (None, "/home/a/w", False, "/tmp"),       # elsewhere that filesystem may not exist
    (None, None, True, "/tmp"),               # registered before it was recorded
    ("/c", "/home/a/w", True, "/c"),          # her --chdir, everywhere
    ("/c", "/home/a/w", False, "/c"),
])
def test_where_a_resubmission_runs(chdir, submit_dir, at_home, runs_in):
    incoming = Incoming("onprem-9", 1, "run-a", 10, "http://fed:9852", "tok", "s3://b/c")
    options = ScriptOptions(working_dir=chdir, submit_dir=submit_dir)
    spec = resubmission("#!/bin/bash\npython train.py\n", options, incoming, ("batch",),
                        owner=ALICE, at_home=at_home)
    assert str(spec.working_dir) == runs_in


@pytest.mark.parametrize("chdir, output, own_dir, runs_in, writes_to", [
    # a cluster with none of home's files: the account's own directory, outputs by name
    ("/c", "/home/a/w/%x-%j.out", "/home/geo-a", "/home/geo-a", "%x-%j.out"),
    (None, "logs/train.out", "/scratch/geo-a", "/scratch/geo-a", "train.out"),
    (None, None, "/home/geo-a", "/home/geo-a", None),
    # one that shares home's filesystem: as submitted
    ("/c", "/home/a/w/%x-%j.out", None, "/c", "/home/a/w/%x-%j.out"),
    (None, "logs/train.out", None, "/tmp", "logs/train.out"),
])
def test_a_cluster_without_homes_files_runs_the_job_in_the_accounts_directory(
        chdir, output, own_dir, runs_in, writes_to):
    incoming = Incoming("onprem-9", 1, "run-a", 10, "http://fed:9852", "tok", "s3://b/c")
    options = ScriptOptions(working_dir=chdir, submit_dir="/home/a/w", output=output)
    spec = resubmission("#!/bin/bash\npython train.py\n", options, incoming, ("batch",),
                        owner=ALICE, own_dir=own_dir)
    assert (str(spec.working_dir), spec.output) == (runs_in, writes_to)


def test_the_environment_is_the_owners_then_the_stores_then_the_directives_then_incoming():
    incoming = Incoming("onprem-9", 2, "run-a", 120, "http://fed:9852", "tok", "s3://b/c")
    spec = resubmission(
        SCRIPT, ScriptOptions().with_directives({"geo-failover": "manual"}), incoming, (),
        owner=ALICE, owner_env={"PATH": "/home/alice/bin", "SLURM_GEO_FAILOVER": "never",
                                "AWS_ACCESS_KEY_ID": "alices", ENV_GENERATION: "0"},
        store_env={"AWS_ACCESS_KEY_ID": "scoped"})
    env = spec.environment
    assert (env["PATH"], env["AWS_ACCESS_KEY_ID"], env["SLURM_GEO_FAILOVER"],
            env[ENV_GENERATION]) == ("/home/alice/bin", "scoped", "manual", "2")


def test_a_run_without_checkpoint_resumes_from_nothing():
    incoming = Incoming("onprem-9", 1, "run-a", None, "u", "t", "file:///x")
    spec = resubmission("#!/bin/bash\ntrue\n", ScriptOptions(), incoming, ())
    assert spec.environment[ENV_RESUME_STEP] == ""
    assert spec.name == "onprem-9"


def test_a_node_range_and_tasks_per_node_are_carried_over():
    options = script_options("#!/bin/bash\n#SBATCH --nodes=1-2 --ntasks-per-node=2\nsrun x\n")
    assert (options.nodes, options.max_nodes, options.tasks_per_node) == (1, 2, 2)
    assert ScriptOptions.from_json(options.to_json()) == options
    plain = script_options("#!/bin/bash\n#SBATCH -N 3\n")
    assert (plain.nodes, plain.max_nodes, plain.tasks_per_node) == (3, None, None)


@pytest.mark.parametrize("asked, up, nodes", [
    ("--nodes=1-2", 1, 1), ("--nodes=1-2", 2, 2), ("--nodes=1-2", 5, 2),
    ("--nodes=2-4", 1, 2), ("--nodes=1-2", None, 2), ("--nodes=3", 1, 3)])
def test_a_node_range_is_fitted_to_the_nodes_up_where_the_job_moves(asked, up, nodes):
    options = fitted(script_options(f"#!/bin/bash\n#SBATCH {asked}\n"), up)
    assert (options.nodes, options.max_nodes) == (nodes, None)


# A moved job's world (issue 31 item 3): the preamble runs first where home's files are not.

WORLD = {**VALIDATED, "geo-inputs": "/pfs/data/tokens", "geo-env": "/home/alice/venv"}


@pytest.mark.parametrize("directives, own_dir, wrapped", [
    (WORLD, "/home/geo-alice", True),        # a world, a cluster with none of home's files
    ({**VALIDATED, "geo-outputs": "/pfs/out"}, "/home/geo-alice", True),  # outputs alone
    (VALIDATED, "/home/geo-alice", False),   # no world declared: the script as it is
    (WORLD, None, False),                    # home's filesystem is there: as it is
])
def test_a_job_with_a_world_runs_the_preamble_where_homes_files_are_not(
        directives, own_dir, wrapped):
    incoming = Incoming("onprem-9", 1, "run-a", 10, "http://fed:9852", "tok", "s3://b/c")
    options = script_options(SCRIPT).with_directives(directives)
    spec = resubmission(SCRIPT, options, incoming, ("gpu",), owner=ALICE, own_dir=own_dir)
    assert needs_preamble(options, own_dir) is wrapped
    assert (spec.script == wrapped_script(SCRIPT)) is wrapped
    assert (spec.script == SCRIPT) is not wrapped
    assert spec.environment["SLURM_GEO_INPUTS" if "geo-inputs" in directives
                            else ENV_GENERATION]  # the directives travel either way


@pytest.mark.parametrize("directives, python, expected", [
    (WORLD, "/opt/geo/bin/python3", "/opt/geo/bin/python3"),  # the cluster's `python`
    (WORLD, None, None),              # none configured: the wrapper's python3 on PATH
    (VALIDATED, "/opt/geo/bin/python3", None),  # no preamble: not set
])
def test_the_preamble_runs_the_python_the_cluster_names(directives, python, expected):
    incoming = Incoming("onprem-9", 1, "run-a", 10, "http://fed:9852", "tok", "s3://b/c")
    options = script_options(SCRIPT).with_directives(directives)
    spec = resubmission(SCRIPT, options, incoming, ("gpu",), owner=ALICE,
                        own_dir="/home/geo-alice", preamble_python=python)
    assert spec.environment.get("SLURM_GEO_PYTHON") == expected


def test_a_clusters_python_is_an_absolute_path():
    from slurm_geo.config.tables import parse_cluster
    from slurm_geo.errors import ConfigError

    table = {"region": "eu", "access": "cli", "slurm_conf": "/etc/slurm/slurm.conf"}
    assert parse_cluster("rented", {**table, "python": "/opt/geo/bin/python3"},
                         "[clusters.rented]").python == pathlib.Path("/opt/geo/bin/python3")
    assert parse_cluster("rented", table, "[clusters.rented]").python is None
    with pytest.raises(ConfigError, match="python must be an absolute path"):
        parse_cluster("rented", {**table, "python": "python3"}, "[clusters.rented]")


@pytest.mark.parametrize("script", [
    SCRIPT,
    "#!/bin/bash\necho 'SLURM_GEO_JOB_SCRIPT'\nexit 0",  # the heredoc's end, no newline
    "#!/usr/bin/env python3\nprint('caf\u00e9 \\u2603')\n" + "x" * 300_000 + "\n",
])
def test_the_wrapper_hands_the_preamble_the_scripts_exact_text(tmp_path, script):
    """Run the wrapper with bash, a stand-in for the preamble's Python recording what it
    is given: the module, the option, and the script on stdin (base64)."""
    import base64
    import subprocess

    stand_in = tmp_path / "python"
    stand_in.write_text(f'#!/bin/bash\necho "$@" > {tmp_path}/argv\ncat > {tmp_path}/stdin\n')
    stand_in.chmod(0o755)
    wrapper = tmp_path / "job.sh"
    wrapper.write_text(wrapped_script(script))
    done = subprocess.run(["bash", str(wrapper)], env={"SLURM_GEO_PYTHON": str(stand_in)},
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "argv").read_text() == "-m slurm_geo.stage.run --script-base64-stdin\n"
    assert base64.b64decode((tmp_path / "stdin").read_bytes()).decode() == script
    assert wrapped_script(script).startswith("#!/bin/bash\n")
