"""The layers of docs/architecture.md, checked over slurm_geo's import graph.

Every module is parsed with `ast` (nothing is imported); every `import` and `from ...
import` counts wherever it stands: at the top, inside a function (the lazy imports), under
`if TYPE_CHECKING:`. Relative imports are resolved. `from pkg import name` is an import of
the submodule `pkg.name` when there is one, else of `pkg`. Imports by string
(`importlib.import_module`, the CLI's lazy command table) are not seen.

Asserted: no import cycle between modules; the layer rules in RULES; the readers' rules
in READERS (what of another package one may import) and NEVER_LOADED (what nothing one
imports, directly or not, may be); Slurm's commands run from the Slurm layer only and
Slurm's variables read through slurm_geo.jobenv only (an AST scan of each module's
literals, beside the import graph); no module over
MAX_MODULE_LINES lines and no class over MAX_CLASS_LINES (STYLE.md: "modules under ~600").
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

import slurm_geo

PACKAGE = "slurm_geo"
ROOT = Path(slurm_geo.__file__).resolve().parent
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 300

# (package, what no module in it may import, why). A name covers its submodules; a
# package's imports of its own modules are always allowed.
RULES: list[tuple[str, tuple[str, ...], str]] = [
    ("slurm_geo.policy", ("slurm_geo.config",),
     "policy is pure decisions; config is built on it, not the other way round"),
    ("slurm_geo.federation",
     ("slurm_geo.sandbox", "slurm_geo.torch", "slurm_geo.drills", "torch"),
     "the federation daemon runs on a controller host: no sandbox, no training side, "
     "no torch; the drills drive it from outside"),
    ("slurm_geo.torch", ("slurm_geo.federation",),
     "the training side talks to the daemon over its protocol, never through its code"),
    ("slurm_geo.torch", ("slurm_geo.examples",),
     "the example trainers are the training side's users, not part of the library"),
    ("slurm_geo.ckpt",
     ("slurm_geo.sync", "slurm_geo.federation", "slurm_geo.torch", "slurm_geo.billing",
      "slurm_geo.cli", "slurm_geo.sandbox"),
     "the checkpoint format and stores sit below every daemon and the training side"),
    ("slurm_geo.stage",
     ("slurm_geo.sync", "slurm_geo.federation", "slurm_geo.torch", "slurm_geo.billing",
      "slurm_geo.cli", "slurm_geo.sandbox", "slurm_geo.slurm"),
     "staged trees are the checkpoint format's, a library the daemons and jobs call"),
    ("slurm_geo.slurm",
     ("slurm_geo.federation", "slurm_geo.sync", "slurm_geo.ckpt", "slurm_geo.torch",
      "slurm_geo.billing", "slurm_geo.cli", "slurm_geo.sandbox"),
     "the Slurm layer is the bottom: everything above asks it, it asks nothing above"),
    ("slurm_geo.daemon", ("slurm_geo",),
     "the plumbing both daemons share stands on nothing of theirs"),
    ("slurm_geo.sync", ("slurm_geo.federation", "slurm_geo.billing"),
     "checkpoint-sync runs alone on a site without the federation daemon; billing reads it"),
]

# (package, a package it reads, the only modules of it it may import, why): a reader of
# another's records goes through that package's readers, never through its running parts.
READERS: list[tuple[str, str, tuple[str, ...], str]] = [
    ("slurm_geo.billing", "slurm_geo.federation",
     ("slurm_geo.federation.model", "slurm_geo.federation.state"),
     "billing reads the daemon's records (its state and audit log), never loading the "
     "daemon: no engine, daemon, act, operator, access or decide"),
    ("slurm_geo.billing", "slurm_geo.sync", ("slurm_geo.sync.reader",),
     "billing reads checkpoint-sync's transfers through its reader, not its daemon"),
]

# (package, what nothing it loads may be: its imports, theirs, and so on, why).
NEVER_LOADED: list[tuple[str, tuple[str, ...], str]] = [
    ("slurm_geo.billing",
     tuple(f"slurm_geo.federation.{room}"
           for room in ("decide", "access", "act", "engine", "operator", "daemon"))
     + tuple(f"slurm_geo.sync.{part}" for part in ("daemon", "runtime", "worker", "entry")),
     "reading the federation's and checkpoint-sync's records loads neither daemon"),
]


@dataclass(frozen=True)
class Import:
    importer: str
    target: str  # a slurm_geo module, or an outside name as written (torch, torch.nn)
    line: int

    def where(self) -> str:
        return f"{module_path(self.importer)}:{self.line}"


def module_name(path: Path, root: Path = ROOT, package: str = PACKAGE) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def module_path(name: str) -> str:
    return _PATHS.get(name, name)


def find_modules(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    return {module_name(path, root, package): path for path in sorted(root.rglob("*.py"))}


def imports_of(name: str, source: str, known: Iterable[str], is_package: bool = False,
               ) -> list[Import]:
    """Every import in one module's source, resolved to known module names where it
    names one of them."""
    known = set(known)
    here = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [Import(name, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(here, node.module, node.level)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                target = submodule if submodule in known else base
                found.append(Import(name, target, node.lineno))
    return found


def _absolute(here: str, module: str | None, level: int) -> str:
    if level == 0:
        return module or ""
    parts = here.split(".")
    base = parts[:len(parts) - (level - 1)]
    return ".".join([*base, module] if module else base)


def knots(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules of each strongly connected component that holds a cycle (more than one
    module, or one importing itself), sorted."""
    def knotted(component: set[str]) -> bool:
        (one, *others) = component
        return bool(others) or one in graph.get(one, set())

    return sorted(sorted(component) for component in _components(graph) if knotted(component))


