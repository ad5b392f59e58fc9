"""How a lease-protocol request proves who sends it (protocol version 2), for both ends:
the trainer's signers and the daemon's checks. Pure but for the clock and the nonces a
signer draws; MUNGE itself is behind slurm_geo.lease.munge's interface.

Two kinds of credential, each in headers (protocol.HEADER_*), each bound to the request's
method, path and body so it cannot be moved onto another request:

- **MUNGE** (a job the user submitted on the home cluster): `munge -s PAYLOAD` with
  PAYLOAD = `munge_payload(method, path, body)`. munged vouches for the uid; the daemon
  decodes it once (munged refuses a replayed credential) and checks the payload.
- **A per-incarnation secret** (an incarnation the daemon submitted, where MUNGE does not
  reach): HMAC-SHA256 under the 32-byte secret over `string_to_sign(...)`: method, path,
  incarnation, timestamp, nonce and sha256(body). The daemon accepts a timestamp within
  SIGNATURE_WINDOW_S of its clock and each nonce once within that window.

Refusals carry the HTTP status the daemon answers with: 401 when the request is not
authenticated (no credential, a bad signature, a stale timestamp, a credential MUNGE
rejects), 403 when it is authentic but not for this (a replay, another uid, another
incarnation), 503 when the daemon cannot check now.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from slurm_geo.lease.munge import Munge
from slurm_geo.lease.protocol import (
    HEADER_INCARNATION,
    HEADER_MUNGE,
    HEADER_NONCE,
    HEADER_SIGNATURE,
    HEADER_TIMESTAMP,
    ProtocolError,
    check_logical_job,
)

SIGNATURE_WINDOW_S = 60.0  # a signed request is accepted this long either side of its time
MAX_NONCES = 100_000       # nonces remembered at once; more in one window: 503
SECRET_BYTES = 32
_NONCE = re.compile(r"[0-9a-f]{32}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_DOMAIN = "slurm-geo-lease/2"


class Refused(Exception):
    """A request the daemon does not serve; `status` is its HTTP answer."""

    status = 401


class NotAuthenticated(Refused):
    status = 401


class Forbidden(Refused):
    status = 403


class CannotCheck(Refused):
    status = 503


def body_digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def munge_payload(method: str, path: str, body: bytes) -> str:
    """What a home job's MUNGE credential carries: it binds this one request."""
    text = f"{_DOMAIN} munge\n{method}\n{path}\n{body_digest(body)}"
    return hashlib.sha256(text.encode()).hexdigest()


def string_to_sign(method: str, path: str, incarnation: str, timestamp: str, nonce: str,
                   body_sha256: str) -> bytes:
    return "\n".join((_DOMAIN, method, path, incarnation, timestamp, nonce,
                      body_sha256)).encode()


def sign(secret: bytes, method: str, path: str, incarnation: str, timestamp: str,
         nonce: str, body_sha256: str) -> str:
    message = string_to_sign(method, path, incarnation, timestamp, nonce, body_sha256)
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def incarnation_id(logical_job: str, generation: int) -> str:
    return f"{logical_job}/{generation}"


def parse_incarnation(text: str) -> tuple[str, int]:
    logical_job, _, generation = text.rpartition("/")
    if not logical_job or not generation.isdigit() or len(generation) > 9:
        raise NotAuthenticated(f"{HEADER_INCARNATION} must be LOGICAL_JOB/GENERATION, "
                               f"not {text!r:.60}")
    try:
        check_logical_job(logical_job)
    except ProtocolError as exc:
        raise NotAuthenticated(f"{HEADER_INCARNATION}: {exc}") from None
    return logical_job, int(generation)


def new_secret() -> str:
    """A per-incarnation secret, as the daemon mints it and the job's environment holds it."""
    return secrets.token_hex(SECRET_BYTES)


def secret_bytes(text: str) -> bytes:
    if not _HEX64.fullmatch(text):
        raise ValueError("a lease secret is 64 lower-case hex digits")
    return bytes.fromhex(text)


@dataclass(frozen=True)
class Credentials:
    """What one request carries to prove who sends it, as the daemon received it."""

    method: str
    path: str
    body: bytes
    munge: str = ""
    incarnation: str = ""
    timestamp: str = ""
    nonce: str = ""
    signature: str = ""

    @classmethod
    def from_headers(cls, headers: Any, method: str, path: str, body: bytes) -> Credentials:
        """`headers`: anything with a case-insensitive `get` (http.server's, a dict of the
        exact names)."""
        def get(name: str) -> str:
            return str(headers.get(name) or "").strip()

        return cls(method, path, body, get(HEADER_MUNGE), get(HEADER_INCARNATION),
                   get(HEADER_TIMESTAMP), get(HEADER_NONCE), get(HEADER_SIGNATURE))

    @property
    def signed(self) -> bool:
        return bool(self.incarnation or self.signature)


