"""Streams and part sizes from a link's rate and round trip (ckpt.transfer_plan), pure; and
the bounded pool that runs transfers a few at once (ckpt.parallel)."""

from __future__ import annotations

import math
import threading
import time

import pytest

from slurm_geo.ckpt.stores.parallel import run_all
from slurm_geo.ckpt.stores.transfer_plan import (
    DEFAULT_PLAN,
    MAX_PARTS,
    MAX_STREAMS,
    MIB,
    MIN_PART_SIZE,
    UNKNOWN_LINK_PLAN,
    TransferPlan,
    plan_transfers,
)

MBIT = 1e6 / 8  # bytes a second
GIB = 1024 * MIB


@pytest.mark.parametrize("rate, rtt_s, window, streams, part_size", [
    # The sandbox's WAN: no latency; one stream would fill it but for each PUT's
    # turnaround, which a second object in flight hides (0.86-0.89 of 200 Mbit/s with one,
    # 0.92-0.93 with two: bench/stage_wan.py).
    (200 * MBIT, 0.0, None, 2, 8 * MIB),
    # 200 Mbit/s at [sync] wan_rtt_ms's default: the product (0.5 MB) fits one window;
    # two streams all the same (above), parts at the floor.
    (200 * MBIT, 0.020, None, 2, 8 * MIB),
    # Two streams, each with parts that take 20 round trips to send: 6.25 MB/s * 80 ms /
    # 5 %, in whole MiB.
    (100 * MBIT, 0.080, None, 2, 10 * MIB),
    # 10 MB in flight: three 4 MiB windows, each stream at 41.7 MB/s.
    (1000 * MBIT, 0.080, None, 3, 64 * MIB),
    # 62.5 MB in flight: 15 streams of 83.3 MB/s; parts 20 round trips long.
    (10_000 * MBIT, 0.050, None, 15, 80 * MIB),
    # 250 MB in flight needs 60: clamped; each stream then at its window's 21 MB/s.
    (10_000 * MBIT, 0.200, None, MAX_STREAMS, 80 * MIB),
    # A host whose sockets have 16 MiB windows needs a quarter of the streams.
    (10_000 * MBIT, 0.050, 16 * MIB, 4, 299 * MIB),
    # Nothing known: two streams (each put ends with its checks), default parts.
    (None, 0.050, None, 2, 8 * MIB),
    (0.0, 0.050, None, 2, 8 * MIB),
    (10_000 * MBIT, None, None, 2, 8 * MIB),
], ids=["200mbit-lan", "200mbit-20ms", "100mbit-80ms", "1gbit-80ms", "10gbit-50ms",
        "10gbit-200ms-clamped", "10gbit-50ms-big-window", "rate-unknown", "no-cap",
        "rtt-unknown"])
def test_streams_cover_the_bandwidth_delay_product_and_parts_amortise_the_round_trip(
        rate, rtt_s, window, streams, part_size):
    plan = plan_transfers(rate, rtt_s) if window is None else \
        plan_transfers(rate, rtt_s, window)
    assert (plan.streams, plan.part_size) == (streams, part_size)
    assert plan.multipart_threshold == DEFAULT_PLAN.multipart_threshold  # packs: one PUT


def test_an_unknown_link_sends_two_objects_at_once():
    """Each put ends with its checks (issue 32: verified as written): a second object in
    flight keeps the link busy meanwhile, whatever its rate."""
    assert plan_transfers(None, None) == UNKNOWN_LINK_PLAN == TransferPlan(2, 8 * MIB, 64 * MIB)
    assert DEFAULT_PLAN == TransferPlan(1, 8 * MIB, 64 * MIB)  # a store with no link in mind


@pytest.mark.parametrize("plan, size, part_size", [
    (DEFAULT_PLAN, 64 * MIB, 8 * MIB),                     # one stream: the plan's size
    (DEFAULT_PLAN, 2**40, math.ceil(2**40 / MAX_PARTS)),    # 1 TiB: no more than 10,000
    (TransferPlan(4, 80 * MIB), 1 * GIB, 80 * MIB),         # enough for every stream
    (TransferPlan(4, 80 * MIB), 64 * MIB, 16 * MIB),        # smaller: one part a stream
    (TransferPlan(4, 80 * MIB), 12 * MIB, MIN_PART_SIZE),   # never below S3's minimum
    (TransferPlan(15, 80 * MIB), 64 * MIB, MIN_PART_SIZE),
    (TransferPlan(1, MIN_PART_SIZE, MIN_PART_SIZE), 3 * MIN_PART_SIZE + 1000, MIN_PART_SIZE),
])
def test_an_objects_part_size_splits_it_over_the_streams_within_s3s_limits(plan, size,
                                                                            part_size):
    assert plan.part_size_for(size) == part_size


@pytest.mark.parametrize("streams", [1, 3, 16])
@pytest.mark.parametrize("size", [64 * MIB, 100 * MIB + 1, 5 * GIB, 2**40, 50 * 2**40])
def test_every_part_is_within_s3s_limits(streams, size):
    part_size = TransferPlan(streams, 80 * MIB).part_size_for(size)
    parts = math.ceil(size / part_size)
    assert part_size >= MIN_PART_SIZE and parts <= MAX_PARTS
    assert parts >= min(streams, size // MIN_PART_SIZE)


@pytest.mark.parametrize("options, message", [
    ({"streams": 0}, "streams must be 1 to 16"),
    ({"streams": MAX_STREAMS + 1}, "streams must be 1 to 16"),
    ({"part_size": MIB}, "at least"),
])
def test_a_plan_outside_s3s_limits_is_refused(options, message):
    with pytest.raises(ValueError, match=message):
        TransferPlan(**options)


# --- run_all ----------------------------------------------------------------------------------

def test_items_run_at_most_workers_at_once_and_results_keep_their_order():
    together = threading.Barrier(3, timeout=10)  # passes only if three run at once
    lock, running, most, finished_in = threading.Lock(), [0], [0], []

    def work(item: int) -> int:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        if item < 3:
            together.wait()
        time.sleep(0.01)
        with lock:
            running[0] -= 1
        return item * 10

    results = run_all(work, list(range(9)), 3,
                      on_done=lambda item, _r: finished_in.append(threading.current_thread()))
    assert results == [i * 10 for i in range(9)] and most[0] == 3
    assert finished_in == [threading.current_thread()] * 9


def test_one_worker_runs_everything_in_the_calling_thread_in_order():
    seen = []
    run_all(lambda item: seen.append((item, threading.current_thread())), [1, 2, 3], 1)
    assert seen == [(i, threading.current_thread()) for i in (1, 2, 3)]


def test_the_first_failure_stops_the_items_not_started_and_waits_for_the_running_ones():
    lock, started, finished = threading.Lock(), set(), set()

    def work(item: int) -> int:
        with lock:
            started.add(item)
        if item == 0:
            raise ValueError("item 0")
        time.sleep(0.5)  # long enough for the failure to cancel the rest first
        with lock:
            finished.add(item)
        return item

    with pytest.raises(ValueError, match="item 0"):
        run_all(work, list(range(10)), 2)
    assert started <= {0, 1, 2} and finished == started - {0}
