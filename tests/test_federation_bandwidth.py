"""The bandwidth model: EWMA of rates, overhead from tiny transfers, predictions."""

from __future__ import annotations

import pytest

from slurm_geo.federation.decide.bandwidth import BandwidthModel, Throughput

GB = 10**9
MIB = 2**20

# (id, observations (nbytes, seconds), expected bits/s, expected overhead_s)
CASES = [
    ("first-sample-as-is", [(GB, 8.0)], 1e9, 0.0),
    # Weighted by bytes: evidence 1 GB, then 0.7 + 1 = 1.7 GB, then 0.7 * 1.7 + 1 GB.
    ("second-weighs-1-of-1.7", [(GB, 8.0), (GB, 4.0)], 1e9 + 1e9 / 1.7, 0.0),
    ("three-samples", [(GB, 8.0), (GB, 4.0), (GB, 10.0)],
     (two := 1e9 + 1e9 / 1.7) + (0.8e9 - two) / (0.7 * 1.7 + 1), 0.0),
    # A 4 MiB probe's rate gives way to a checkpoint's hundred times its size,
    ("probe-then-checkpoint", [(4 * MIB, 0.02), (400 * MIB, 8 * 400 * MIB / 1.6e9)],
     (probe := 8 * 4 * MIB / 0.02) + (1.6e9 - probe) * 400 / (0.7 * 4 + 400), 0.0),
    # and to one at under half its rate entirely: the checkpoint's says what the link is.
    ("probe-then-a-much-slower-checkpoint", [(4 * MIB, 0.01),
                                              (400 * MIB, 8 * 400 * MIB / 1.6e9)],
     1.6e9, 0.0),
    # A checkpoint at a quarter of the rate: the link changed, the estimate starts over.
    ("a-changed-link-starts-over", [(400 * MIB, 8 * 400 * MIB / 1.6e9),
                                    (400 * MIB, 8 * 400 * MIB / 0.4e9)], 0.4e9, 0.0),
    # At half the rate, or from a probe at a quarter, it is weighed as any sample.
    ("half-the-rate-is-weighed", [(400 * MIB, 8 * 400 * MIB / 1.6e9),
                                  (400 * MIB, 8 * 400 * MIB / 0.8e9)],
     1.6e9 - 0.8e9 / 1.7, 0.0),
    ("a-slow-probe-starts-nothing", [(400 * MIB, 8 * 400 * MIB / 1.6e9),
                                     (4 * MIB, 8 * 4 * MIB / 0.4e9)],
     1.6e9 - 1.2e9 * 4 / (0.7 * 400 + 4), 0.0),
    # and a checkpoint's rate is barely moved by a probe after it.
    ("checkpoint-then-probe", [(400 * MIB, 8 * 400 * MIB / 1.6e9), (4 * MIB, 0.01)],
     1.6e9 + (8 * 4 * MIB / 0.01 - 1.6e9) * 4 / (0.7 * 400 + 4), 0.0),
    ("tiny-first-is-all-overhead", [(1000, 0.2), (GB, 8.0)], 8e9 / 7.8, 0.2),
    ("tiny-after-rate-subtracts-moving-time", [(GB, 8.0), (1000, 0.1)], 1e9,
     0.1 - 8000 / 1e9),
    ("overhead-smoothed", [(0, 0.1), (0, 0.2)], None, 0.3 * 0.2 + 0.7 * 0.1),
    ("overhead-never-halves-more", [(0, 10.0), (GB, 8.0)], 2e9, 10.0),
    ("boundary-64KiB-is-a-rate", [(64 * 1024, 0.5)], 64 * 1024 * 8 / 0.5, 0.0),
    ("just-below-64KiB-is-overhead", [(64 * 1024 - 1, 0.5)], None, 0.5),
]


