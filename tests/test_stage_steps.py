"""A moved job's world on every node, the pure decisions (issue 31 item 3; stage.srunargs,
stage.srunshim, stage.task, stage.steps): where srun's command starts, the command line
the preamble's srun runs, the environment and directory a task gets, the world step's
command line and its sealed keys. No I/O but the sealed keys' crypto."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from slurm_geo.ckpt.format.keys import RunKeyRing
from slurm_geo.lease.protocol import ENV_LEASE_SECRET, KeyReply
from slurm_geo.stage import srunargs
from slurm_geo.stage.node import Choice
from slurm_geo.stage.present import Presentation, Root
from slurm_geo.stage.srunargs import SrunArgsError, parse, wrapped
from slurm_geo.stage.srunshim import rewritten, step_cwd
from slurm_geo.stage.steps import (
    StepWorldError,
    node_job,
    open_node_keys,
    ready_nodes,
    seal_node_keys,
    shim_text,
    world_step_argv,
)
from slurm_geo.stage.task import task_cwd, task_environment, task_path

W = ["W"]  # a wrapper, as the shim's task command would be


@pytest.mark.parametrize(("argv", "options", "command"), [
    (["hostname"], [], ["hostname"]),
    (["-N2", "-n4", "python", "train.py", "-n", "3"], ["-N2", "-n4"],
     ["python", "train.py", "-n", "3"]),
    (["-N", "2", "--ntasks", "4", "python"], ["-N", "2", "--ntasks", "4"], ["python"]),
    (["--ntasks=4", "--label", "bash", "-c", "x"], ["--ntasks=4", "--label"],
     ["bash", "-c", "x"]),
    (["-ln", "4", "cmd"], ["-ln", "4"], ["cmd"]),  # a flag, then a valued letter
    (["-lun4", "cmd"], ["-lun4"], ["cmd"]),
    (["-K", "cmd"], ["-K"], ["cmd"]),  # an optional value never takes the next word
    (["-K1", "--overlap", "cmd"], ["-K1", "--overlap"], ["cmd"]),
    (["--kill-on-bad-exit", "1"], ["--kill-on-bad-exit"], ["1"]),
    (["--exclusive", "cmd"], ["--exclusive"], ["cmd"]),
    (["--exclusive=user", "cmd"], ["--exclusive=user"], ["cmd"]),
    (["--mpi", "pmix", "--gpus-per-task", "1", "torchrun", "--nnodes", "2"],
     ["--mpi", "pmix", "--gpus-per-task", "1"], ["torchrun", "--nnodes", "2"]),
    (["--cpu-bind", "cores", "-m", "block", "a.out"],
     ["--cpu-bind", "cores", "-m", "block"], ["a.out"]),
    (["--ntasks-per-n", "2", "cmd"], ["--ntasks-per-n", "2"], ["cmd"]),  # a prefix
    (["--nodel", "n1", "cmd"], ["--nodel", "n1"], ["cmd"]),  # nodelist
    (["-N2", "--", "-weird-name", "x"], ["-N2", "--"], ["-weird-name", "x"]),
    (["-"], [], ["-"]),
    (["--version"], ["--version"], []),
    (["--export", "ALL,X=1", "--chdir", "/w", "./run.sh"],
     ["--export", "ALL,X=1", "--chdir", "/w"], ["./run.sh"]),
    (["--pty", "bash"], ["--pty"], ["bash"]),
])
def test_the_command_starts_after_srun_s_options(argv: list[str], options: list[str],
                                                 command: list[str]) -> None:
    [part] = parse(argv)
    assert list(part.options) == options
    assert list(part.command) == command


@pytest.mark.parametrize(("argv", "expected"), [
    (["-n2", "hostname"], ["-n2", "W", "hostname"]),
    (["--version"], ["--version"]),
    (["-n1", "a", ":", "-n2", "b", "x"], ["-n1", "W", "a", ":", "-n2", "W", "b", "x"]),
    (["-n1", ":", "-n2", "b"], ["-n1", ":", "-n2", "W", "b"]),  # the first takes b's
    (["--multi-prog", "conf"], ["--multi-prog", "conf"]),  # rewritten by the shim
])
def test_each_component_s_command_is_wrapped(argv: list[str], expected: list[str]) -> None:
    assert wrapped(argv, W) == expected


@pytest.mark.parametrize(("argv", "says"), [
    (["--no-such-option", "x"], "'--no-such-option' is not one srun knows"),
    (["--ntask", "2", "x"], "'--ntask' is ambiguous"),  # as getopt_long says
    (["-j", "x"], "'-j' (in '-j') is not one srun knows"),
    (["--ntasks"], "'--ntasks' needs a value"),
    (["-n"], "'-n' needs a value"),
    (["--label=yes", "x"], "'--label' takes no value"),
])
def test_an_option_srun_does_not_know_is_refused_in_one_line(argv: list[str],
                                                             says: str) -> None:
    with pytest.raises(SrunArgsError) as caught:
        parse(argv)
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_the_tables_hold_each_option_once_and_the_short_letters_once() -> None:
    assert not srunargs.LONG_WITH_VALUE & srunargs.LONG_OPTIONAL
    assert not srunargs.LONG_WITH_VALUE & srunargs.LONG_FLAGS
    assert not srunargs.LONG_OPTIONAL & srunargs.LONG_FLAGS
    shorts = [srunargs.SHORT_WITH_VALUE, srunargs.SHORT_OPTIONAL, srunargs.SHORT_FLAGS]
    assert sum(len(s) for s in shorts) == len(set().union(*shorts))
    for common in ("ntasks", "nodes", "gpus-per-task", "cpus-per-task", "mpi", "export",
                   "chdir", "nodelist", "distribution", "cpu-bind", "gres", "het-group"):
        assert common in srunargs.LONG_WITH_VALUE


def test_a_multi_prog_configuration_gets_the_wrapper_on_each_program_line() -> None:
    text = "# ranks\n0 python a.py --rank %t\n1-3  ./b.sh \\\n  more\n\n*\techo hi\n"
    assert srunargs.multi_prog(text, ["/usr/bin/python3", "-m", "t", "--"]) == (
        "# ranks\n0 /usr/bin/python3 -m t -- python a.py --rank %t\n"
        "1-3 /usr/bin/python3 -m t -- ./b.sh \\\n  more\n\n"
        "* /usr/bin/python3 -m t -- echo hi\n")  # a tab is a blank too
    with pytest.raises(SrunArgsError):
        srunargs.multi_prog("0 a\n", ["/dir with 'quote'/python3"])


def test_the_shim_runs_each_task_through_stage_task_from_its_directory() -> None:
    words = rewritten(["-N2", "--chdir", "sub", "python", "x.py"], "/py", "/tmp", "/ws/bin",
                      "/home/alice/llm", "")
    assert words == ["--chdir=/", "-N2", "--chdir", "sub", "/py", "-m", "slurm_geo.stage.task",
                     "--base", "/tmp", "--shim-dir", "/ws/bin", "--cwd",
                     "/home/alice/llm/sub", "--", "python", "x.py"]
    mapped = rewritten(["hostname"], "/py", "/tmp", "/ws/bin", "/w/home/a", "/w")
    assert mapped[-4:] == ["--batch-root", "/w", "--", "hostname"]
    assert rewritten(["--version"], "/py", "/tmp", "/b", "/", "") == ["--chdir=/", "--version"]
    [part] = parse(["-D", "/abs", "x"])
    assert step_cwd(part, "/elsewhere") == "/abs"


def test_the_shim_rewrites_a_multi_prog_file_into_the_workspace(tmp_path: Path) -> None:
    (tmp_path / "conf").write_text("0-1 hostname\n")
    written: list[str] = []

    def write(text: str) -> Path:
        written.append(text)
        return tmp_path / "new.conf"
    words = rewritten(["-n2", "--multi-prog", "conf"], "/py", "/tmp", "/b", str(tmp_path),
                      "", write)
    assert words == ["--chdir=/", "-n2", "--multi-prog", str(tmp_path / "new.conf")]
    assert written[0].startswith("0-1 /py -m slurm_geo.stage.task --base /tmp ")
    assert written[0].rstrip().endswith("-- hostname")


def presentation(mode: str, world_dir: str = "/s/job-1.n2/world") -> Presentation:
    roots = (Root("input", "/pfs/data", Path(world_dir + "/pfs/data"), True),
             Root("env", "/home/a/venv", Path(world_dir + "/home/a/venv"), True),
             Root("workdir", "/home/a/llm", Path(world_dir + "/home/a/llm"), False))
    return Presentation(Choice(mode, "why"), roots, 1000, 1000, Path(world_dir),  # type: ignore[arg-type]
                        Path("/s/job-1.n2/root"))


def test_a_presentation_reads_back_as_written() -> None:
    shown = presentation("namespace")
    assert Presentation.from_json(shown.to_json()) == shown


@pytest.mark.parametrize(("mode", "given", "exists", "batch_root", "expected"), [
    ("namespace", "/home/a/llm/sub", False, None, "/home/a/llm/sub"),
    ("namespace", "/tmp", True, None, "/tmp"),
    ("namespace", "/nowhere", False, None, None),
    ("mapped", "/b/world/home/a/llm", False, "/b/world", "/s/job-1.n2/world/home/a/llm"),
    ("mapped", "/tmp", True, "/b/world", "/tmp"),
    ("mapped", "/home/a/llm", False, "/b/world", "/s/job-1.n2/world/home/a/llm"),
    ("namespace", None, False, None, None),
])
def test_a_task_starts_where_srun_was_run_in_its_own_world(
        mode: str, given: str | None, exists: bool, batch_root: str | None,
        expected: str | None) -> None:
    assert task_cwd(given, presentation(mode), batch_root, exists) == expected


def test_a_task_s_environment_drops_the_batch_step_s_world_and_srun() -> None:
    environ = {"PATH": "/ws/bin:/home/a/venv/bin:/usr/bin", "SLURM_GEO_WORLD_MODE": "mapped",
               "SLURM_GEO_WORLD_ROOT": "/b", "SLURM_GEO_INPUT_0": "/b/pfs/data",
               "SLURM_GEO_INPUTS": "1", "SLURM_GEO_ENV": "/b/home/a/venv",
               "SLURM_GEO_ENV_BIN": "/home/a/venv/bin", "VIRTUAL_ENV": "/b/home/a/venv",
               "SLURM_GEO_SCRIPT": "/x", "SLURM_GEO_RUN": "r", "SLURM_GEO_INPUTS_DIRECTIVE": "",
               "SLURM_JOB_ID": "1"}
    env = task_environment(environ, "/ws/bin")
    assert env["PATH"] == "/usr/bin"
    assert env["SLURM_GEO_RUN"] == "r" and env["SLURM_JOB_ID"] == "1"
    assert not {"SLURM_GEO_WORLD_MODE", "SLURM_GEO_INPUT_0", "SLURM_GEO_ENV_BIN",
                "SLURM_GEO_SCRIPT", "VIRTUAL_ENV"} & set(env)
    assert task_path("a::b:c", ["b"]) == "a:c"
    # What the task's own world then sets: its variables, its venv first.
    shown = presentation("namespace").variables(env["PATH"])
    assert shown["SLURM_GEO_INPUT_0"] == "/pfs/data"
    assert shown["PATH"] == "/home/a/venv/bin:/usr/bin"


def test_the_world_step_overlaps_the_job_s_steps_one_task_a_node() -> None:
    argv = world_step_argv("/usr/bin/srun", "/py", 3, Path("/tmp"), "n1", Path("/tmp/ws"))
    [part] = parse(argv[1:])
    assert dict(part.values)["nodes"] == "3" and dict(part.values)["ntasks"] == "3"
    assert "--overlap" in part.options and "--ntasks-per-node=1" in part.options
    assert list(part.command) == ["/py", "-m", "slurm_geo.stage.nodeworld", "--base", "/tmp",
                                  "--batch-node", "n1", "--batch-workspace", "/tmp/ws"]
    assert ready_nodes(["READY n1\n", "noise\n", "READY n2\n", "READY\n"]) == {"n1", "n2"}


def test_the_shim_is_a_shell_script_with_absolute_paths(tmp_path: Path) -> None:
    text = shim_text("/opt/py 3/bin/python3", "/usr/bin/srun", Path("/tmp"), tmp_path)
    assert text.startswith("#!/bin/sh\nexec '/opt/py 3/bin/python3' -m slurm_geo.stage.srunshim")
    assert text.rstrip().endswith('-- "$@"')
    script = tmp_path / "srun"
    script.write_text(text.replace("exec ", "printf '%s\\n' ", 1))
    said = subprocess.run(["sh", str(script), "-n", "2", "a b"], capture_output=True,
                          text=True, check=True).stdout.splitlines()
    assert said[0] == "/opt/py 3/bin/python3" and said[-3:] == ["-n", "2", "a b"]


def test_node_names_key_the_node_s_workspace() -> None:
    assert node_job("17", "onprem-n2") == "17.onprem-n2"
    for bad in ("", "../x", "a/b", ".hidden"):
        with pytest.raises(StepWorldError):
            node_job("17", bad)


def test_the_world_step_s_keys_open_for_this_job_and_restart_only() -> None:
    reply = KeyReply("run-1", RunKeyRing.of(os.urandom(32)))
    env = {ENV_LEASE_SECRET: os.urandom(32).hex(), "SLURM_JOB_ID": "17",
           "SLURM_RESTART_COUNT": "0"}
    sealed = seal_node_keys(reply, env)
    assert sealed is not None and "run-1" not in sealed
    assert open_node_keys(sealed, env).run == "run-1"
    for other in ({"SLURM_JOB_ID": "18"}, {"SLURM_RESTART_COUNT": "1"},
                  {ENV_LEASE_SECRET: os.urandom(32).hex()}):
        with pytest.raises(StepWorldError):
            open_node_keys(sealed, {**env, **other})
    assert seal_node_keys(reply, {**env, ENV_LEASE_SECRET: ""}) is None


def test_the_preamble_waits_for_every_node_and_ends_the_world_step_with_its_input() -> None:
    from slurm_geo.stage.steps import WorldStep

    # A stand-in for srun: each "node" says READY, then holds until its input ends.
    step = WorldStep(["sh", "-c", "echo noise; echo READY n1; echo READY n2; cat >/dev/null;"
                      " echo ended >&2; exit 0"], {"PATH": "/usr/bin:/bin"}, "sealed", 2)
    assert step.start() == {"n1", "n2"}
    assert step.stop() == 0
    failing = WorldStep(["sh", "-c", "echo READY n1; exit 21"], {"PATH": "/usr/bin:/bin"},
                        "sealed", 2)
    with pytest.raises(StepWorldError, match=r"1 of 2 ready, the world step ended with 21"):
        failing.start()
