"""No test module imports another (issue 34, 4): what several test modules build on lives
in tests/kit/ (a manual clock, site configs, keyword builders, the shared worlds), or in a
support module such as tests/helpers.py, and a support module imports no test module
either. Fixtures shared by many modules are in tests/conftest.py, which nobody imports.

The scan reads every module under tests/ (tests/kit/ included), at any depth of the file:
an import inside a function counts the same."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imported(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of each import: `import a.b` gives a.b; `from a import b, c` gives
    a, a.b and a.c (a name may be a module of package a)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
            found.extend((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)
    return found


def forbidden(module: str) -> bool:
    """A test module or conftest, as the package's (tests.test_x) or as pytest's rootdir
    puts it on sys.path (test_x)."""
    parts = module.split(".")
    if parts[0] == "tests":
        parts = parts[1:]
    elif len(parts) > 1:
        return False
    return len(parts) == 1 and (parts[0].startswith("test_") or parts[0] == "conftest")


def offences(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    where = path.relative_to(TESTS.parent)
    return sorted({f"{where}:{line} imports {module}: put shared code in tests/kit/"
                   for line, module in imported(tree) if forbidden(module)})


def test_no_module_under_tests_imports_a_test_module_or_conftest():
    found = [offence for path in sorted(TESTS.rglob("*.py")) for offence in offences(path)]
    assert not found, "\n".join(found)


def test_the_scan_sees_each_form_of_import():
    source = ("import tests.test_a\nfrom tests.test_b import x\nfrom tests import conftest\n"
              "from tests.conftest import user_dir\nimport test_c\nfrom conftest import y\n"
              "def f():\n    from test_d import z\n"
              "from tests.kit.clock import ManualClock\nfrom tests.helpers import as_uid\n"
              "import helpers\nfrom tests import kit\n")
    tree = ast.parse(source)
    modules = sorted({module for _, module in imported(tree) if forbidden(module)})
    assert modules == ["conftest", "test_c", "test_d", "tests.conftest", "tests.test_a",
                       "tests.test_b"]
