"""How a value looks in a human table (docs/cli.md, "Output"): `-` for a value that is
missing, a float rounded to 4 significant digits, anything else as it prints. `--json`
output is never passed through here: scripts get the exact values."""

from __future__ import annotations

from typing import Any

MISSING = "-"
SIGNIFICANT_DIGITS = 4


def cell(value: Any) -> str:
    """None and "" are missing; a float (a loss, a ratio) gets 4 significant digits:
    0.123456789 -> 0.1235, 2.0 -> 2, 1234567.8 -> 1.235e+06."""
    if value is None or value == "":
        return MISSING
    if isinstance(value, float):
        return f"{value:.{SIGNIFICANT_DIGITS}g}"
    return str(value)