def first_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each knot, from its first module back to it."""
    return [_path_back(graph, knot[0], set(knot)) for knot in knots(graph)]


def _components(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components, without recursion."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    components.append(component)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, set())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return components


def _path_back(graph: dict[str, set[str]], start: str, within: set[str]) -> list[str]:
    """The shortest path from start back to start inside one component."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph.get(node, set()) & within):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"{start} is in a component it cannot get back to")


def _within(target: str, prefix: str) -> bool:
    return target == prefix or target.startswith(prefix + ".")


MODULES = find_modules()
_PATHS = {name: str(path.relative_to(ROOT.parent)) for name, path in MODULES.items()}
SOURCES = {name: path.read_text() for name, path in MODULES.items()}
IMPORTS = [imp for name, source in SOURCES.items()
           for imp in imports_of(name, source, MODULES, MODULES[name].name == "__init__.py")]
GRAPH = {name: {imp.target for imp in IMPORTS if imp.importer == name and imp.target in MODULES}
         for name in MODULES}


# --- the package ---------------------------------------------------------------------------

def test_the_graph_sees_the_imports_it_must():
    """A walker that found nothing would pass every rule below."""
    assert "slurm_geo.daemon.events" in GRAPH["slurm_geo.sync.daemon"]
    assert "slurm_geo.drills.picture" in GRAPH["slurm_geo.drills.drill"]
    lazy = {imp.target for imp in IMPORTS if imp.importer == "slurm_geo.drills.drill"}
    assert "torch" in lazy  # imported inside reference_weights()


def test_no_import_cycles():
    lines = {(imp.importer, imp.target): imp.where() for imp in IMPORTS}
    problems = []
    for knot in knots(GRAPH):
        cycle = _path_back(GRAPH, knot[0], set(knot))
        problems.append("  " + " -> ".join(cycle))
        problems += [f"      {a} -> {b}  ({lines[a, b]})"
                     for a, b in zip(cycle, cycle[1:], strict=False)]
        if len(knot) > len(cycle) - 1:
            problems.append(f"    (one cycle of {len(knot)} modules importing each other: "
                            f"{', '.join(knot)})")
    if problems:
        pytest.fail("import cycles (break each at one of its edges):\n" + "\n".join(problems),
                    pytrace=False)


@pytest.mark.parametrize("package, forbidden, why", RULES, ids=[rule[0] for rule in RULES])
def test_layer_rule(package: str, forbidden: tuple[str, ...], why: str):
    named = [package, *(name for name in forbidden if name.startswith(PACKAGE + "."))]
    assert not [name for name in named if name not in MODULES], \
        f"a rule names a package that is not there (renamed?): {named}"
    offending = [f"  {imp.where()}: {imp.importer} imports {imp.target}"
                 for imp in sorted(IMPORTS, key=lambda i: (module_path(i.importer), i.line))
                 if _within(imp.importer, package) and not _within(imp.target, package)
                 and any(_within(imp.target, name) for name in forbidden)]
    if offending:
        pytest.fail(f"{package} must import none of {', '.join(forbidden)} ({why}):\n"
                    + "\n".join(offending), pytrace=False)