@pytest.mark.parametrize("observations, rate, overhead",
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_observe(observations, rate, overhead):
    model = BandwidthModel()
    for nbytes, seconds in observations:
        result = model.observe("pfs", "offsite", nbytes, seconds)
    estimate = model.estimate("pfs", "offsite")
    assert result == estimate
    if rate is None:
        assert estimate is None
    else:
        assert estimate is not None and estimate.bits_per_s == pytest.approx(rate)
    assert model.overhead_s("pfs", "offsite") == pytest.approx(overhead)


def test_predict_seconds():
    model = BandwidthModel()
    assert model.predict_seconds("pfs", "offsite", GB) is None     # never measured
    model.observe("pfs", "offsite", 0, 0.5, probe=True)
    assert model.predict_seconds("pfs", "offsite", GB) is None     # latency only
    model.observe("pfs", "offsite", 10 * GB, 80.5)                 # 80 s at 1 Gbit/s
    assert model.predict_seconds("pfs", "offsite", 50 * GB) == pytest.approx(400.5)
    assert model.predict_seconds("pfs", "pfs", 50 * GB) == 0.0     # same store
    assert model.predict_seconds("pfs", "offsite", 0) == 0.0       # nothing to move
    assert model.predict_seconds("offsite", "pfs", GB) is None     # directions differ


def test_samples_of_one_size_settle_at_weight_alpha():
    """After many samples of one size the newest weighs alpha, as a plain average's."""
    model = BandwidthModel(alpha=0.3)
    for _ in range(60):
        model.observe("a", "b", GB, 8.0)                    # 1 Gbit/s
    model.observe("a", "b", GB, 4.0)                        # 2 Gbit/s
    estimate = model.estimate("a", "b")
    assert estimate is not None and estimate.bits_per_s == pytest.approx(1.3e9)


def test_a_snapshot_without_evidence_weighs_as_one_small_sample():
    """Rows persisted before the bytes weighting: their rate gives way at once to a
    transfer of real size."""
    model = BandwidthModel()
    model.observe("a", "b", GB, 8.0)
    row = model.snapshot()[0]
    del row["evidence_bytes"]
    again = BandwidthModel.restore([row])
    again.observe("a", "b", GB, 4.0)
    estimate = again.estimate("a", "b")
    assert estimate is not None and estimate.bits_per_s == pytest.approx(2e9, rel=1e-3)


def test_samples_and_alpha():
    model = BandwidthModel(alpha=1.0)          # alpha 1: the newest sample only
    model.observe("a", "b", 1000, 0.5)         # overhead 0.5 s; not a rate sample
    model.observe("a", "b", GB, 8.0, probe=True)
    model.observe("a", "b", GB, 2.5)           # 2.0 s of moving after the overhead
    assert model.estimate("a", "b") == Throughput("a", "b", 4e9, 2)
    assert model.snapshot()[0]["probe_samples"] == 1


@pytest.mark.parametrize("source, destination, nbytes, seconds, message", [
    ("a", "b", GB, 0.0, "seconds must be"),
    ("a", "b", GB, -1.0, "seconds must be"),
    ("a", "b", GB, float("nan"), "seconds must be"),
    ("a", "b", GB, float("inf"), "seconds must be"),
    ("a", "b", -1, 1.0, "nbytes must be"),
    ("a", "a", GB, 1.0, "to itself"),
])
def test_observe_rejects_nonsense(source, destination, nbytes, seconds, message):
    model = BandwidthModel()
    with pytest.raises(ValueError, match=message):
        model.observe(source, destination, nbytes, seconds)
    assert model.snapshot() == []


@pytest.mark.parametrize("kwargs", [{"alpha": 0.0}, {"alpha": 1.5}, {"min_bytes": -1}])
def test_bad_settings(kwargs):
    with pytest.raises(ValueError):
        BandwidthModel(**kwargs)


def test_snapshot_and_restore_round_trip():
    model = BandwidthModel()
    model.observe("pfs", "offsite", GB, 8.0)
    model.observe("pfs", "offsite", 100, 0.05, probe=True)
    model.observe("offsite", "pfs", 10, 0.3)
    rows = model.snapshot()
    assert [(r["source"], r["destination"]) for r in rows] == [("offsite", "pfs"),
                                                              ("pfs", "offsite")]
    assert rows[0]["bits_per_s"] is None and rows[1]["probe_samples"] == 1
    again = BandwidthModel.restore(rows)
    assert again.snapshot() == rows
    assert again.predict_seconds("pfs", "offsite", GB) == model.predict_seconds(
        "pfs", "offsite", GB)


@pytest.mark.parametrize("change, message", [
    ({"bits_per_s": 0.0}, "bits_per_s must be > 0"),
    ({"overhead_s": -1.0}, "overhead_s must be >= 0"),
    ({"evidence_bytes": -1.0}, "evidence_bytes must be >= 0"),
    ({"samples": None}, None),
])
def test_restore_rejects_bad_rows(change, message):
    model = BandwidthModel()
    model.observe("a", "b", GB, 1.0)
    row = {**model.snapshot()[0], **change}
    if change == {"samples": None}:
        del row["samples"]
        message = "missing samples"
    with pytest.raises(ValueError, match=message):
        BandwidthModel.restore([row])
