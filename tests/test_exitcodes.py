"""The one exit-code table: every error class takes its code from it, and docs/cli.md's
table is the one generated from it."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import slurm_geo
from slurm_geo.errors import SlurmGeoError
from slurm_geo.exitcodes import BEGIN_MARKER, END_MARKER, ExitCode, main, markdown_table

CLI_DOC = Path(__file__).resolve().parent.parent / "docs" / "cli.md"


def every_subclass(cls: type) -> set[type]:
    found = set()
    for sub in cls.__subclasses__():
        found |= {sub, *every_subclass(sub)}
    return found


def import_every_module() -> None:
    for module in pkgutil.walk_packages(slurm_geo.__path__, "slurm_geo."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)


def test_docs_table_is_the_generated_one():
    text = CLI_DOC.read_text()
    assert text.count(BEGIN_MARKER) == 1 and text.count(END_MARKER) == 1
    between = text.split(BEGIN_MARKER, 1)[1].split(END_MARKER, 1)[0]
    assert between.strip() == markdown_table()


def test_every_error_class_takes_its_code_from_the_table():
    import_every_module()
    classes = every_subclass(SlurmGeoError) | {SlurmGeoError}
    assert len(classes) > 20
    wrong = {cls.__qualname__: cls.exit_code for cls in classes
             if not isinstance(cls.exit_code, ExitCode)}
    assert wrong == {}


def test_codes_are_unique_and_in_exit_range():
    # __members__ also lists aliases, which iterating the enum would hide
    values = [int(code) for code in ExitCode.__members__.values()]
    assert len(values) == len(set(values))
    assert all(0 < value < 256 for value in values)


def test_markdown_flag_prints_the_table_between_markers(capsys):
    assert main(["--markdown"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(BEGIN_MARKER) and out.rstrip().endswith(END_MARKER)
    assert main([]) == ExitCode.USAGE
