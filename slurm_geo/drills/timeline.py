"""Where everything in the drill's timeline picture goes, decided from the report alone
(pure; picture.py only draws it): a row per incarnation, a bar per run of one Slurm
state, the stale incarnation's last bar ending where it was fenced; with several
replicas of the daemon, a row for the one that led; a labelled line per event, each
label on the first lane where it overlaps no other; the rows' labels as wide as the
left margin; the legend below the axis, where no bar is.

Text is measured by estimate (average glyph widths of matplotlib's default font, a
little generous) so that the geometry is known before anything is drawn; the tests
draw it and check the estimate against the renderer's own extents."""

from __future__ import annotations

from dataclasses import dataclass, replace

from slurm_geo.drills.report import DrillReport, Sample

SAMPLE_INTERVAL_S = 0.5  # the drill polls each incarnation's state this often
COLOURS = {"PENDING": "#f2c14e", "CONFIGURING": "#f2c14e", "RUNNING": "#4caf50",
           "COMPLETING": "#8bc34a", "COMPLETED": "#2e7d32", "UNREACHABLE": "#d32f2f",
           "REQUEUED": "#9e9e9e", "CANCELLED": "#616161", "FAILED": "#b71c1c",
           "NODE_FAIL": "#b71c1c"}
UNKNOWN_STATE = "#bdbdbd"
LEADER_COLOURS = ("#7e57c2", "#ab47bc")
NO_LEADER = ("no leader", "white", "///")
LEADER_ROW = "leading replica"

DPI = 110
WIDTH_IN = 10.0
RIGHT_IN = 0.3
ROW_IN = 0.55
LANE_IN = 0.2         # one line of an event's label
TITLE_IN = 0.45
XAXIS_IN = 0.5        # the ticks and "seconds since submission"
LEGEND_ROW_IN = 0.25
LEGEND_COLUMNS = 5
TICK_PAD_IN = 0.15    # between a row's label and the axis
ROW_FONT_PT = 9.0
MARK_FONT_PT = 8.0
BAR_FONT_PT = 8.0
# DejaVu Sans averages about 0.55 em a glyph over these labels; 0.62 keeps the estimate
# above what the renderer measures (tests/test_drill_picture.py checks it).
EM_PER_CHAR = 0.62


def text_width_in(text: str, points: float) -> float:
    return len(text) * EM_PER_CHAR * points / 72


@dataclass(frozen=True)
class Bar:
    row: int
    begin: float  # seconds since the start of the picture
    end: float
    colour: str
    hatch: str = ""
    text: str = ""  # written inside the bar (a replica's name), when it fits
    state: str = ""  # the Slurm state it stands for, in the legend


@dataclass(frozen=True)
class Mark:
    label: str
    at: float
    colour: str
    lane: int          # 0 just above the rows, counting up
    align: str         # "left": the label starts at the line; "right": it ends there

    def extent(self, seconds_per_in: float) -> tuple[float, float]:
        width = text_width_in(f" {self.label} ", MARK_FONT_PT) * seconds_per_in
        return (self.at, self.at + width) if self.align == "left" else \
            (self.at - width, self.at)


@dataclass(frozen=True)
class Geometry:
    """The figure's size and the axes' margins, in inches."""

    width: float
    height: float
    left: float
    right: float
    top: float
    bottom: float

    @property
    def axes_width(self) -> float:
        return self.width - self.left - self.right


@dataclass(frozen=True)
class Timeline:
    title: str
    rows: list[str]          # bottom to top
    bars: list[Bar]
    marks: list[Mark]
    lanes: int
    legend: list[tuple[str, str, str]]  # name, colour, hatch
    end: float               # the x axis runs from 0 to here
    geometry: Geometry

    @property
    def seconds_per_in(self) -> float:
        return self.end / self.geometry.axes_width


