"""slurm_geo.cells.table: the one layout of a human table (the CLI's lists, the planner's
candidates, billing's report and checks, the replication status)."""

from __future__ import annotations

import pytest

from slurm_geo.cells import table


@pytest.mark.parametrize(("rows", "right", "shown"), [
    ([("A", "B")], (), "A  B"),
    ([("NAME", "STATE"), ("onprem-7", "running"), ("x", "-")], (),
     "NAME      STATE\nonprem-7  running\nx         -"),
    # the last column's blanks are cut; a short cell in the middle keeps its padding
    ([("RUN", "WHY", "X"), ("r", "", ""), ("run-long", "because", "")], (),
     "RUN       WHY      X\nr\nrun-long  because"),
    # numbers to the right, the key to the left (billing's report)
    ([("USER", "CPU-S", "TOTAL $"), ("alice", "36000", "1.00"), ("TOTAL", "7", "12.50")],
     range(1, 3), "USER   CPU-S  TOTAL $\nalice  36000     1.00\nTOTAL      7    12.50"),
])
def test_columns_are_as_wide_as_their_widest_cell(rows, right, shown):
    assert table(rows, right=right) == shown


def test_each_line_as_the_copies_it_replaced_laid_it_out():
    rows = [("CLUSTER", "ELIGIBLE", "WHY_NOT"), ("rented (current)", "yes", "-"),
            ("cloud", "no", "the data class restricted may not leave home")]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    before = "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip()
                       for r in rows)
    assert table(rows) == before
