"""The one grammar of names: clusters, regions, stores and cost centers.

The config's names (`[clusters.NAME]`, `region = ...`, `[stores.NAME]`, the cost centers
of `[policy.budgets]` and `[billing.budgets]`) and the `--geo-*` directives that name them
(`--geo-clusters`, `--geo-residency`, `--geo-cost-center`) follow it, and job_submit.lua's
`is_name` mirrors it. Names end up in Slurm comments, Lua, file names and log lines, so
they hold nothing any of those would read as syntax: no spaces, quotes, brackets, newlines.
"""

from __future__ import annotations

import re

NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
NAME_RULE = "1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
_NAME = re.compile(NAME_PATTERN)


def is_name(value: object) -> bool:
    return isinstance(value, str) and _NAME.fullmatch(value) is not None
