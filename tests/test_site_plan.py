"""`slurm-geo site install`'s plan (slurm_geo.site.plan), table by table, and the install
itself into a temporary root from this checkout: idempotent, nothing written on a dry
run, one line and its exit code for what it cannot do. The same from a built wheel in a
fresh virtualenv: tests/test_site_install.py."""

from __future__ import annotations

import configparser
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path, PurePosixPath

import pytest

from slurm_geo.exitcodes import ExitCode
from slurm_geo.sandbox import render
from slurm_geo.sandbox.layout import SandboxLayout
from slurm_geo.site import HOOKS, UNITS, plan
from slurm_geo.site.install import Options, SiteInstallError, install
from slurm_geo.slurm.submit_as import SUBMIT_AS_PATH

REPO = Path(__file__).resolve().parents[1]
ITEM = plan.Item("hook", PurePosixPath("/x/prolog.py"), b"#!py\n", 0o755)
SETUID = plan.Item("submit-as", PurePosixPath("/x/submit-as"), b"ELF", 0o4750, 0, 990)


@pytest.mark.parametrize("item, present, expected", [
    (ITEM, None, "create"),
    (ITEM, plan.Present(b"#!py\n", 0o755, 0, 0), "unchanged"),
    (ITEM, plan.Present(b"#!py\n", 0o755, 1000, 1000), "unchanged"),  # no owner asked
    (ITEM, plan.Present(b"#!other\n", 0o755, 0, 0), "update"),
    (ITEM, plan.Present(b"#!py\n", 0o644, 0, 0), "update"),
    (ITEM, plan.Present(b"", -1, 0, 0), "update"),  # a link or directory in its place
    (SETUID, plan.Present(b"ELF", 0o4750, 0, 990), "unchanged"),
    (SETUID, plan.Present(b"ELF", 0o0750, 0, 990), "update"),  # lost its setuid bit
    (SETUID, plan.Present(b"ELF", 0o4750, 0, 0), "update"),  # another group
    (SETUID, plan.Present(b"ELF", 0o4750, 1000, 990), "update"),  # another owner
])
def test_action(item, present, expected):
    assert plan.action(item, present) == expected


@pytest.mark.parametrize("euid, root, gid, setuid", [
    (0, "/", 990, True),
    (0, "/", None, False),  # no service group on this host (a compute node)
    (0, "/srv/image", 990, False),  # a staging root
    (1000, "/", 990, False),  # not root
])
def test_the_helper_is_setuid_only_as_root_onto_the_running_system(euid, root, gid, setuid):
    assert plan.setuid_helper(euid, root, gid) is setuid


@pytest.mark.parametrize("source, expected", [
    ("#!/usr/bin/env python3\nimport sys\n", "#!/venv/bin/python\nimport sys\n"),
    ('"""doc"""\n', '#!/venv/bin/python\n"""doc"""\n'),
])
def test_a_hook_names_the_interpreter_slurm_geo_is_installed_in(source, expected):
    assert plan.render_hook(source, "/venv/bin/python") == expected


SCRIPTS = {"slurm-geo": "/venv/bin/slurm-geo",
           "slurm-geo-federation": "/venv/bin/slurm-geo-federation"}


@pytest.mark.parametrize("line, expected", [
    ("ExecStart=/usr/local/bin/slurm-geo billing check --alert",
     "ExecStart=/venv/bin/slurm-geo billing check --alert"),
    ("ExecStart=/usr/local/bin/slurm-geo-federation --config /etc/x",
     "ExecStart=/venv/bin/slurm-geo-federation --config /etc/x"),
    ("ExecStart=-/usr/local/bin/slurm-geo-federation", "ExecStart=-/venv/bin/slurm-geo-federation"),
    ("ExecStartPre=slurm-geo billing check", "ExecStartPre=/venv/bin/slurm-geo billing check"),
    ("ExecStart=/usr/bin/etcd --config-file /etc/slurm-geo/etcd.yml",
     "ExecStart=/usr/bin/etcd --config-file /etc/slurm-geo/etcd.yml"),
    ("ExecReload=/bin/kill -HUP $MAINPID", "ExecReload=/bin/kill -HUP $MAINPID"),
    ("# ExecStart=/usr/local/bin/slurm-geo in a comment",
     "# ExecStart=/usr/local/bin/slurm-geo in a comment"),
    ("Description=slurm-geo federation daemon", "Description=slurm-geo federation daemon"),
])
def test_a_unit_runs_the_console_script_where_pip_put_it(line, expected):
    assert plan.render_unit(line + "\n", SCRIPTS) == expected + "\n"


