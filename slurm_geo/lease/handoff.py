"""A key reply handed from a moved job's preamble to the trainer it starts (issue 31 item 3).

The daemon releases an incarnation's run key once per restart, to the process holding the
lease (its one-time token). On a cluster with none of home's files the preamble
(slurm_geo.stage.run) must read the run's world record and its trees' key rings before
the job's script starts, so it asks first; the trainer the script starts then finds the
reply in its environment instead of asking again:

    SLURM_GEO_KEY_HANDOFF = hex(nonce || AES-GCM(K, nonce, payload, aad))
    payload = {"reply": the key reply's JSON, "session_secret": hex or ""}
    K   = HKDF-SHA256(lease secret, no salt, "slurm-geo/v1/key-handoff")
    aad = "<logical job>:<generation>:<cluster>:<job id>:<restart>"

Only a holder of the incarnation's lease secret (already in the job's environment, which
signs its lease requests) opens it, for that incarnation and restart only; a requeued
restart asks the daemon again. The reply is never in the environment in clear. The
session secret the daemon handed the preamble with its first lease goes with it: that
lease spent the bootstrap secret (federation.sessions), so the trainer signs with the
session's from its first request.
"""

from __future__ import annotations

import json
import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from slurm_geo.ckpt.format.keys import derive_key
from slurm_geo.lease.protocol import KeyReply
from slurm_geo.lease.signing import secret_bytes

ENV_KEY_HANDOFF = "SLURM_GEO_KEY_HANDOFF"
INFO_KEY_HANDOFF = b"slurm-geo/v1/key-handoff"
NONCE_SIZE = 12


class HandoffError(ValueError):
    """A handed-off reply that does not open for this incarnation."""


def _key(lease_secret: str) -> bytes:
    return derive_key(secret_bytes(lease_secret), None, INFO_KEY_HANDOFF)


def bound_to(logical_job: str, generation: int, cluster: str, job_id: int,
             restart: int) -> bytes:
    """The incarnation (and restart) a handed-off reply is for."""
    return f"{logical_job}:{generation}:{cluster}:{job_id}:{restart}".encode()


def seal_reply(reply: KeyReply, session_secret: str, lease_secret: str, bound: bytes,
               nonce: bytes | None = None) -> str:
    nonce = os.urandom(NONCE_SIZE) if nonce is None else nonce
    payload = json.dumps({"reply": reply.to_json(), "session_secret": session_secret},
                         sort_keys=True).encode()
    return (nonce + AESGCM(_key(lease_secret)).encrypt(nonce, payload, bound)).hex()


def open_reply(sealed: str, lease_secret: str, bound: bytes) -> tuple[KeyReply, str]:
    """(the key reply, the session secret to sign with: "" where none was handed out)."""
    try:
        raw = bytes.fromhex(sealed)
        body = json.loads(AESGCM(_key(lease_secret)).decrypt(raw[:NONCE_SIZE],
                                                             raw[NONCE_SIZE:], bound))
        session = body["session_secret"]
        if not isinstance(session, str):
            raise TypeError("session_secret")
        return KeyReply.from_json(body["reply"]), session
    except (InvalidTag, ValueError, KeyError, TypeError) as exc:
        raise HandoffError(f"{ENV_KEY_HANDOFF} does not open for this incarnation "
                           f"({type(exc).__name__}); it was handed to another") from None
