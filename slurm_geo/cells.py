"""How a value looks in a human table (docs/cli.md, "Output"): `-` for a value that is
missing, a float rounded to 4 significant digits, anything else as it prints; and the one
way rows of cells are laid out as such a table (`table`). `--json` output is never passed
through here: scripts get the exact values."""

from __future__ import annotations

from collections.abc import Collection, Sequence
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


def table(rows: Sequence[Sequence[str]], right: Collection[int] = ()) -> str:
    """`rows` (the header first) as lines of aligned columns: each column as wide as its
    widest cell, two spaces between columns, the columns numbered in `right` aligned to
    the right (numbers), the others to the left; no line ends in blanks."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(text.rjust(width) if i in right else text.ljust(width)
                               for i, (text, width) in enumerate(zip(row, widths, strict=True)))
                     .rstrip() for row in rows)