def test_a_unit_running_a_script_that_is_not_installed_is_refused():
    with pytest.raises(KeyError):
        plan.render_unit("ExecStart=/usr/local/bin/slurm-geo-checkpoint-sync\n", SCRIPTS)


def test_the_units_run_only_this_packages_console_scripts():
    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    declared = {line.split("=")[0].strip() for line in
                setup["options.entry_points"]["console_scripts"].strip().splitlines()}
    assert set(plan.CONSOLE_SCRIPTS) == declared
    run = {name for unit in UNITS.glob("slurm-geo-*") for name in
           plan.unit_programs(unit.read_text())}
    assert run == declared


def test_every_unit_documents_itself_with_pages_the_install_puts_in_place():
    from slurm_geo.cli import PROG, cli
    from slurm_geo.cli.manpages import pages

    installed = {name.removesuffix(".1") for name in pages(cli, PROG)}
    for unit in UNITS.glob("slurm-geo-*"):
        [documentation] = [line.split("=", 1)[1] for line in unit.read_text().splitlines()
                           if line.startswith("Documentation=")]
        for url in documentation.split():
            assert url.startswith(("man:", "https://")), (unit.name, url)
            if url.startswith("man:"):
                assert url.removeprefix("man:").removesuffix("(1)") in installed, url


def test_the_hooks_shipped_are_the_hooks_installed_and_the_sandbox_runs():
    assert sorted(p.stem for p in HOOKS.glob("*.py")) == sorted(plan.HOOK_NAMES)
    assert set(render.GEO_HOOKS) == set(plan.HOOK_SETTINGS)
    assert render.GEO_VALIDATOR == plan.VALIDATOR


def test_the_daemon_finds_the_helper_where_the_install_puts_it():
    assert PurePosixPath(SUBMIT_AS_PATH) == plan.Layout().submit_as


def test_the_printed_lines_are_the_ones_docs_admin_slurm_gives():
    doc = (REPO / "docs" / "admin-slurm.md").read_text()
    for line in plan.slurm_conf_lines(plan.Layout()):
        assert line in doc, line
    assert plan.plugstack_line(plan.Layout(), "onprem") in doc
    sandbox = {line.split("=")[0] for line in render.geo_slurm_conf_lines(
        SandboxLayout(Path("/srv/box"), 20000).host_clusters[0])}
    assert sandbox <= {line.split("=")[0] for line in plan.slurm_conf_lines(plan.Layout())}


def test_the_plugin_and_helper_build_with_hardening_flags():
    argv = plan.submit_as_build_argv("cc", "s.c", "out", "/usr/bin/sbatch")
    assert {"-D_FORTIFY_SOURCE=2", "-fPIE", "-pie", "-Wl,-z,relro,-z,now"} <= set(argv)
    assert '-DSERVICE_GROUP="slurm-geo"' in argv and '-DSBATCH_PATH="/usr/bin/sbatch"' in argv
    assert plan.spank_build_argv("cc", "g.c", "g.so", "/inc")[-4:] == ["-I/inc", "-o",
                                                                        "g.so", "g.c"]


# --- the install, from this checkout, into a temporary root --------------------------------

needs_build = pytest.mark.skipif(
    shutil.which("cc") is None or not Path("/usr/include/slurm/spank.h").exists(),
    reason="needs cc and Slurm's headers (apt-get install gcc libslurm-dev)")


