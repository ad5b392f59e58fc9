"""The annotated site configs of docs/examples/ and the config snippets of docs/*.md.

Both examples pass `slurm-geo config check`; together they set every key the loader reads
(the set comes from the tables' Settings, so a new key fails here until an example shows
it); and every ```toml block of the docs that is site config holds only keys the loader
knows and, laid over the two-site example, loads.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from slurm_geo.cli import cli
from slurm_geo.config import daemons, model, tables
from slurm_geo.config.settings import Setting
from slurm_geo.config.settings import tables as list_of_tables
from slurm_geo.exitcodes import ExitCode

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "docs" / "examples"
TWO_SITES = EXAMPLES / "site.toml"
THREE_SITES = EXAMPLES / "site-three-sites.toml"

NAMED = "*"  # a table of NAME = table ([clusters.NAME], [clusters.NAME.users.USER])
LIST = "[]"  # an array of tables ([[billing.prices]])

# Each top-level table: its Settings, and whether it is one table per NAME.
TOP = {
    "site": (tables.SITE_SETTINGS, False),
    "registry": (tables.REGISTRY_SETTINGS, False),
    "clusters": (tables.CLUSTER_SETTINGS, True),
    "stores": (tables.STORE_SETTINGS, True),
    "retention": (tables.RETENTION_SETTINGS, False),
    "policy": (tables.POLICY_SETTINGS, False),
    "sync": (daemons.SYNC_SETTINGS, False),
    "federation": (daemons.FEDERATION_SETTINGS, False),
    "billing": (tables.BILLING_SETTINGS, False),
}
# A key that holds tables of its own: the Settings of each (and how they nest), or None
# for a table of NAME = value (budgets, data classes), whose keys are the site's names.
NESTED: dict[tuple[str, str], tuple[tuple[Setting, ...], str] | None] = {
    ("clusters", "prices"): (tables.PRICE_SETTINGS, ""),
    ("clusters", "users"): (tables.REMOTE_ACCOUNT_SETTINGS, NAMED),
    ("policy", "data_classes"): None,
    ("policy", "budgets"): None,
    ("federation", "replicas"): (daemons.REPLICA_SETTINGS, LIST),
    ("billing", "budgets"): None,
    ("billing", "prices"): (tables.PRICE_ENTRY_SETTINGS, LIST),
}


def known_keys() -> set[str]:
    """Every key path the loader reads: `clusters.*.prices.gpu_hour`, `billing.prices[].cluster`."""
    keys = set()
    for table, (settings, named) in TOP.items():
        base = f"{table}.{NAMED}" if named else table
        for setting in settings:
            keys.add(f"{base}.{setting.name}")
            nested = NESTED.get((table, setting.name))
            if nested is not None:
                sub, how = nested
                where = f"{base}.{setting.name}{'.' + NAMED if how == NAMED else how}"
                keys |= {f"{where}.{s.name}" for s in sub}
    return keys


def paths_in(raw: dict[str, Any]) -> set[str]:
    """The key paths a parsed config sets, NAMEs as `*`; unknown ones as they are."""
    found = set()
    for table, value in raw.items():
        settings, named = TOP.get(table, ((), False))
        bodies = value.values() if named and isinstance(value, dict) else [value]
        base = f"{table}.{NAMED}" if named else table
        for body in bodies:
            for key, item in (body.items() if isinstance(body, dict) else ()):
                found.add(f"{base}.{key}")
                nested = NESTED.get((table, key))
                if nested is None:
                    continue
                _, how = nested
                rows = item.values() if how == NAMED else item if how == LIST else [item]
                where = f"{base}.{key}{'.' + NAMED if how == NAMED else how}"
                found |= {f"{where}.{k}" for row in rows for k in row}
    return found


def check(path: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["config", "check", str(path), *args])
    return result.exit_code, result.output


# --- the schema this test derives is the model's -------------------------------------------

def test_the_tables_walked_are_the_loaders():
    assert set(TOP) == set(model.TABLES)


def test_every_key_that_holds_tables_is_walked():
    holding = {(table, s.name) for table, (settings, _) in TOP.items() for s in settings
               if s.subtable or s.parse is list_of_tables}
    assert holding == set(NESTED)


# --- the examples --------------------------------------------------------------------------

@pytest.mark.parametrize("path", [TWO_SITES, THREE_SITES], ids=lambda p: p.name)
def test_config_check_accepts_each_example(path):
    code, output = check(path, "--json")
    report = json.loads(output)
    assert (code, report["ok"], report["problems"]) == (0, True, []), output


def test_the_examples_are_the_two_and_three_site_deployments():
    two = model.load_config(TWO_SITES)
    three = model.load_config(THREE_SITES)
    assert two.federation is not None and not two.federation.replicated
    assert three.federation is not None and three.federation.replicated
    assert {r.site for r in three.federation.replicas} == {"home", "control"}
    for site in (two, three):
        assert site.home_cluster == "onprem"
        assert {c.access for c in site.clusters.values()} == {"cli", "rest"}
        assert site.sync is not None


def test_the_examples_set_every_key_the_loader_reads():
    shown = paths_in(tomllib.loads(TWO_SITES.read_text())) | \
        paths_in(tomllib.loads(THREE_SITES.read_text()))
    assert known_keys() - shown == set()
    assert shown - known_keys() == set()


def test_every_key_of_the_two_site_example_has_a_comment():
    """Where a key first appears it says what it is: a comment on its line or the line
    above (a cluster's keys once, at the first cluster)."""
    lines = TWO_SITES.read_text().splitlines()
    seen, bare = set(), []
    for i, line in enumerate(lines):
        key = re.match(r"([A-Za-z_-]+) = ", line)
        table = _table_of(lines, i)
        if table.startswith("[policy.") or table.startswith("[billing.budgets"):
            key = None  # NAME = value: the table's own line says what they are
        if key is None:
            continue
        shape = re.sub(r"\.[a-z-]+(?=[.\]])", ".*", table) + key.group(1)
        if shape not in seen and "#" not in line and not lines[i - 1].lstrip().startswith("#"):
            bare.append(line)
        seen.add(shape)
    assert bare == []


def _table_of(lines: list[str], index: int) -> str:
    line = next((line for line in reversed(lines[:index]) if line.startswith("[")), "")
    return line.split("#")[0].strip()


def test_config_check_names_a_problem_in_one_line():
    broken = TWO_SITES.read_text().replace('region = "home"                           #',
                                           'regoin = "home"                           #', 1)
    path = Path(pytest.importorskip("tempfile").mkdtemp()) / "config.toml"
    path.write_text(broken)
    code, output = check(path)
    assert code == ExitCode.CONFIG
    assert output.count("\n") == 1 and "unknown key(s) regoin" in output, output


# --- the docs' config snippets -------------------------------------------------------------

DOCS = sorted((ROOT / "docs").glob("*.md"))
_BLOCK = re.compile(r"^( *)```toml\n(.*?)^\1```", re.S | re.M)


def toml_blocks() -> list[tuple[str, dict[str, Any]]]:
    blocks = []
    for doc in DOCS:
        text = doc.read_text()
        for match in _BLOCK.finditer(text):
            indent = len(match.group(1))
            body = "\n".join(line[indent:] for line in match.group(2).splitlines())
            line = text[:match.start()].count("\n") + 1
            raw = tomllib.loads(body)
            if set(raw) <= set(model.TABLES):
                blocks.append((f"{doc.name}:{line}", raw))
    return blocks


BLOCKS = toml_blocks()


def test_the_docs_have_config_snippets():
    named = {name.split(":")[0] for name, _ in BLOCKS}
    assert {"install.md", "federation.md", "checkpoint-sync.md", "billing.md"} <= named


@pytest.mark.parametrize(("where", "raw"), BLOCKS, ids=[name for name, _ in BLOCKS])
def test_each_docs_snippet_uses_only_known_keys(where, raw):
    assert paths_in(raw) - known_keys() == set(), where


@pytest.mark.parametrize(("where", "raw"), BLOCKS, ids=[name for name, _ in BLOCKS])
def test_each_docs_snippet_loads_over_the_example(where, raw):
    """The snippet's tables in place of the example's (a cluster or store by its name):
    what the docs show is a config the loader takes."""
    merged = tomllib.loads(TWO_SITES.read_text())
    for table, value in raw.items():
        if TOP[table][1]:
            merged.setdefault(table, {}).update(value)
        else:
            merged[table] = value
    model.parse_config(merged, source=where)