def layout(report: DrillReport) -> Timeline:
    start = min([s.t for s in report.timeline] + [report.killed_at])
    incarnations = list(dict.fromkeys(s.cluster for s in report.timeline))
    bars = [bar for index, row in enumerate(incarnations)
            for bar in state_bars(index, [s for s in report.timeline if s.cluster == row],
                                  start, _fenced_end(report, row, start))]
    rows = [_row_label(report, row) for row in incarnations]
    drawn = {bar.state for bar in bars}
    legend = [(state, COLOURS[state], "") for state in COLOURS if state in drawn] + \
        [(state, UNKNOWN_STATE, "") for state in sorted(drawn - set(COLOURS))]
    if several_replicas(report):
        bars += leader_bars(report, len(rows), start, max([b.end for b in bars], default=0))
        rows.append(LEADER_ROW)
        if report.failover_at is not None:
            legend.append(NO_LEADER)
    events = [(label, when - start, colour) for label, when, colour in _events(report)
              if when is not None]
    end = 1.02 * max([b.end for b in bars] + [at for _, at, _ in events] + [1.0])
    left = max([text_width_in(row, ROW_FONT_PT) for row in rows], default=0) + TICK_PAD_IN
    seconds_per_in = end / (WIDTH_IN - left - RIGHT_IN)
    bars = [bar if fits_inside(bar, seconds_per_in) else replace(bar, text="")
            for bar in bars]
    marks = place_marks(events, end, seconds_per_in)
    lanes = 1 + max([m.lane for m in marks], default=-1)
    bottom = XAXIS_IN + LEGEND_ROW_IN * -(-len(legend) // LEGEND_COLUMNS)
    height = TITLE_IN + LANE_IN * (lanes + 1) + ROW_IN * max(1, len(rows)) + bottom
    return Timeline(_title(report), rows, bars, marks, lanes, legend, end,
                    Geometry(WIDTH_IN, height, left, RIGHT_IN, TITLE_IN, bottom))


def state_bars(row: int, samples: list[Sample], start: float,
               fenced_at: float | None = None) -> list[Bar]:
    """One bar per run of samples in one state, from its first sample to the next
    state's (the last to one sampling interval past it); none past `fenced_at`."""
    bars: list[Bar] = []
    for index, sample in enumerate(samples):
        if index and samples[index - 1].state == sample.state:
            continue
        following = next((s.t for s in samples[index:] if s.state != sample.state),
                         samples[-1].t + SAMPLE_INTERVAL_S)
        begin, end = sample.t - start, following - start
        if fenced_at is not None:
            if begin >= fenced_at:
                break
            end = min(end, fenced_at)
        bars.append(Bar(row, begin, end, COLOURS.get(sample.state, UNKNOWN_STATE),
                        state=sample.state))
    return bars


def leader_bars(report: DrillReport, row: int, start: float, end: float) -> list[Bar]:
    """The replica that led until `end` (seconds since `start`); after a loss none
    (hatched) until another said it leads, then that one. Each bar carries its name."""
    lost = report.leader_lost_at
    spans = [(0.0, end if lost is None else lost - start, report.leader_before,
              LEADER_COLOURS[0], "")]
    if lost is not None and report.failover_at is not None:
        failover = report.failover_at - start
        spans += [(lost - start, failover, None, NO_LEADER[1], NO_LEADER[2]),
                  (failover, max(end, failover), report.leader_after, LEADER_COLOURS[1], "")]
    return [Bar(row, begin, until, colour, hatch, name or "")
            for begin, until, name, colour, hatch in spans]


def fits_inside(bar: Bar, seconds_per_in: float) -> bool:
    return text_width_in(f" {bar.text} ", BAR_FONT_PT) * seconds_per_in <= bar.end - bar.begin


def place_marks(events: list[tuple[str, float, str]], end: float,
                seconds_per_in: float) -> list[Mark]:
    """Each event's label on the lowest lane where it overlaps no other label, written
    rightwards from its line, or leftwards when it would run off the axis."""
    taken: list[list[tuple[float, float]]] = []
    marks = []
    for label, at, colour in sorted(events, key=lambda e: e[1]):
        rightwards = Mark(label, at, colour, 0, "left")
        align = "left" if rightwards.extent(seconds_per_in)[1] <= end else "right"
        lane = 0
        while True:
            mark = Mark(label, at, colour, lane, align)
            low, high = mark.extent(seconds_per_in)
            if lane == len(taken):
                taken.append([])
            if all(high <= a or low >= b for a, b in taken[lane]):
                taken[lane].append((low, high))
                break
            lane += 1
        marks.append(mark)
    return marks

def several_replicas(report: DrillReport) -> bool:
    """The federation daemon ran replicated: a leader was lost, or entries name who
    wrote them (a daemon alone names none)."""
    return report.leader_lost_at is not None or \
        any(d.get("replica") for d in report.decisions)


def _fenced_end(report: DrillReport, row: str, start: float) -> float | None:
    """The stale incarnation is the one at home the drill followed first."""
    if report.fenced_at is None or row != next(
            (s.cluster for s in report.timeline if s.cluster.startswith(f"{report.home}:")),
            None):
        return None
    return report.fenced_at - start


def _row_label(report: DrillReport, row: str) -> str:
    """With clusters at several sites, an incarnation's row names its site:
    'onprem:1 @ home'."""
    if len(set(report.cluster_sites.values())) < 2:
        return row
    site = report.cluster_sites.get(row.split(":")[0])
    return f"{row} @ {site}" if site else row


def _events(report: DrillReport) -> list[tuple[str, float | None, str]]:
    return [("killed", report.killed_at, "#d32f2f"), ("detected", report.detected_at,
            "#ff9800"), ("requeued", report.moved_at, "#1976d2"),
            ("training again", report.running_elsewhere_at, "#4caf50"),
            ("completed", report.completed_at, "#2e7d32"),
            ("new leader", report.failover_at, "#6a1b9a"),
            ("home back", report.returned_at, "#455a64"),
            ("fenced", report.fenced_at, "#000000")]


def _title(report: DrillReport) -> str:
    rto = "n/a" if report.rto_s is None else f"{report.rto_s:.1f} s"
    identical = "bit-identical" if report.bit_identical else "weights DIFFERENT"
    return (f"slurm-geo drill {report.run}, {report.lose} lost: RTO {rto}, "
            f"steps lost {report.steps_lost}, {identical}")
