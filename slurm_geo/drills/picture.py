"""The drill's timeline as a PNG: each incarnation's Slurm state over time, with the kill,
the detection, the requeue and the completion marked; with replicas, a row for the
leader: which replica led when, and the gap while none did."""

from __future__ import annotations

from pathlib import Path

from slurm_geo.drills.report import DrillReport

COLOURS = {"PENDING": "#f2c14e", "CONFIGURING": "#f2c14e", "RUNNING": "#4caf50",
           "COMPLETING": "#8bc34a", "COMPLETED": "#2e7d32", "UNREACHABLE": "#d32f2f",
           "REQUEUED": "#9e9e9e", "CANCELLED": "#616161", "FAILED": "#b71c1c",
           "NODE_FAIL": "#b71c1c"}


def draw_timeline(report: DrillReport, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot

    start = min([s.t for s in report.timeline] + [report.killed_at])
    rows = list(dict.fromkeys(s.cluster for s in report.timeline))
    figure, axes = pyplot.subplots(figsize=(10, 1.2 + 0.7 * max(1, len(rows))), dpi=110)
    for index, row in enumerate(rows):
        samples = [s for s in report.timeline if s.cluster == row]
        for here, after in zip(samples, samples[1:] + samples[-1:], strict=True):
            width = max(after.t - here.t, 0.5)
            axes.barh(index, width, left=here.t - start, height=0.5,
                      color=COLOURS.get(here.state, "#bdbdbd"), edgecolor="none")
    if report.leader_lost_at is not None:
        rows.append("leader")
        _leader_row(axes, report, len(rows) - 1, start)
    marks = [("killed", report.killed_at, "#d32f2f"), ("detected", report.detected_at,
             "#ff9800"), ("requeued", report.moved_at, "#1976d2"),
             ("training again", report.running_elsewhere_at, "#4caf50"),
             ("completed", report.completed_at, "#2e7d32"),
             ("new leader", report.failover_at, "#6a1b9a"),
             ("home back", report.returned_at, "#455a64")]
    for label, when, colour in marks:
        if when is not None:
            axes.axvline(when - start, color=colour, linestyle="--", linewidth=1)
            axes.text(when - start, len(rows) + 0.5, label, rotation=90, fontsize=8,
                      color=colour, va="top", ha="right")
    axes.set_ylim(-0.6, len(rows) + 0.6)
    axes.set_yticks(range(len(rows)), [_label(report, row) for row in rows])
    axes.set_xlabel("seconds since submission")
    rto = "n/a" if report.rto_s is None else f"{report.rto_s:.1f} s"
    axes.set_title(f"slurm-geo drill {report.run}: RTO {rto}, steps lost "
                   f"{report.steps_lost}, bit-identical {report.bit_identical}", fontsize=10)
    handles = [pyplot.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    used = {s.state for s in report.timeline}
    legend = [(h, name) for h, name in zip(handles, COLOURS, strict=True) if name in used]
    if legend:
        axes.legend([h for h, _ in legend], [n for _, n in legend], fontsize=7,
                    loc="lower right", ncol=3)
    figure.tight_layout()
    figure.savefig(path)
    pyplot.close(figure)
    return path


def _leader_row(axes, report: DrillReport, index: int, start: float) -> None:
    """The replica that led before the loss, none (hatched) until another said it leads,
    then that one, each span labelled with its name."""
    assert report.leader_lost_at is not None
    end = max([s.t for s in report.timeline] + [report.completed_at or report.leader_lost_at])
    spans = [(start, report.leader_lost_at, report.leader_before, "#7e57c2", "")]
    if report.failover_at is not None:
        spans += [(report.leader_lost_at, report.failover_at, None, "white", "///"),
                  (report.failover_at, end, report.leader_after, "#ab47bc", "")]
    for begin, until, name, colour, hatch in spans:
        axes.barh(index, max(until - begin, 0.5), left=begin - start, height=0.5,
                  color=colour, hatch=hatch, edgecolor="#6a1b9a" if hatch else "none")
        if name:
            axes.text(begin - start + 0.5, index, name, fontsize=8, color="white",
                      va="center")


def _label(report: DrillReport, row: str) -> str:
    """An incarnation's row names the site its cluster is at: 'onprem:1 @ home'."""
    site = report.cluster_sites.get(row.split(":")[0])
    return f"{row} @ {site}" if site else row