def check_signature(credentials: Credentials, secret: bytes, now: float,
                    window_s: float = SIGNATURE_WINDOW_S) -> float:
    """The request's timestamp if its signature is good and recent; NotAuthenticated
    otherwise. The nonce is the caller's to check (NonceCache), after this."""
    c = credentials
    if not c.timestamp.isdigit() or len(c.timestamp) > 12:
        raise NotAuthenticated(f"{HEADER_TIMESTAMP} must be whole seconds since the epoch")
    timestamp = float(int(c.timestamp))
    if abs(now - timestamp) > window_s:
        raise NotAuthenticated(f"the request was signed {now - timestamp:+.0f} s from the "
                               f"daemon's clock, outside ±{window_s:g} s")
    if not _NONCE.fullmatch(c.nonce):
        raise NotAuthenticated(f"{HEADER_NONCE} must be 32 lower-case hex digits")
    expected = sign(secret, c.method, c.path, c.incarnation, c.timestamp, c.nonce,
                    body_digest(c.body))
    if not hmac.compare_digest(expected, c.signature):
        raise NotAuthenticated("the signature does not match this request")
    return timestamp


class NonceCache:
    """Nonces seen in the last window: a request whose nonce was seen is a replay. Bounded:
    a nonce is forgotten once its timestamp is out of the window (no request carrying it
    is accepted any more), and past `max_entries` live ones new requests wait (503).
    `not_before`: timestamps older than this are refused as possible replays (a daemon
    restarted has forgotten what its predecessor saw)."""

    def __init__(self, window_s: float = SIGNATURE_WINDOW_S, max_entries: int = MAX_NONCES,
                 not_before: float = 0.0):
        self.window_s, self.max_entries, self.not_before = window_s, max_entries, not_before
        self._seen: set[str] = set()
        self._expiry: list[tuple[float, str]] = []
        self._lock = threading.Lock()  # the daemon's service answers on many threads

    def first_use(self, key: str, timestamp: float, now: float) -> None:
        """Remember `key`; Forbidden if it was seen, CannotCheck if the cache is full."""
        with self._lock:
            self._remember(key, timestamp, now)

    def _remember(self, key: str, timestamp: float, now: float) -> None:
        while self._expiry and self._expiry[0][0] < now:
            self._seen.discard(heapq.heappop(self._expiry)[1])
        if timestamp < self.not_before:
            raise Forbidden("signed before the daemon started: a replay cannot be ruled out; "
                            "sign it again")
        if key in self._seen:
            raise Forbidden("this nonce was seen already: a replayed request")
        if len(self._seen) >= self.max_entries:
            raise CannotCheck("too many signed requests in one window; ask again")
        self._seen.add(key)
        heapq.heappush(self._expiry, (timestamp + self.window_s, key))


# --- the trainer's side -----------------------------------------------------------------

class SecretSigner:
    """Signs an incarnation's requests with the secret the daemon gave it."""

    def __init__(self, logical_job: str, generation: int, secret: bytes, *,
                 clock: Callable[[], float] = time.time,
                 nonce: Callable[[], str] = lambda: secrets.token_hex(16)):
        self.incarnation = incarnation_id(logical_job, generation)
        self._secret, self._clock, self._nonce = secret, clock, nonce

    def headers(self, method: str, path: str, body: bytes) -> dict[str, str]:
        timestamp, nonce = str(int(self._clock())), self._nonce()
        return {HEADER_INCARNATION: self.incarnation, HEADER_TIMESTAMP: timestamp,
                HEADER_NONCE: nonce,
                HEADER_SIGNATURE: sign(self._secret, method, path, self.incarnation,
                                       timestamp, nonce, body_digest(body))}


class MungeSigner:
    """A home job's credential: MUNGE vouches for its uid, the payload binds the request."""

    def __init__(self, munge: Munge):
        self._munge = munge

    def headers(self, method: str, path: str, body: bytes) -> dict[str, str]:
        return {HEADER_MUNGE: self._munge.encode(munge_payload(method, path, body))}