def options(**given) -> Options:
    """Install options with the pages and completion script the CLI would pass in."""
    return Options(man_pages={"slurm-geo.1": ".TH SLURM-GEO 1\n"},
                   completion="complete -F _slurm_geo_completion slurm-geo\n", **given)


def _tree(root: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(root)): (p.read_bytes(), stat.S_IMODE(p.stat().st_mode))
            for p in sorted(root.rglob("*")) if p.is_file()}


@needs_build
def test_install_twice_changes_nothing_the_second_time(tmp_path):
    root = tmp_path / "root"
    first = install(options(root=root))
    assert {act for _item, act in first.done} == {"create"}
    before = _tree(root)
    mtimes = {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}
    second = install(options(root=root))
    assert {act for _item, act in second.done} == {"unchanged"}
    assert _tree(root) == before
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()} == mtimes
    # the helper, not setuid under a staging root; a hook, its mode put back
    assert not first.setuid and before["usr/local/libexec/slurm-geo/submit-as"][1] == 0o755
    hook = root / "usr/local/libexec/slurm-geo/prolog.py"
    hook.chmod(0o777)
    third = install(options(root=root))
    assert [(item.kind, act) for item, act in third.done if act != "unchanged"] == \
        [("hook", "update")]
    assert stat.S_IMODE(hook.stat().st_mode) == 0o755


@pytest.mark.root(reason="chown needs root")
def test_a_setuid_item_keeps_its_bit_and_owner_once_written(tmp_path):
    from slurm_geo.site.install import _present, _write

    item = plan.Item("submit-as", PurePosixPath("/x/submit-as"), b"ELF", 0o4750, 0, 4242)
    target = tmp_path / "libexec" / "submit-as"
    _write(target, item)  # chown before chmod: chown clears the setuid bit
    assert plan.action(item, _present(target)) == "unchanged"
    info = target.stat()
    assert (stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid) == (0o4750, 0, 4242)
    assert sorted(p.name for p in target.parent.iterdir()) == ["submit-as"]  # no temp left


@needs_build
def test_a_dry_run_writes_nothing(tmp_path):
    report = install(options(root=tmp_path / "root", dry_run=True))
    assert {act for _item, act in report.done} == {"create"}
    assert not (tmp_path / "root").exists()


def test_missing_slurm_headers_are_one_line_naming_the_package(tmp_path):
    with pytest.raises(SiteInstallError, match="apt-get install libslurm-dev") as raised:
        install(options(root=tmp_path / "root", slurm_include=tmp_path))
    assert raised.value.exit_code == ExitCode.SITE_INSTALL
    assert not (tmp_path / "root").exists()


def test_the_cli_says_one_line_and_exits_with_its_code(tmp_path):
    done = subprocess.run([sys.executable, "-m", "slurm_geo", "site", "install", "--root",
                           str(tmp_path / "root"), "--slurm-include", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == ExitCode.SITE_INSTALL
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("slurm-geo: error: ")
    assert "Traceback" not in done.stderr and done.stdout == ""


@needs_build
def test_json_lists_each_item_with_its_path_and_action(tmp_path):
    argv = [sys.executable, "-m", "slurm_geo", "site", "install", "--root",
            str(tmp_path / "root"), "--prefix", "/opt/sg", "--json"]
    env = {**os.environ}
    report = json.loads(subprocess.run(argv, capture_output=True, text=True, timeout=120,
                                       check=True, env=env).stdout)
    kinds = {item["kind"] for item in report["items"]}
    assert kinds == {"hook", "unit", "drop-in", "spank", "submit-as", "man", "completion"}
    assert all(item["action"] == "create" for item in report["items"])
    assert "Prolog=/opt/sg/libexec/slurm-geo/prolog.py" in report["slurm_conf"]
    assert report["plugstack_conf"].startswith("required /opt/sg/lib/slurm-geo/geo_directives.so ")
    for item in report["items"]:
        assert Path(item["installed_at"]) == tmp_path / "root" / item["path"].lstrip("/")
        assert Path(item["installed_at"]).is_file()
