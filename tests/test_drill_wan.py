"""Bytes over the WAN per checkpoint from the link's own counters (drills.wan): which
readings bracket a checkpoint's replication, and what they say (pure); the watch's
readings, with a counter that counts."""

from __future__ import annotations

import time

import pytest

from slurm_geo.drills.wan import LinkWatch, Reading, Window, per_checkpoint
from slurm_geo.sandbox.sites import WanLink
from slurm_geo.sandbox.wire import EndBytes, LinkBytes


def link(out: int, back: int) -> LinkBytes:
    """The home-remote link after `out` bytes went home to remote, `back` the other way."""
    return LinkBytes(WanLink.HOME_REMOTE, EndBytes(out, back), EndBytes(back, out))


def reading(at: float, out: int, back: int = 0) -> Reading:
    return Reading(at, at + 0.01, link(out, back))


# Counters every 2 s: a checkpoint crossed 100..104 (1000 bytes out, 10 back), another
# 110..113 (500 out, 5 back); 1 byte of chatter in between.
READINGS = [reading(98, 0), reading(100, 0), reading(102, 600, 6), reading(104, 1000, 10),
            reading(106, 1000, 10), reading(108, 1001, 10), reading(110, 1001, 10),
            reading(112, 1400, 14), reading(114, 1501, 15)]


@pytest.mark.parametrize("window, wan", [
    (Window(10, 100.5, 103.9, 1000, 4.0), (1010, 1000, 10)),  # readings 100 and 104
    (Window(10, 100.0, 104.0, 1000, 4.0), (1010, 1000, 10)),  # 98 and 104: read after 100
    (Window(20, 110.2, 113.0, 500, 3.0), (505, 500, 5)),      # 110 and 114
    (Window(10, 99.0, 113.5, 1500, 4.0), (1516, 1501, 15)),   # 98 and 114, chatter too
    (Window(30, 115.0, 118.0, 7, 1.0), (None, None, None)),   # nothing read after it
    (Window(30, 90.0, 95.0, 7, 1.0), (None, None, None)),     # nor before it
    (Window(30, None, 104.0, 7, 1.0), (None, None, None)),    # never started
    (Window(30, 100.5, None, 7, None), (None, None, None)),   # never verified
])
def test_a_checkpoints_bytes_are_those_between_the_readings_around_its_replication(
        window, wan):
    [row] = per_checkpoint(READINGS, [window])

    assert (row["wan_bytes"], row["wan_out"], row["wan_back"]) == wan
    assert (row["step"], row["stored_bytes"], row["lag_s"]) == \
        (window.step, window.stored_bytes, window.lag_s)


def test_no_readings_measure_nothing():
    assert per_checkpoint([], [Window(10, 1.0, 2.0, 5, 1.0)])[0]["wan_bytes"] is None


def test_the_watch_reads_at_its_start_meanwhile_and_at_its_stop_and_skips_failures():
    sent = iter(range(100))
    failures = {3}

    def read() -> LinkBytes:
        n = next(sent)
        if n in failures:
            raise OSError("ip: no such device")
        return link(n * 100, n)

    watch = LinkWatch(read, every_s=0.01).start()
    deadline = time.time() + 30
    while len(watch.readings) < 5 and time.time() < deadline:
        time.sleep(0.01)
    readings = watch.stop()

    assert readings[0].link == link(0, 0)
    assert all(r.link.a.sent != 300 for r in readings)  # the failed reading left out
    assert all(r.before <= r.after for r in readings)
    assert [r.link.a.sent for r in readings] == sorted(r.link.a.sent for r in readings)
    assert watch.stop() == readings  # stopped once
