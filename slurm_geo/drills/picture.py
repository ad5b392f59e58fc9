"""The drill's timeline as a PNG, drawn where drills.timeline laid it out: each
incarnation's Slurm state over time, the events marked, with replicas a row for the
leader; the legend below the axis."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from slurm_geo.drills.report import DrillReport
from slurm_geo.drills.timeline import (
    BAR_FONT_PT,
    DPI,
    LANE_IN,
    LEGEND_COLUMNS,
    MARK_FONT_PT,
    ROW_FONT_PT,
    ROW_IN,
    Timeline,
    layout,
)

BAR_HEIGHT = 0.5


def draw_timeline(report: DrillReport, path: Path) -> Path:
    figure = render(layout(report))
    figure.savefig(path)
    from matplotlib import pyplot
    pyplot.close(figure)
    return path


def render(timeline: Timeline) -> Any:
    """The matplotlib figure of `timeline` (the caller saves and closes it)."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot

    g = timeline.geometry
    figure = pyplot.figure(figsize=(g.width, g.height), dpi=DPI)
    axes = figure.add_axes((g.left / g.width, g.bottom / g.height, g.axes_width / g.width,
                            (g.height - g.top - g.bottom) / g.height))
    for bar in timeline.bars:
        axes.barh(bar.row, bar.end - bar.begin, left=bar.begin, height=BAR_HEIGHT,
                  color=bar.colour, hatch=bar.hatch,
                  edgecolor="#6a1b9a" if bar.hatch else "none")
        if bar.text:
            axes.text(bar.begin, bar.row, f" {bar.text}", fontsize=BAR_FONT_PT,
                      color="white", va="center", ha="left")
    rows = max(1, len(timeline.rows))
    lane_rows = LANE_IN / ROW_IN  # a row is one unit of y, ROW_IN high
    for mark in timeline.marks:
        axes.axvline(mark.at, color=mark.colour, linestyle="--", linewidth=1, zorder=1)
        axes.text(mark.at, rows - 0.5 + (mark.lane + 0.5) * lane_rows, f" {mark.label} ",
                  fontsize=MARK_FONT_PT, color=mark.colour, va="center", ha=mark.align,
                  zorder=3, bbox={"facecolor": "white", "edgecolor": "none", "pad": 0})
    axes.set_xlim(0, timeline.end)
    axes.set_ylim(-0.5, rows - 0.5 + (timeline.lanes + 1) * lane_rows)
    axes.set_yticks(range(len(timeline.rows)), timeline.rows, fontsize=ROW_FONT_PT)
    axes.tick_params(axis="y", length=0)
    axes.set_xlabel("seconds since submission", fontsize=ROW_FONT_PT)
    figure.suptitle(timeline.title, fontsize=10, y=1 - 0.1 / g.height, va="top")
    if timeline.legend:
        handles = [pyplot.Rectangle((0, 0), 1, 1, facecolor=colour, hatch=hatch,
                                    edgecolor="#6a1b9a" if hatch else colour)
                   for _, colour, hatch in timeline.legend]
        figure.legend(handles, [name for name, _, _ in timeline.legend], fontsize=7,
                      loc="lower center", ncol=LEGEND_COLUMNS, frameon=False,
                      bbox_to_anchor=(0.5, 0.02 / g.height))
    return figure

