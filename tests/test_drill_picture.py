"""The drill's timeline picture: where things go is decided from the report (pure,
drills.timeline), then drawn; the drawing is checked with the renderer's own extents:
no text clipped or overlapping another event's, the legend clear of every bar."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from slurm_geo.drills.drill import DrillSettings
from slurm_geo.drills.picture import draw_timeline, render
from slurm_geo.drills.report import DrillReport, Sample
from slurm_geo.drills.timeline import (
    COLOURS,
    LEADER_ROW,
    SAMPLE_INTERVAL_S,
    Bar,
    layout,
    place_marks,
    state_bars,
)

T0 = 1_700_000_000.0
KILL, DETECT, MOVED, TRAINING, DONE, BACK, FENCED, STOPPED = 40, 52, 53, 60, 100, 102, 104, 112


def sampled(row: str, spans: list[tuple[float, float, str]]) -> list[Sample]:
    """Samples every SAMPLE_INTERVAL_S, as the drill's sampler takes them."""
    samples = []
    for begin, end, state in spans:
        steps = round((end - begin) / SAMPLE_INTERVAL_S)
        samples += [Sample(T0 + begin + i * SAMPLE_INTERVAL_S, row, state) for i in range(steps)]
    return samples


def drill(lose: str = "cluster", fenced: bool = True, sites: int = 2, replicated: bool = False,
          home: str = "onprem") -> DrillReport:
    """A drill as drill.py reports it: home's job killed, moved to rented and completed
    there, home back, its stale incarnation running again until fenced."""
    home_job = f"{home}:5"
    timeline = sampled(home_job, [(0.5, 2, "PENDING"), (2, KILL, "RUNNING"),
                                  (KILL, BACK, "UNREACHABLE"), (BACK, FENCED, "RUNNING"),
                                  (FENCED, STOPPED, "CANCELLED")])
    timeline += sampled("rented:77", [(MOVED, 56, "PENDING"), (56, DONE, "RUNNING"),
                                      (DONE, STOPPED, "COMPLETED")])
    report = DrillReport(
        run="drill-1a2b3c", logical_job=f"{home}-5", home=home, target="rented",
        settings=asdict(DrillSettings()), killed_at=T0 + KILL, detected_at=T0 + DETECT,
        moved_at=T0 + MOVED, running_elsewhere_at=T0 + TRAINING, completed_at=T0 + DONE,
        detection_window_s=9.0, last_step_home=40, offsite_step_at_kill=30, resume_step=30,
        steps_lost=10, final_step=60, final_weights="a" * 64, reference_weights="a" * 64,
        bit_identical=True, replicated_bytes=1, replication_seconds=1.0,
        predicted_transfer_s=3.0, actual_transfer_s=3.2, legs=[],
        stale_incarnation=f"{home_job} cancelled: fenced", audit_ok=True, owner="alice",
        owner_uid=2001, timeline=sorted(timeline, key=lambda s: s.t), returned_at=T0 + BACK,
        fenced_at=T0 + FENCED if fenced else None, lose=lose,
        cluster_sites={home: "home", "rented": "remote" if sites > 1 else "home"})
    if replicated or lose in ("site", "leader"):
        report.leader_before, report.leader_after = "home", "control"
        report.decisions = [{"time": T0 + DETECT, "kind": "outage", "what": "onprem out",
                             "replica": "home" if lose == "cluster" else "control"}]
    if lose in ("site", "leader"):
        report.leader_lost_at = T0 + (KILL if lose == "site" else DETECT + 0.5)
        report.failover_at = report.leader_lost_at + 6
    return report


DRILLS = {"cluster": drill(), "replicated": drill(replicated=True), "site": drill("site"),
          "leader": drill("leader"), "one site": drill(sites=1),
          "long names": drill("site", home="onprem-with-a-rather-long-name-indeed")}


def bars_of(report: DrillReport, row: int) -> list[Bar]:
    return [bar for bar in layout(report).bars if bar.row == row]


def test_the_stale_incarnations_bar_ends_where_it_was_fenced():
    home, rented = bars_of(drill(), 0), bars_of(drill(), 1)
    assert max(bar.end for bar in home) == FENCED - 0.5  # the picture starts at 0.5 s
    assert "CANCELLED" not in {bar.state for bar in home}
    assert max(bar.end for bar in rented) == STOPPED - 0.5  # the last sample and its interval
    unfenced = bars_of(drill(fenced=False), 0)
    assert max(bar.end for bar in unfenced) == STOPPED - 0.5


def test_the_legend_names_the_states_drawn():
    names = [name for name, _, _ in layout(drill()).legend]
    assert names == ["PENDING", "RUNNING", "COMPLETED", "UNREACHABLE"]
    assert "no leader" in [name for name, _, _ in layout(drill("site")).legend]


def _samples(*states: str) -> list[Sample]:
    return [Sample(10.0 + i, "c:1", state) for i, state in enumerate(states)]


