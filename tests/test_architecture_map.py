"""docs/architecture.md is the map of the house: its picture and its package table are
checked against the code, so that a new module or a new import that breaks the picture
fails here, naming itself.

- The picture (the ```floors block) lists slurm_geo's packages floor by floor, top first.
  Every package and top-level module is on it once, and each imports only what stands on
  a lower floor: no import runs sideways or back up.
- The package table names every module: each module's name, relative to the row of the
  nearest package that has one, stands in that row in backticks.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import slurm_geo

ROOT = Path(slurm_geo.__file__).resolve().parent
DOC = ROOT.parent / "docs" / "architecture.md"
def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__main__":
            continue
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(["slurm_geo", *parts])] = path
    return found


def imports_of(path: Path) -> set[str]:
    """Every slurm_geo module or name a module imports; relative imports resolved."""
    here = ".".join(["slurm_geo", *path.parent.relative_to(ROOT).parts])
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(here.split(".")[:len(here.split(".")) - node.level + 1])
            module = (node.module or "") if node.level == 0 else ".".join(
                part for part in (base, node.module) if part)
            if module:
                names.add(module)
                names.update(f"{module}.{alias.name}" for alias in node.names)
    return {name for name in names if name.startswith("slurm_geo.")}


def top(name: str) -> str:
    """The floor plan's unit: slurm_geo.X (a package or a top-level module)."""
    return ".".join(name.split(".")[:2])


def floors(text: str) -> list[list[str]]:
    block = re.search(r"```floors\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md has no ```floors block (the picture)"
    rows = []
    for line in block.group(1).splitlines():
        names = re.findall(r"\b([a-z_]+)(?=/|\.py\b)", line)
        if names:
            rows.append([f"slurm_geo.{name}" for name in names])
    return rows


def table_rows(text: str) -> dict[str, str]:
    rows = {}
    for line in text.splitlines():
        match = re.match(r"\| `(slurm_geo(?:\.\w+)*)`((?:, `slurm_geo(?:\.\w+)*`)*) \|(.*)", line)
        if match:
            for name in [match.group(1), *re.findall(r"`(slurm_geo[\w.]*)`", match.group(2))]:
                rows[name] = match.group(3)
    return rows


def test_the_picture_holds_every_package_once_and_no_import_runs_up_or_sideways():
    plan = floors(DOC.read_text())
    placed = [name for row in plan for name in row]
    found = modules()
    units = {top(name) for name in found if name != "slurm_geo"}
    assert sorted(set(placed)) == sorted(placed), "a package drawn twice"
    assert not units - set(placed), f"not in docs/architecture.md's picture: {units - set(placed)}"
    assert not set(placed) - units, f"drawn but not in the code: {set(placed) - units}"
    level = {name: len(plan) - i for i, row in enumerate(plan) for name in row}
    wrong = sorted(
        f"{module} imports {target}: {top(module)} (floor {level[top(module)]}) may only "
        f"import what stands lower, {top(target)} is on floor {level[top(target)]}"
        for module, path in found.items() if module != "slurm_geo"
        for target in imports_of(path)
        if top(target) != top(module) and top(target) in level
        and level[top(target)] >= level[top(module)])
    assert not wrong, "\n".join(wrong)


def test_the_package_table_names_every_module():
    rows = table_rows(DOC.read_text())
    unnamed = []
    for module in modules():
        owner = max((row for row in rows if module == row or module.startswith(row + ".")),
                    key=len, default=None)
        if owner is None:
            unnamed.append(f"{module}: no row of the package table covers it")
        elif module != owner:
            short = module[len(owner) + 1:]
            if f"`{short}`" not in rows[owner] and f"`{short}." not in rows[owner]:
                unnamed.append(f"{module}: row `{owner}` does not name `{short}`")
    assert not unnamed, ("docs/architecture.md's package table: say what each does\n"
                         + "\n".join(unnamed))


def inner_orders(text: str) -> dict[str, list[str]]:
    """The page's list of each package's rooms from the bottom up, e.g.
    "- `slurm_geo.ckpt`: errors < format < stores < repo < ops < files."."""
    orders = {}
    for match in re.finditer(r"^- `(slurm_geo\.\w+)`: ([\w<\s]+)\.$", text, re.M):
        orders[match.group(1)] = [name.strip() for name in match.group(2).split("<")]
    return orders


def room_in(package: str, name: str) -> str | None:
    """The room of `package` (slurm_geo.X.Y) that module `name` stands in; None outside."""
    parts = name.split(".")
    return ".".join(parts[:3]) if len(parts) > 2 and ".".join(parts[:2]) == package else None


def test_inside_federation_and_ckpt_imports_run_down_the_order_the_page_gives():
    orders = inner_orders(DOC.read_text())
    assert set(orders) >= {"slurm_geo.federation", "slurm_geo.ckpt"}, orders
    found = modules()
    wrong = []
    for package, order in orders.items():
        rank = {f"{package}.{room}": i for i, room in enumerate(order)}

        rooms = {room_in(package, module) for module in found} - {None}
        assert rooms <= set(rank), f"{package}: rooms the page's order leaves out: " \
                                   f"{sorted(rooms - set(rank))}"
        for module, path in found.items():
            here = room_in(package, module)
            if here is None:
                continue
            for target in imports_of(path):
                there = room_in(package, target)
                if there is not None and there != here and rank[there] > rank[here]:
                    wrong.append(f"{module} imports {target}: {here} stands below {there}")
    assert not wrong, "\n".join(wrong)


def offers(module: str, name: str) -> bool:
    """Whether `module` offers `name`, as an importer would find it (a lazy package's
    names included: slurm_geo.lazy)."""
    return hasattr(importlib.import_module(module), name)


def test_the_package_table_names_nothing_that_is_gone():
    """Each row is a package, a module or a data directory of slurm_geo that is there, and
    every full `slurm_geo.…` name in its text is a module or a name one offers: a row
    left behind by a move or a removal fails here."""
    found = modules()
    text = DOC.read_text()
    gone = []
    for row, cell in table_rows(text).items():
        if row not in found and not (ROOT / Path(*row.split(".")[1:])).is_dir():
            gone.append(f"row `{row}`: no such module or directory")
        for name in re.findall(r"`(slurm_geo(?:\.\w+)+)`", cell):
            parent, _, last = name.rpartition(".")
            if name not in found and not (parent in found and offers(parent, last)):
                gone.append(f"row `{row}` names `{name}`: no such module or name")
    assert not gone, "docs/architecture.md's package table:\n" + "\n".join(gone)
