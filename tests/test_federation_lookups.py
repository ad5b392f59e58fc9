"""Issue 28, 3: a caller cannot make the root daemon ask Slurm about jobs without bound.
A job id Slurm did not know is answered 404 from memory for a while, and each caller has
a budget of lookups (429 past it); both are refusals, audited as such, and change nothing."""

from __future__ import annotations

import pytest

from slurm_geo.federation.access.lookups import (
    LookupLimits,
    SlurmLookups,
    TooManyLookups,
    UnknownJob,
)
from tests.kit.clock import ManualClock
from tests.kit.federation import Site, dump

LIMITS = LookupLimits(not_found_ttl_s=10, lookups=3, lookups_per_s=0.5, max_entries=2)


# (seconds since the start, caller, job id, Slurm knows it?) -> answer
@pytest.mark.parametrize("script, answers", [
    ([(0, "bob", 7, False), (1, "bob", 7, False)], ["asked", 404]),     # remembered
    ([(0, "bob", 7, False), (11, "bob", 7, True)], ["asked", "asked"]),  # forgotten in 10 s
    ([(0, "bob", 1, True), (0, "bob", 2, True), (0, "bob", 3, True), (0, "bob", 4, True)],
     ["asked", "asked", "asked", 429]),                                # a burst of 3
    ([(0, "bob", 1, True), (0, "bob", 2, True), (0, "bob", 3, True), (2, "bob", 4, True)],
     ["asked", "asked", "asked", "asked"]),                            # refilled 0.5 a s
    ([(0, "bob", 1, True), (0, "bob", 2, True), (0, "bob", 3, True), (0, "alice", 4, True)],
     ["asked", "asked", "asked", "asked"]),                            # a budget each
    ([(0, "bob", 1, False), (0, "bob", 2, False), (0, "bob", 3, False), (1, "bob", 1, True)],
     ["asked", "asked", "asked", 429]),     # at most 2 ids remembered: 1 forgotten, asked
])
def test_what_a_caller_may_make_the_daemon_ask_slurm(script, answers):
    clock = ManualClock(0.0)
    lookups = SlurmLookups(clock, LIMITS)
    got = []
    for at, caller, job_id, known in script:
        clock.now = at
        try:
            lookups.may_ask(caller, "onprem", job_id)
        except (UnknownJob, TooManyLookups) as refused:
            got.append(refused.status)
            continue
        got.append("asked")
        if not known:
            lookups.not_found("onprem", job_id)
    assert got == answers


def test_bobs_flood_of_unknown_job_ids_forks_a_bounded_number_of_slurm_commands(tmp_path):
    site = Site(tmp_path)
    alice_id = site.home_job_training()
    asked: list[int] = []
    real_job = site.onprem.job

    def counted(job_id: int):
        asked.append(job_id)
        return real_job(job_id)
    site.onprem.job = counted  # the squeue (and sacct) of a lookup
    before = dump(site)
    replies = [site.lease_reply("onprem", 90_000 + n % 80, as_user="bob") for n in range(555)]
    statuses = [r.status for r in replies]
    assert set(statuses) == {404, 429}, statuses
    assert len(asked) <= 60 + 1  # his burst, whatever he sends (refills: 1 a second)
    assert all(r.body.get("reason") and r.refusal is not None for r in replies)
    assert replies[0].refusal.what == "refused a lease to onprem:90000 (404)"
    assert "too many jobs" in next(r for r in replies if r.status == 429).body["reason"]
    assert "has no job" in next(r for r in replies[80:] if r.status == 404).body["reason"]
    assert dump(site) == before
    # alice is not held up by bob: her own job is known, and her budget is her own.
    assert site.lease("onprem", alice_id)["verdict"] == "grant"
    fresh = site.submit_home()
    site.start_home(fresh)
    assert site.lease("onprem", fresh, run="alices-second")["verdict"] == "grant"