@pytest.mark.parametrize("package, read, allowed, why", READERS,
                         ids=[f"{rule[0]}-reads-{rule[1]}" for rule in READERS])
def test_reader_rule(package: str, read: str, allowed: tuple[str, ...], why: str):
    named = [package, read, *allowed]
    assert not [name for name in named if name not in MODULES], \
        f"a rule names a module that is not there (renamed?): {named}"
    offending = [f"  {imp.where()}: {imp.importer} imports {imp.target}"
                 for imp in sorted(IMPORTS, key=lambda i: (module_path(i.importer), i.line))
                 if _within(imp.importer, package) and _within(imp.target, read)
                 and not any(_within(imp.target, name) for name in allowed)]
    if offending:
        pytest.fail(f"{package} may import of {read} only {', '.join(allowed)} ({why}):\n"
                    + "\n".join(offending), pytrace=False)


@pytest.mark.parametrize("package, forbidden, why", NEVER_LOADED,
                         ids=[rule[0] for rule in NEVER_LOADED])
def test_never_loaded(package: str, forbidden: tuple[str, ...], why: str):
    assert not [name for name in (package, *forbidden) if name not in MODULES], \
        f"a rule names a package that is not there (renamed?): {(package, *forbidden)}"
    start = [name for name in MODULES if _within(name, package)]
    via = dict.fromkeys(start, "")  # module -> the module that loaded it first
    work = list(start)
    while work:
        name = work.pop(0)
        for target in sorted(GRAPH.get(name, set())):
            if target not in via:
                via[target] = name
                work.append(target)
    offending = []
    for name in sorted(via):
        if any(_within(name, prefix) for prefix in forbidden):
            chain = [name]
            while via[chain[-1]]:
                chain.append(via[chain[-1]])
            offending.append("  " + " <- ".join(chain))
    if offending:
        pytest.fail(f"{package} loads {', '.join(forbidden)} ({why}):\n"
                    + "\n".join(offending), pytrace=False)


# --- Slurm's commands and Slurm's variables -------------------------------------------------

# The client commands of Slurm (not its daemons, which the sandbox starts as any service).
SLURM_COMMANDS = frozenset({"sbatch", "srun", "scontrol", "squeue", "sacct", "sacctmgr",
                            "scancel", "sinfo", "sreport", "salloc", "sattach", "sstat"})
SLURM_LAYER = "slurm_geo.slurm"
# The one reader of Slurm's own SLURM_* variables (and SLURMD_NODENAME) in a job or hook.
JOB_ENV = "slurm_geo.jobenv"
# The example trainers are the library's users (the rule for torch says so), not part of it.
NOT_THE_LIBRARY = ("slurm_geo.examples",)
_SLURM_VARIABLE = re.compile(r"SLURMD?_(?!GEO_)[A-Z0-9_]+")


