"""BreakerStore: after a failure, calls fail at once for a while, then are tried again."""

from __future__ import annotations

import pytest

from slurm_geo.ckpt.errors import ObjectMissing, StoreUnavailable
from slurm_geo.ckpt.stores.breaker import BreakerStore, StoreSkipped
from slurm_geo.ckpt.stores.open_store import DECIDING, open_store
from slurm_geo.ckpt.stores.retry import RetryingStore
from slurm_geo.ckpt.stores.s3store import S3Unavailable
from slurm_geo.ckpt.stores.store import LocalDirStore
from tests.kit.clock import ManualClock


class Flaky:
    """A store whose every call fails with `failure` while it is set; counts calls."""

    def __init__(self):
        self.failure: Exception | None = None
        self.calls = 0
        self.objects: dict[str, bytes] = {}

    def _call(self) -> None:
        self.calls += 1
        if self.failure is not None:
            raise self.failure

    def put(self, name, data):
        self._call()
        self.objects[name] = bytes(data)

    def get(self, name):
        self._call()
        if name not in self.objects:
            raise ObjectMissing(name)
        return self.objects[name]

    def list(self, prefix):
        self._call()
        return sorted(n for n in self.objects if n.startswith(prefix))

    def delete(self, name):
        self._call()
        self.objects.pop(name, None)

    def exists(self, name):
        self._call()
        return name in self.objects


def breaker(open_for_s: float = 3.0) -> tuple[BreakerStore, Flaky, ManualClock]:
    inner, clock = Flaky(), ManualClock(100.0)
    return BreakerStore(inner, "offsite", open_for_s, monotonic=clock), inner, clock


def test_after_a_failure_every_call_fails_at_once_until_the_window_ends():
    store, inner, clock = breaker()
    inner.failure = StoreUnavailable("keys/r", "connect timeout")
    with pytest.raises(StoreUnavailable):
        store.list("manifests/r/")
    assert inner.calls == 1

    clock.now += 2.9
    for call in (lambda: store.exists("keys/r"), lambda: store.get("x"),
                 lambda: store.put("x", b"1"), lambda: store.delete("x"),
                 lambda: store.list("")):
        with pytest.raises(StoreSkipped) as skipped:
            call()
        assert "store 'offsite' failed 2.9 s ago" in str(skipped.value)
    assert inner.calls == 1  # none of them reached the store
    assert isinstance(skipped.value, StoreUnavailable)  # callers treat it as the outage


def test_after_the_window_one_call_goes_through_and_a_success_closes_it():
    store, inner, clock = breaker()
    inner.failure = StoreUnavailable("x", "connect timeout")
    with pytest.raises(StoreUnavailable):
        store.exists("x")
    clock.now += 3.0
    with pytest.raises(StoreUnavailable) as again:  # tried, failed: open anew
        store.exists("x")
    assert not isinstance(again.value, StoreSkipped) and inner.calls == 2
    clock.now += 1.0
    with pytest.raises(StoreSkipped):
        store.exists("x")

    inner.failure = None
    clock.now += 3.0
    store.put("x", b"back")
    assert store.get("x") == b"back" and inner.calls == 4


@pytest.mark.parametrize("answer", [ObjectMissing("x"),
                                    S3Unavailable("x", "b", "AccessDenied", "fix", True)])
def test_an_answer_or_a_permanent_refusal_does_not_open_it(answer):
    store, inner, _clock = breaker()
    inner.failure = answer
    for _ in range(3):
        with pytest.raises(type(answer)):
            store.get("x")
    assert inner.calls == 3


def test_the_deciding_patience_gives_a_breaker_over_two_attempts(tmp_path):
    s3 = open_store("s3://slurm-geo/site", "http://127.0.0.1:9", "us-east-1",
                    patience=DECIDING)
    assert isinstance(s3, BreakerStore) and isinstance(s3.inner, RetryingStore)
    assert "attempts=2" in repr(s3.inner)
    assert isinstance(open_store(f"file://{tmp_path}", patience=DECIDING).inner,
                      LocalDirStore)
    assert isinstance(open_store(f"file://{tmp_path}"), LocalDirStore)  # others: unchanged
