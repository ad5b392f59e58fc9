"""Issue 28, 5: an incarnation's lease secret is a one-time bootstrap. Its first lease's
reply hands it a session secret (over TLS); once that is used, the bootstrap secret, the
one slurmdbd's records and /proc/PID/environ keep, speaks for nothing, but for a restart
Slurm's own record says the job was requeued to."""

from __future__ import annotations

import json

import pytest

from slurm_geo.federation.access.sessions import Step, decide
from slurm_geo.federation.state.identities import IncarnationSecrets
from slurm_geo.lease.protocol import ENV_LEASE_SECRET, LEASE_PATH, LeaseRequest
from slurm_geo.lease.signing import Credentials, SecretSigner, secret_bytes
from tests.kit.federation import Site, dump

B, S, NEW = "b" * 64, "5" * 64, "7" * 64
FRESH = IncarnationSecrets(B)
ISSUED = IncarnationSecrets(B, S, 0)
USED = IncarnationSecrets(B, S, 0, confirmed=True)


@pytest.mark.parametrize("secrets, bootstrap, restart, issue, slurm, step, after", [
    (FRESH, True, 0, True, None, Step.ISSUE, IncarnationSecrets(B, NEW, 0)),  # first lease
    (FRESH, True, 0, False, None, Step.NOTHING, None),    # a key request issues nothing
    (ISSUED, True, 0, True, None, Step.HAND_OUT, ISSUED),  # its reply was lost
    (ISSUED, False, 0, True, None, Step.CONFIRM, USED),     # the session is used
    (USED, False, 0, True, None, Step.NOTHING, None),
    (USED, True, 0, True, None, Step.REFUSE, None),         # what slurmdbd keeps
    (USED, True, 0, False, None, Step.REFUSE, None),
    (IncarnationSecrets(B, S, 2, True), True, 1, True, None, Step.REFUSE, None),
    (USED, True, 1, True, None, Step.ASK_SLURM, None),      # a requeue? Slurm says
    (USED, True, 1, True, 0, Step.REFUSE, None),            # it was not
    (USED, True, 1, True, 1, Step.ISSUE, IncarnationSecrets(B, NEW, 1)),  # it was
    (ISSUED, True, 1, True, 1, Step.ISSUE, IncarnationSecrets(B, NEW, 1)),
])
def test_what_a_request_does_to_an_incarnations_secrets(secrets, bootstrap, restart, issue,
                                                         slurm, step, after):
    decision = decide(secrets, bootstrap, restart, issue, slurm, NEW)
    assert decision.step is step
    if after is not None:
        assert decision.secrets == after
    assert (decision.reason != "") is (step is Step.REFUSE)


@pytest.mark.parametrize("secrets", [FRESH, ISSUED, USED, IncarnationSecrets(B, S, 3)])
def test_the_secrets_round_trip_through_the_state_field(secrets):
    assert IncarnationSecrets.parse(secrets.to_text()) == secrets
    assert IncarnationSecrets.parse(B) == FRESH  # as minted at submission


def signed(site: Site, logical: str, secret: str, away_id: int, restart: int = 0):
    request = LeaseRequest("run-a", "rented", away_id, restart, 1, None)
    body = json.dumps(request.to_json()).encode()
    headers = SecretSigner(logical, 1, secret_bytes(secret), clock=site.clock).headers(
        "POST", LEASE_PATH, body)
    return site.federation.lease(request, Credentials.from_headers(headers, "POST",
                                                                   LEASE_PATH, body))


def test_the_bootstrap_secret_slurmdbd_keeps_is_worthless_once_the_job_started(tmp_path):
    site = Site(tmp_path)
    _, away_id = site.moved_away()
    site.rented.start(away_id)
    (_, spec), = site.rented.submitted
    bootstrap = spec.environment[ENV_LEASE_SECRET]  # what slurmdbd and /proc keep
    logical = site.job().logical_job
    first = signed(site, logical, bootstrap, away_id)
    assert first.status == 200 and first.body["verdict"] == "grant"
    session = first.body["session_secret"]
    assert len(session) == 64 and session != bootstrap
    again = signed(site, logical, bootstrap, away_id)  # its reply lost: the same again
    assert again.status == 200 and again.body["session_secret"] == session
    used = signed(site, logical, session, away_id)
    assert used.status == 200 and "session_secret" not in used.body
    before = dump(site)
    for restart in (0, 1):  # nor for a requeue Slurm did not make
        stolen = signed(site, logical, bootstrap, away_id, restart=restart)
        assert stolen.status == 401, stolen.body
        assert stolen.body["reason"] and stolen.refusal is not None
    key = site.key("rented", away_id, 1, token=spec.environment["SLURM_GEO_KEY_TOKEN"])
    assert key.status == 200  # signed with the session secret (Site signs as the client)
    assert dump(site)["leases"] == before["leases"]
    # Slurm requeues the job: it starts again with its environment, so its bootstrap
    # secret speaks for restart 1, and gets that restart a session of its own.
    site.rented.requeue(away_id)
    site.clock.advance(site.config.federation.lease_ttl_s + 1)  # the old lease ran out
    requeued = signed(site, logical, bootstrap, away_id, restart=1)
    assert requeued.status == 200, requeued.body
    assert requeued.body["session_secret"] not in (session, bootstrap)