def slurm_command_argvs(source: str) -> list[tuple[int, str]]:
    """(line, command) of every list or tuple whose first item is the literal name of one
    of Slurm's commands: an argv, whoever runs it (subprocess, os.exec*, a runner passed
    in, the sandbox's exec_in)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.List, ast.Tuple)) and node.elts:
            first = node.elts[0]
            if isinstance(first, ast.Constant) and first.value in SLURM_COMMANDS:
                found.append((node.lineno, first.value))
    return sorted(found)


def slurm_variable_reads(source: str) -> list[tuple[int, str]]:
    """(line, name) of every read of a Slurm variable by its literal name: `env[NAME]`,
    `env.get(NAME)` (and .pop, .setdefault, os.getenv), `NAME in env`, or the name passed
    to any function (a helper that reads it). Writing one (a job's environment being
    built, a dict's key) is not a read."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[ast.expr] = []
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            names = [node.slice]
        elif isinstance(node, ast.Call):
            names = list(node.args)
        elif isinstance(node, ast.Compare) and any(
                isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            names = [node.left]
        found += [(node.lineno, name.value) for name in names
                  if isinstance(name, ast.Constant) and isinstance(name.value, str)
                  and _SLURM_VARIABLE.fullmatch(name.value)]
    return sorted(found)


def test_slurm_commands_are_run_by_the_slurm_layer_only():
    offending = [f"  {module_path(name)}:{line}: {command}"
                 for name, source in sorted(SOURCES.items())
                 if not _within(name, SLURM_LAYER)
                 and not any(_within(name, other) for other in NOT_THE_LIBRARY)
                 for line, command in slurm_command_argvs(source)]
    if offending:
        pytest.fail("Slurm's commands are run from slurm_geo/slurm/ only (a function there; "
                    "admin.py for a site's administration):\n" + "\n".join(offending),
                    pytrace=False)


def test_slurm_variables_are_read_in_one_place():
    offending = [f"  {module_path(name)}:{line}: {variable}"
                 for name, source in sorted(SOURCES.items())
                 if name != JOB_ENV and not _within(name, SLURM_LAYER)
                 and not any(_within(name, other) for other in NOT_THE_LIBRARY)
                 for line, variable in slurm_variable_reads(source)]
    if offending:
        pytest.fail(f"Slurm's variables are read through {JOB_ENV} (JobEnv.from_environ) "
                    "only:\n" + "\n".join(offending), pytrace=False)


@pytest.mark.parametrize("source, found", [
    ("subprocess.run(['scontrol', 'requeue', job])", [(1, "scontrol")]),
    ("os.execv(srun, ('srun', *words))", [(1, "srun")]),
    ("argv = ['sbatch', '--parsable']\nrun(argv)", [(1, "sbatch")]),
    ("subprocess.run(['mariadb-admin', 'ping'])", []),
    ("shutil.which('sbatch')", []),
])
def test_slurm_command_argvs_are_found(source, found):
    assert slurm_command_argvs(source) == found


@pytest.mark.parametrize("source, found", [
    ("os.environ['SLURM_JOB_ID']", [(1, "SLURM_JOB_ID")]),
    ("env.get('SLURMD_NODENAME', '')", [(1, "SLURMD_NODENAME")]),
    ("os.getenv('SLURM_CONF')", [(1, "SLURM_CONF")]),
    ("'SLURM_JOB_ID' in env", [(1, "SLURM_JOB_ID")]),
    ("_int(env, 'SLURM_JOB_ID')", [(1, "SLURM_JOB_ID")]),  # a helper that reads it
    ("env.get('SLURM_GEO_RUN')", []),  # slurm-geo's own
    ("env['SLURM_JWT'] = token", []),  # written, not read
    ("{'SLURM_CONF': path}", []),
])
def test_slurm_variable_reads_are_found(source, found):
    assert slurm_variable_reads(source) == found


def test_no_module_is_too_long():
    long = sorted(f"  {module_path(name)}: {len(source.splitlines())} lines"
                  for name, source in SOURCES.items()
                  if len(source.splitlines()) > MAX_MODULE_LINES)
    if long:
        pytest.fail(f"modules over {MAX_MODULE_LINES} lines (split by job):\n"
                    + "\n".join(long), pytrace=False)


def test_no_class_is_too_long():
    long = []
    for name, source in SOURCES.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    long.append(f"  {module_path(name)}:{node.lineno}: class {node.name}, "
                                f"{size} lines")
    if long:
        pytest.fail(f"classes over {MAX_CLASS_LINES} lines (split by job):\n"
                    + "\n".join(sorted(long)), pytrace=False)


# --- the walker itself ---------------------------------------------------------------------

KNOWN = {"p", "p.a", "p.b", "p.b.c", "p.b.d"}


@pytest.mark.parametrize("module, is_package, source, targets", [
    ("p.a", False, "import p.b.c\nimport torch.nn", ["p.b.c", "torch.nn"]),
    ("p.a", False, "from p.b import c, helper", ["p.b.c", "p.b"]),
    ("p.b.c", False, "from . import d", ["p.b.d"]),
    ("p.b.c", False, "from .d import thing", ["p.b.d"]),
    ("p.b.c", False, "from ..a import thing", ["p.a"]),
    ("p.b", True, "from .c import thing", ["p.b.c"]),          # in p/b/__init__.py
    ("p.b", True, "from .. import a", ["p.a"]),
    ("p.a", False, "def f():\n    from p.b import d\n", ["p.b.d"]),
    ("p.a", False, "if TYPE_CHECKING:\n    import p.b\n", ["p.b"]),
])
def test_imports_are_resolved(module, is_package, source, targets):
    assert [imp.target for imp in imports_of(module, source, KNOWN, is_package)] == targets


@pytest.mark.parametrize("graph, cycles", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"b"}, "b": {"a"}}, [["a", "b", "a"]]),
    ({"a": {"a"}}, [["a", "a"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}},
     [["a", "b", "c", "a"], ["d", "e", "d"]]),
])
def test_cycles_are_found(graph, cycles):
    assert first_cycles(graph) == cycles
