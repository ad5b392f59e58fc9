"""The command line: help everywhere, no heavy imports at start, no tracebacks for mistakes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "boto3", "botocore", "requests", "slurm_geo.slurm")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slurm_geo", *args], capture_output=True,
                          text=True, timeout=60, check=False)


@pytest.mark.parametrize("args", [
    [], ["sandbox"], ["sandbox", "up"], ["sandbox", "down"], ["sandbox", "status"],
    ["sandbox", "env"], ["sandbox", "demo"],
])
def test_every_command_has_help(args):
    result = run(*args, "--help")
    assert result.returncode == 0
    assert "Usage:" in result.stdout


def test_help_imports_nothing_heavy():
    code = ("import sys; sys.argv = ['slurm-geo', '--help']\n"
            "from slurm_geo.cli import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            f"print(sorted(m for m in sys.modules if m.startswith({HEAVY!r})))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, check=True)
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_the_packages_import_their_names_when_first_used():
    """`import slurm_geo.ckpt` (or config) loads none of its modules, numpy least of all;
    every name the package offers still resolves, to the module that defines it."""
    code = ("import sys, importlib\n"
            "import slurm_geo.ckpt, slurm_geo.config\n"
            "print(sorted(m for m in sys.modules if m.startswith(('numpy', 'slurm_geo.ckpt.', "
            "'slurm_geo.config.model'))))\n"
            "for package in (slurm_geo.ckpt, slurm_geo.config):\n"
            "    homes = {name: importlib.import_module(package.__name__ + '.' + module)\n"
            "             for name, module in package._HOMES.items()}\n"
            "    for name in package.__all__:\n"  # after the imports: no module in its place
            "        assert getattr(package, name) is getattr(homes[name], name), name\n"
            "print('resolved')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, check=True)
    assert result.stdout.splitlines() == ["[]", "resolved"]


def test_an_unknown_name_of_a_lazy_package_is_an_attribute_error():
    import slurm_geo.ckpt

    with pytest.raises(AttributeError, match="has no attribute 'Nonesuch'"):
        slurm_geo.ckpt.Nonesuch  # noqa: B018


@pytest.mark.parametrize("preset, expected", [(None, "1"), ("3", "3")])
def test_the_cli_keeps_openblas_to_one_thread_unless_told(preset, expected):
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if preset is not None:
        env["OPENBLAS_NUM_THREADS"] = preset
    code = ("import os, sys; sys.argv = ['slurm-geo', '--version']\n"
            "from slurm_geo.cli import main\n"
            "main()\n"
            "print(os.environ.get('OPENBLAS_NUM_THREADS'))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, check=True, env=env)
    assert result.stdout.strip().splitlines()[-1] == expected


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc")
@pytest.mark.parametrize("keep, most_faults", [(True, 1000), (False, None)])
def test_the_cli_reuses_the_big_buffers_it_frees(keep, most_faults):
    """Four buffers of 16 MiB (a pull's packs) filled and freed, eight times: with
    keep_freed_memory the heap hands the same pages back (no page faults); without, glibc
    returns most of them to the kernel and faults them in anew."""
    code = ("import resource, sys\n"
            "from slurm_geo.cli import keep_freed_memory\n"
            f"if {keep}: keep_freed_memory()\n"
            "def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
            "def fill(): return [bytearray(b'1') * (16 << 20) for _ in range(4)]\n"
            "buffers = fill(); del buffers\n"
            "before = faults()\n"
            "for _ in range(8):\n"
            "    buffers = fill(); del buffers\n"
            "print(faults() - before)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, check=True)
    faults = int(result.stdout.strip())
    if most_faults is None:
        if "[always]" in _transparent_huge_pages():
            pytest.skip("huge pages for all memory: a few faults map 2 MiB each")
        assert faults > 8 * (32 << 20) // 4096  # the control: half of it at least, anew
    else:
        assert faults < most_faults


def _transparent_huge_pages() -> str:
    try:
        return Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return ""


def test_unknown_sandbox_cluster_is_one_line_without_traceback(tmp_path):
    (tmp_path / "rented").mkdir()
    result = run("sandbox", "env", "--dir", str(tmp_path), "elsewhere")
    assert result.returncode == 3  # an unknown cluster is CONFIG in every command
    assert result.stderr.strip() == (
        "slurm-geo: error: cluster 'elsewhere' is not a sandbox cluster (known clusters: "
        "onprem, rented)")


@pytest.mark.root(reason="runs as other users or in namespaces (failed as nobody)")
def test_env_before_up_says_to_run_up(tmp_path):
    result = run("sandbox", "env", "--dir", str(tmp_path), "rented")
    assert result.returncode == 4
    assert "run `slurm-geo sandbox up`" in result.stderr
    assert "Traceback" not in result.stderr


def test_unknown_command_is_a_usage_error():
    result = run("teleport")
    assert result.returncode == 2
    assert "No such command 'teleport'" in result.stderr


@pytest.mark.parametrize("args", [
    ["sandbox", "down"], ["sandbox", "status"], ["sandbox", "env", "onprem"],
    ["sandbox", "demo"], ["sandbox", "wan"], ["sandbox", "exec", "home", "--", "true"],
    ["drill"], ["drill", "--sandbox-dir"],  # the old spelling, kept hidden for scripts
])
def test_sandbox_commands_refuse_a_directory_that_does_not_exist(tmp_path, monkeypatch, capsys,
                                                                 args):
    """Only `sandbox up` makes its directory; the others never create one left empty."""
    from slurm_geo.cli import main

    missing = tmp_path / "no-such-sandbox"
    option = [] if args[-1] == "--sandbox-dir" else ["--dir"]
    argv = [*args[:2], *option, str(missing), *args[2:]] if args[0] == "sandbox" else \
        [*args, *option, str(missing)]
    monkeypatch.setattr(sys, "argv", ["slurm-geo", *argv])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 4
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.endswith(f"there is no sandbox in {missing} (no such directory); bring one up "
                        f"with `slurm-geo sandbox up --dir {missing}`, or name it with --dir\n")
    assert not missing.exists()


def test_drill_spells_its_directory_dir():
    out = run("drill", "--help").stdout
    assert "--dir PATH" in out and "--sandbox-dir" not in out
