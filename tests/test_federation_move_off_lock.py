"""A move that carries and verifies a checkpoint holds no lock other jobs' trainers need:
their lease renewals are answered while the move is parked inside its copy and inside
its verification.

Before the daemon was rebuilt, `_move` held the daemon's single lock while it copied and
verified; with a 100 GB checkpoint every federated trainer of the site stopped training
until the move ended. Here the destination store parks the move at its first put (the
copy) and at its first read after the copy (the verification) until the test lets it go,
so "answered during the move" needs no clock: a renewal that needed the move's lock could
not be answered at all while the move is parked. (The latencies over a paced 1 GiB move
are in docs/benchmarks.md.)"""

from __future__ import annotations

import threading

from slurm_geo.ckpt.stores.store import Bytes, Store
from slurm_geo.federation.model import JobStatus
from tests.kit.federation import Site

# Only a deadlock waits this long; a renewal answered off the lock takes milliseconds.
DEADLOCK_S = 60.0


def moving() -> bool:
    return threading.current_thread().name == "move"


class ParkingStore:
    """`inner`, parking the move's thread (named "move") at its first put and at its
    first get after a put until `release` is set."""

    def __init__(self, inner: Store):
        self.inner = inner
        self.parked = threading.Event()
        self.release = threading.Event()
        self.parked_in: list[str] = []
        self._put_seen = False

    def _park(self, phase: str) -> None:
        self.parked_in.append(phase)
        self.release.clear()
        self.parked.set()
        assert self.release.wait(DEADLOCK_S), f"the test never released the {phase}"

    def put(self, name: str, data: Bytes) -> None:
        if moving() and not self._put_seen:
            self._put_seen = True
            self._park("copy")
        self.inner.put(name, data)

    def get(self, name: str) -> bytes:
        if moving() and self._put_seen and "verify" not in self.parked_in:
            self._park("verify")
        return self.inner.get(name)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def renew_while_parked(site: Site, job_id: int, destination: ParkingStore) -> str:
    """The other job's renewal, asked while the move is parked; its verdict."""
    assert destination.parked.wait(DEADLOCK_S), "the move never reached the store"
    destination.parked.clear()
    replies: list[dict] = []
    renewal = threading.Thread(
        target=lambda: replies.append(site.lease("onprem", job_id, run="run-b")))
    renewal.start()
    renewal.join(DEADLOCK_S)
    parked_still = not destination.release.is_set()
    destination.release.set()
    assert not renewal.is_alive(), "the renewal waited for the parked move"
    assert parked_still
    return replies[0]["verdict"]


def test_lease_renewals_are_answered_while_a_move_is_parked_in_its_copy_and_its_verify(
        tmp_path):
    site = Site(tmp_path)
    destination = ParkingStore(site.stores["away"])
    site.federation.wiring.paced_stores["away"] = destination
    mover_id = site.home_job_training(failover="manual")
    other_id = site.submit_home()
    site.start_home(other_id)
    site.tick()
    site.checkpoint("pfs", 100)
    mover = site.state.find_job("onprem", mover_id)
    assert mover is not None
    site.federation.approve(mover.logical_job, "rented", "operator")
    site.lease("onprem", mover_id, last_step=100, release=True)  # it stops at a checkpoint

    move = threading.Thread(target=site.federation.tick, name="move")
    move.start()
    verdicts = [renew_while_parked(site, other_id, destination),
                renew_while_parked(site, other_id, destination)]
    move.join(DEADLOCK_S)
    assert not move.is_alive()

    assert destination.parked_in == ["copy", "verify"]
    assert verdicts == ["grant", "grant"]
    moved = site.state.job(mover.logical_job)
    assert (moved.cluster, moved.generation, moved.resume_step, moved.status) == (
        "rented", 1, 100, JobStatus.RUNNING)
