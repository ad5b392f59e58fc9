"""One grammar for cluster, region, store and cost-center names (slurm_geo.names), in the
config and in --geo-* directives; and the generated geo_policy.lua escapes what it holds,
comments included, so no value can break out of its string or its comment."""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path

import pytest

from slurm_geo.config import parse_config
from slurm_geo.errors import ConfigError
from slurm_geo.names import NAME_RULE, is_name
from slurm_geo.policy.directives import DirectiveError, parse_options
from slurm_geo.policy.geo import GeoPolicy, GeoRules
from slurm_geo.policy.lua import lua_comment, policy_lua
from tests.kit.site import SITE

HOSTILE = [
    "", " ", "a b", "x]]", "]]", "[[x", "--x", "-x", ".x", "_x", "a\nb", "a\rb", "a\x00b",
    'a"b', "a'b", "a\\b", "a;b", "a,b", "a=b", "a/b", "é", "ａ", "a" * 65, "x]]--[[",
    "a\u2028b",
]
FINE = ["a", "A", "0", "onprem", "eu-west-1", "ml.research_2", "a" * 64, "9-._x"]


@pytest.mark.parametrize("value", FINE)
def test_names_that_follow_the_grammar(value):
    assert is_name(value)
    assert parse_options({"geo-cost-center": value}).cost_center == value


@pytest.mark.parametrize("value", [*HOSTILE, None, 5, ["a"]])
def test_names_that_do_not(value):
    assert not is_name(value)


def refusal(raw: dict) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_config(raw, source="site.toml")
    message = str(caught.value)
    assert "\n" not in message and "\r" not in message
    return message


def with_cluster_named(name: str) -> dict:
    raw = copy.deepcopy(SITE)
    raw["clusters"][name] = raw["clusters"].pop("rented")
    return raw


def with_store_named(name: str) -> dict:
    raw = copy.deepcopy(SITE)
    raw["stores"][name] = raw["stores"].pop("offsite")
    raw["clusters"]["rented"]["store"] = name
    raw["sync"]["destination"] = name
    return raw


def with_value(path: tuple, value) -> dict:
    raw = copy.deepcopy(SITE)
    table = raw
    for step in path[:-1]:
        table = table[step]
    table[path[-1]] = value
    return raw


def with_cost_center(table: str, name: str) -> dict:
    raw = copy.deepcopy(SITE)
    raw[table]["budgets"] = {name: 100}
    return raw


# (how a config gets the name, what the message names)
PLACES = [
    (with_cluster_named, "site.toml [clusters]: a cluster's name must be"),
    (with_store_named, "site.toml [stores]: a store's name must be"),
    (lambda n: with_value(("clusters", "onprem", "region"), n),
     "site.toml [clusters.onprem]: region must be"),
    (lambda n: with_value(("stores", "pfs", "region"), n), "site.toml [stores.pfs]: region"),
    (lambda n: with_value(("site", "home_cluster"), n), "site.toml [site]: home_cluster"),
    (lambda n: with_value(("clusters", "onprem", "store"), n),
     "site.toml [clusters.onprem]: store must be"),
    (lambda n: with_cost_center("policy", n), "site.toml [policy].budgets: key must be"),
    (lambda n: with_cost_center("billing", n), "site.toml [billing].budgets: key must be"),
]


@pytest.mark.parametrize("value", HOSTILE, ids=repr)
@pytest.mark.parametrize("place, where", PLACES, ids=[w for _, w in PLACES])
def test_the_config_refuses_a_name_outside_the_grammar_in_one_line(place, where, value):
    message = refusal(place(value))
    assert message.startswith(where), message
    assert f"{NAME_RULE}, got {value!r}" in message


@pytest.mark.parametrize("value", HOSTILE, ids=repr)
@pytest.mark.parametrize("option", ["geo-cost-center", "geo-clusters", "geo-residency"])
def test_directives_refuse_a_name_outside_the_grammar_in_one_line(option, value):
    if value == "a,b" and option != "geo-cost-center":
        return  # a list of two names
    with pytest.raises(DirectiveError) as caught:
        parse_options({option: value})
    assert "\n" not in str(caught.value) and "\r" not in str(caught.value)


# --- geo_policy.lua ---------------------------------------------------------------------------

LUA = shutil.which("lua5.1") or shutil.which("lua")
ESCAPES = ["x]]", "]]--", "a\nb = 1 --", 'x\nerror("broke out") --', "\rerror('out')",
           '"; os.exit(3) --', "\\", "\r", "\x00", "é", "]==]", "--[[", "\x7f", "tab\there",
           "a\\010b"]


@pytest.mark.parametrize("text", ESCAPES, ids=repr)
def test_a_comment_stays_one_line_comment(text):
    comment = lua_comment(text)
    assert comment.startswith("-- ") and "\n" not in comment and "\r" not in comment


def hostile_policy(value: str) -> str:
    """geo_policy.lua with `value` everywhere a string goes, bypassing the config's checks
    (policy_lua is pure and must not rely on them)."""
    policy = GeoPolicy(require_cost_center=True, data_classes={"restricted": (value,)},
                       budgets={value: 12.5})
    rules = GeoRules(policy, {value: value, "plain": "home"})
    return policy_lua(rules, value, f"/etc/{value}/site.toml")


@pytest.mark.skipif(LUA is None, reason="needs a Lua interpreter")
@pytest.mark.parametrize("value", ESCAPES, ids=repr)
def test_lua_reads_back_exactly_what_was_written(tmp_path: Path, value):
    (tmp_path / "geo_policy.lua").write_text(hostile_policy(value))
    probe = tmp_path / "probe.lua"
    probe.write_text(
        'local p = dofile(arg[1])\n'
        'local function hex(s) return (string.gsub(s, ".", function(c) '
        'return string.format("%02x", string.byte(c)) end)) end\n'
        'print(hex(p.cluster), hex(p.cluster_regions[p.cluster]), '
        'hex(p.data_classes.restricted[1]), p.budgets[p.cluster], p.max_restarts, '
        'p.require_cost_center)\n')
    done = subprocess.run([LUA, str(probe), str(tmp_path / "geo_policy.lua")],
                          capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    expected = value.encode().hex()
    assert done.stdout.split() == [expected, expected, expected, "12.5",
                                   str(GeoPolicy.max_restarts), "true"]


def test_nan_or_inf_never_reach_the_lua():
    for bad in (float("nan"), float("inf")):
        rules = GeoRules(GeoPolicy(budgets={"ml": bad}), {"onprem": "home"})
        with pytest.raises(ValueError, match="no Lua literal"):
            policy_lua(rules, "onprem", "site.toml")
