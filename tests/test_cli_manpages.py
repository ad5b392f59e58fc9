"""Man pages from the help text: one per group and command, each with the sections a man
page has, rendering without a warning where man and groff are installed."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from slurm_geo.cli import PROG, cli
from slurm_geo.cli.manpages import main, pages
from slurm_geo.cli.tree import walk
from slurm_geo.exitcodes import ExitCode

PAGES = pages(cli, PROG)
SECTIONS = ("NAME", "SYNOPSIS", "DESCRIPTION", "OPTIONS", "EXIT STATUS", "SEE ALSO")


def test_every_group_and_command_has_its_page():
    assert set(PAGES) == {"-".join(path) + ".1" for path, _ in walk(cli, PROG)}
    assert {"slurm-geo.1", "slurm-geo-ckpt.1", "slurm-geo-ckpt-push.1"} <= set(PAGES)


@pytest.mark.parametrize("name", sorted(PAGES))
def test_every_page_has_the_sections_in_order(name):
    headings = [line[4:].strip('"') for line in PAGES[name].splitlines()
                if line.startswith(".SH ")]
    assert [h for h in headings if h != "COMMANDS"] == list(SECTIONS)


def test_a_page_says_its_options_exit_codes_and_relatives():
    push = PAGES["slurm-geo-ckpt-push.1"]
    assert ".B \\-\\-to STORE\n" in push and ".B \\-\\-json\n" in push
    assert f".B {ExitCode.FENCED.value}\nFENCED (lease): " in push
    assert ".BR slurm\\-geo\\-ckpt (1)" in push
    group = PAGES["slurm-geo-ckpt.1"]
    assert ".SH COMMANDS\n.TP\n.B check\n" in group
    assert ".BR slurm\\-geo\\-ckpt\\-push (1)" in group


def test_main_writes_the_pages_into_the_directory(tmp_path, capsys):
    assert main([str(tmp_path / "man")]) == 0
    assert sorted(p.name for p in (tmp_path / "man").iterdir()) == sorted(PAGES)
    assert capsys.readouterr().out == f"wrote {len(PAGES)} man pages to {tmp_path / 'man'}\n"
    assert main([]) == ExitCode.USAGE


@pytest.mark.skipif(not (shutil.which("man") and shutil.which("groff")),
                    reason="needs man and groff")
def test_the_pages_render_without_warnings(tmp_path):
    for name, text in PAGES.items():
        (tmp_path / name).write_text(text)
    env = {**os.environ, "MANWIDTH": "80", "MANPAGER": "cat"}
    shown = subprocess.run(["man", "--warnings", "-l", str(tmp_path / "slurm-geo-ckpt-push.1")],
                           env=env, capture_output=True, text=True, timeout=60, check=True)
    assert shown.stderr == ""
    assert "slurm-geo ckpt push [OPTIONS] PATH" in shown.stdout
    # every page at once, in one groff, with every warning on
    checked = subprocess.run(["groff", "-man", "-ww", "-z", "-Tutf8",
                              *sorted(str(tmp_path / name) for name in PAGES)],
                             capture_output=True, text=True, timeout=60, check=False)
    assert (checked.returncode, checked.stderr) == (0, "")