@pytest.mark.parametrize("states, fenced_at, expected", [
    (("RUNNING",), None, [(0, 0.5, "RUNNING")]),
    (("PENDING", "RUNNING", "RUNNING"), None,
     [(0, 1, "PENDING"), (1, 2.5, "RUNNING")]),
    (("RUNNING", "UNREACHABLE", "RUNNING"), None,
     [(0, 1, "RUNNING"), (1, 2, "UNREACHABLE"), (2, 2.5, "RUNNING")]),
    (("RUNNING", "RUNNING", "CANCELLED"), 1.5, [(0, 1.5, "RUNNING")]),   # cut at the fence
    (("RUNNING", "CANCELLED", "CANCELLED"), 2.0, [(0, 1, "RUNNING"), (1, 2, "CANCELLED")]),
    (("RUNNING", "CANCELLED"), 0.0, []),
])
def test_state_bars_run_from_each_state_to_the_next(states, fenced_at, expected):
    bars = state_bars(0, _samples(*states), 10.0, fenced_at)
    assert [(b.begin, b.end, b.state) for b in bars] == expected
    assert all(b.colour == COLOURS[b.state] for b in bars)


@pytest.mark.parametrize("events, lanes, aligns", [
    ([("a", 10, "k"), ("b", 50, "k")], [0, 0], ["left", "left"]),     # far apart: one lane
    ([("a", 10, "k"), ("b", 11, "k"), ("c", 12, "k")], [0, 1, 2], ["left"] * 3),
    ([("a", 10, "k"), ("b", 11, "k"), ("c", 30, "k")], [0, 1, 0], ["left"] * 3),
    ([("at the end", 99, "k")], [0], ["right"]),                        # would run off
])
def test_event_labels_take_the_lowest_lane_they_overlap_nothing_on(events, lanes, aligns):
    marks = place_marks(events, 100.0, 10.0)  # 10 s an inch: 'a' is about 1 s wide
    assert [m.lane for m in marks] == lanes
    assert [m.align for m in marks] == aligns


@pytest.mark.parametrize("name", DRILLS)
def test_no_two_event_labels_on_a_lane_overlap_and_all_stay_on_the_axis(name):
    timeline = layout(DRILLS[name])
    extents = [(m.lane, m.extent(timeline.seconds_per_in)) for m in timeline.marks]
    for lane, (low, high) in extents:
        assert 0 <= low and high <= timeline.end
        assert all(h <= low or lo >= high for other, (lo, h) in extents
                   if other == lane and (lo, h) != (low, high))


@pytest.mark.parametrize("name, rows", [
    ("cluster", ["onprem:5 @ home", "rented:77 @ remote"]),
    ("one site", ["onprem:5", "rented:77"]),                 # one site: not named
    ("replicated", ["onprem:5 @ home", "rented:77 @ remote", LEADER_ROW]),
    ("site", ["onprem:5 @ home", "rented:77 @ remote", LEADER_ROW]),
])
def test_sites_and_the_leader_are_shown_when_there_are_several(name, rows):
    assert layout(DRILLS[name]).rows == rows


def test_the_leader_row_shows_who_led_and_the_gap_between():
    leader = bars_of(drill("site"), 2)
    assert [(b.begin, b.end, b.text) for b in leader] == [
        (0, KILL - 0.5, "home"), (KILL - 0.5, KILL + 5.5, ""),
        (KILL + 5.5, STOPPED - 0.5, "control")]
    assert leader[1].hatch


def _drawn_texts(figure) -> list:
    """Every text the renderer draws: matplotlib keeps tick labels outside the axis's
    limits too, undrawn."""
    axes = figure.axes[0]
    low, high = axes.get_xlim()
    ticks = [label for tick, label in zip(axes.get_xticks(), axes.get_xticklabels(),
                                          strict=True) if low <= tick <= high]
    texts = [*figure.texts, *axes.texts, axes.xaxis.label, *ticks, *axes.get_yticklabels(),
             *figure.legends[0].get_texts()]
    return [t for t in texts if t.get_visible() and t.get_text().strip()]


def _extent(artist, renderer):
    return artist.get_window_extent(renderer)


@pytest.mark.parametrize("name", DRILLS)
def test_the_drawing_clips_no_text_and_its_legend_covers_no_bar(name):
    figure = render(layout(DRILLS[name]))
    try:
        figure.canvas.draw()
        renderer = figure.canvas.get_renderer()
        canvas = figure.bbox
        axes = figure.axes[0]
        for text in _drawn_texts(figure):
            box = _extent(text, renderer)
            assert canvas.x0 <= box.x0 and box.x1 <= canvas.x1, text.get_text()
            assert canvas.y0 <= box.y0 and box.y1 <= canvas.y1, text.get_text()
        bars = [_extent(p, renderer) for p in axes.patches]
        legend = _extent(figure.legends[0], renderer)
        assert not any(legend.overlaps(bar) for bar in bars)
        labels = [_extent(t, renderer) for t in axes.texts if t.get_color() != "white"]
        assert not any(a.overlaps(b) for i, a in enumerate(labels) for b in labels[i + 1:])
        for text in (t for t in axes.texts if t.get_color() == "white"):  # inside its bar
            inside = _extent(text, renderer)
            assert any(bar.x0 <= inside.x0 and inside.x1 <= bar.x1 for bar in bars)
        left = figure.axes[0].get_window_extent(renderer).x0
        assert all(_extent(t, renderer).x1 <= left for t in axes.get_yticklabels())
    finally:
        from matplotlib import pyplot
        pyplot.close(figure)


def test_the_picture_is_written_as_a_png(tmp_path):
    path = draw_timeline(drill("site"), tmp_path / "timeline.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
