"""Who sends a lease-protocol request, proved by what the sender cannot forge
(slurm_geo.lease.signing): a MUNGE credential of a job the user submitted at home, or the
signature of an incarnation the daemon submitted, under the secret it minted for it.

`Authenticator.authenticate` turns a request's credentials into a `Caller` or refuses
(401/403/503, signing.Refused). What a caller may ask for is the lease service's to
decide, from the job's owner (the uid Slurm's job record names) and the incarnation the
daemon submitted, never from the request's fields.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from slurm_geo.federation.state.identities import IncarnationSecrets
from slurm_geo.federation.state.interface import IdentityStore
from slurm_geo.lease.munge import REPLAYED, BadCredential, Munge, MungeUnavailable
from slurm_geo.lease.signing import (
    SIGNATURE_WINDOW_S,
    CannotCheck,
    Credentials,
    Forbidden,
    NonceCache,
    NotAuthenticated,
    check_signature,
    munge_payload,
    parse_incarnation,
    secret_bytes,
)


@dataclass(frozen=True)
class Caller:
    """A process of `uid` on the home cluster (MUNGE), or incarnation `generation` of
    `logical_job` (its secret)."""

    uid: int | None = None
    logical_job: str | None = None
    generation: int | None = None
    # An incarnation: signed with its bootstrap secret (from its environment), not with the
    # session secret the daemon handed it (federation.sessions decides what that allows).
    bootstrap: bool = False
    # The incarnation's secrets as authentication read them, so the session step
    # (federation.sessions) decides on the same row without reading it again.
    secrets: IncarnationSecrets | None = field(default=None, compare=False, repr=False)

    @property
    def at_home(self) -> bool:
        return self.uid is not None

    def __str__(self) -> str:
        return f"uid {self.uid}" if self.at_home \
            else f"{self.logical_job} generation {self.generation}"


class Authenticator:
    """`clock`: the daemon's wall clock (signatures carry wall-clock timestamps); the
    nonces it remembers start empty, so what was signed before it was made is refused."""

    def __init__(self, identities: IdentityStore, munge: Munge,
                 clock: Callable[[], float], window_s: float = SIGNATURE_WINDOW_S):
        self.identities, self.munge, self.clock = identities, munge, clock
        self.window_s = window_s
        self.refuse_signed_before(clock())

    def refuse_signed_before(self, now: float) -> None:
        """Forget every nonce and refuse what was signed before `now`: at a start, and when
        a replica begins to lead (the nonces of before were checked by another)."""
        # Timestamps are whole seconds: one signed in the second the daemon started passes.
        self.nonces = NonceCache(self.window_s, not_before=math.floor(now))

    def authenticate(self, credentials: Credentials) -> Caller:
        if credentials.munge and credentials.signed:
            raise NotAuthenticated("a request carries one credential: MUNGE or a signature")
        if credentials.munge:
            return self._munge(credentials)
        if credentials.signed:
            return self._signed(credentials)
        raise NotAuthenticated("the request carries no credential (lease protocol 2: a MUNGE "
                               "credential at home, else the incarnation's signature)")

    def _munge(self, credentials: Credentials) -> Caller:
        try:
            decoded = self.munge.decode(credentials.munge)
        except MungeUnavailable as exc:
            raise CannotCheck(f"cannot check the MUNGE credential now: {exc}") from None
        except BadCredential as exc:
            if exc.status == REPLAYED:
                raise Forbidden(f"MUNGE credential refused: {exc}") from None
            raise NotAuthenticated(f"MUNGE credential refused: {exc}") from None
        expected = munge_payload(credentials.method, credentials.path, credentials.body)
        if decoded.payload != expected:
            raise Forbidden("the MUNGE credential was not made for this request (its payload "
                            "is not the digest of this method, path and body)")
        return Caller(uid=decoded.uid)

    def _signed(self, credentials: Credentials) -> Caller:
        """Signed with the incarnation's session secret, else its bootstrap one."""
        logical_job, generation = parse_incarnation(credentials.incarnation)
        stored = self.identities.secret(logical_job, generation)
        if stored is None:
            raise NotAuthenticated(f"no incarnation {credentials.incarnation} holds a secret "
                                   "of this daemon (ended, or never submitted)")
        secrets = IncarnationSecrets.parse(stored)
        now = self.clock()
        try:
            if not secrets.session:
                raise NotAuthenticated("no session secret yet")
            timestamp = check_signature(credentials, secret_bytes(secrets.session), now,
                                        self.window_s)
            bootstrap = False
        except NotAuthenticated:
            timestamp = check_signature(credentials, secret_bytes(secrets.bootstrap), now,
                                        self.window_s)
            bootstrap = True
        self.nonces.first_use(f"{credentials.incarnation} {credentials.nonce}", timestamp, now)
        return Caller(logical_job=logical_job, generation=generation, bootstrap=bootstrap,
                      secrets=secrets)
