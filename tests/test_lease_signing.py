"""Request authentication of the lease protocol, version 2 (slurm_geo.lease.signing): the
HMAC signature of an incarnation the daemon submitted, the nonce cache that refuses a
replay, and the MUNGE payload a home job's credential binds its request with."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from slurm_geo.ckpt.format.keys import RunKeyRing
from slurm_geo.lease.protocol import (
    HEADER_INCARNATION,
    HEADER_MUNGE,
    HEADER_NONCE,
    HEADER_SIGNATURE,
    HEADER_TIMESTAMP,
)
from slurm_geo.lease.signing import (
    CannotCheck,
    Credentials,
    Forbidden,
    MungeSigner,
    NonceCache,
    NotAuthenticated,
    SecretSigner,
    check_signature,
    munge_payload,
    parse_incarnation,
    secret_bytes,
    sign,
    string_to_sign,
)

SECRET = bytes(range(32))
NOW = 1_800_000_000.0
BODY = b'{"protocol": 2, "cluster": "rented", "job_id": 77}'
NONCE = "0123456789abcdef" * 2


def signed(body: bytes = BODY, *, secret: bytes = SECRET, at: float = NOW,
           nonce: str = NONCE, path: str = "/v1/lease") -> dict[str, str]:
    signer = SecretSigner("onprem-5", 1, secret, clock=lambda: at, nonce=lambda: nonce)
    return signer.headers("POST", path, body)


def received(headers: dict[str, str], body: bytes = BODY, path: str = "/v1/lease"
             ) -> Credentials:
    return Credentials.from_headers(headers, "POST", path, body)


def test_known_answer_signature():
    """A fixed secret, request and time give this signature: any change to the string
    signed (docs/federation.md) shows here."""
    message = string_to_sign("POST", "/v1/lease", "onprem-5/1", "1800000000", NONCE,
                             hashlib.sha256(BODY).hexdigest())
    assert message == (b"slurm-geo-lease/2\nPOST\n/v1/lease\nonprem-5/1\n1800000000\n"
                       + NONCE.encode() + b"\n" + hashlib.sha256(BODY).hexdigest().encode())
    expected = hmac.new(SECRET, message, hashlib.sha256).hexdigest()
    assert signed()[HEADER_SIGNATURE] == expected
    assert sign(SECRET, "POST", "/v1/lease", "onprem-5/1", "1800000000", NONCE,
                hashlib.sha256(BODY).hexdigest()) == expected


def test_headers_of_a_signed_request():
    headers = signed()
    assert headers[HEADER_INCARNATION] == "onprem-5/1"
    assert headers[HEADER_TIMESTAMP] == "1800000000"
    assert headers[HEADER_NONCE] == NONCE
    assert received(headers).signed and not received(headers).munge


@pytest.mark.parametrize("case, credentials, now, problem", [
    ("valid", received(signed()), NOW, None),
    ("valid, 59 s late", received(signed()), NOW + 59, None),
    ("valid, clock 59 s ahead of the daemon's", received(signed(at=NOW + 59)), NOW, None),
    ("wrong secret", received(signed(secret=bytes(32))), NOW, "signature does not match"),
    ("stale timestamp", received(signed(at=NOW - 61)), NOW, "outside ±60 s"),
    ("from the future", received(signed(at=NOW + 61)), NOW, "outside ±60 s"),
    ("body altered", received(signed(), body=BODY.replace(b"77", b"78")), NOW,
     "signature does not match"),
    ("another path", received(signed(), path="/v1/key"), NOW, "signature does not match"),
    ("no timestamp", received({**signed(), HEADER_TIMESTAMP: ""}), NOW, "whole seconds"),
    ("fractional timestamp", received({**signed(), HEADER_TIMESTAMP: "1800000000.5"}), NOW,
     "whole seconds"),
    ("bad nonce", received({**signed(), HEADER_NONCE: "x" * 32}), NOW, "32 lower-case hex"),
    ("another incarnation", received({**signed(), HEADER_INCARNATION: "onprem-5/2"}), NOW,
     "signature does not match"),
    ("no signature", received({**signed(), HEADER_SIGNATURE: ""}), NOW,
     "signature does not match"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_the_signature_check(case, credentials, now, problem):
    if problem is None:
        assert check_signature(credentials, SECRET, now) == float(credentials.timestamp)
        return
    with pytest.raises(NotAuthenticated, match=problem) as refused:
        check_signature(credentials, SECRET, now)
    assert refused.value.status == 401


def test_a_replayed_nonce_is_refused_within_the_window_and_forgotten_after():
    nonces = NonceCache(window_s=60)
    nonces.first_use("onprem-5/1 " + NONCE, NOW, NOW)
    with pytest.raises(Forbidden, match="replayed") as refused:
        nonces.first_use("onprem-5/1 " + NONCE, NOW, NOW + 30)
    assert refused.value.status == 403
    nonces.first_use("onprem-5/1 " + "f" * 32, NOW, NOW + 30)  # another nonce: fine
    nonces.first_use("onprem-5/1 " + NONCE, NOW + 90, NOW + 90)  # the old one expired
    assert len(nonces._seen) == 1  # bounded: expired nonces are dropped


def test_the_nonce_cache_is_bounded_and_refuses_what_a_restart_forgot():
    nonces = NonceCache(window_s=60, max_entries=2, not_before=NOW)
    nonces.first_use("a", NOW, NOW)
    nonces.first_use("b", NOW, NOW)
    with pytest.raises(CannotCheck) as full:
        nonces.first_use("c", NOW, NOW)
    assert full.value.status == 503
    with pytest.raises(Forbidden, match="before the daemon started"):
        nonces.first_use("d", NOW - 1, NOW + 100)


@pytest.mark.parametrize("text, expected", [
    ("onprem-5/1", ("onprem-5", 1)), ("eu.west_2-7/12", ("eu.west_2-7", 12))])
def test_incarnation_ids(text, expected):
    assert parse_incarnation(text) == expected


@pytest.mark.parametrize("text", ["", "onprem-5", "onprem-5/", "/3", "x/-1", "x/1e3",
                                  "x/1234567890", "a/b/c-7/12", "../../x/1", "a b/1",
                                  "-x/1", "x\n/1"])
def test_malformed_incarnation_ids_are_unauthenticated(text):
    with pytest.raises(NotAuthenticated):
        parse_incarnation(text)


@pytest.mark.parametrize("text", ["", "AB" * 32, "ab" * 31, "zz" * 32])
def test_a_secret_is_64_lower_case_hex_digits(text):
    with pytest.raises(ValueError):
        secret_bytes(text)


def test_the_munge_payload_binds_method_path_and_body():
    payload = munge_payload("POST", "/v1/lease", BODY)
    assert payload == hashlib.sha256(
        b"slurm-geo-lease/2 munge\nPOST\n/v1/lease\n"
        + hashlib.sha256(BODY).hexdigest().encode()).hexdigest()
    assert payload != munge_payload("POST", "/v1/key", BODY)
    assert payload != munge_payload("POST", "/v1/lease", BODY + b" ")


def test_a_munge_signer_sends_its_credential_in_one_header():
    class Recording:
        def encode(self, payload: str) -> str:
            self.payload = payload
            return "MUNGE:cred:"

        def decode(self, credential: str):
            raise AssertionError("not here")

    munge = Recording()
    assert MungeSigner(munge).headers("POST", "/v1/key", BODY) == {HEADER_MUNGE: "MUNGE:cred:"}
    assert munge.payload == munge_payload("POST", "/v1/key", BODY)


def test_a_key_request_may_ask_for_the_runs_store_key_and_the_reply_carries_only_aws_names():
    """An incarnation submitted before its job named a run asks for its run's store key
    with the data key; the reply carries S3 variables, nothing else."""
    from slurm_geo.lease.protocol import KeyReply, KeyRequest

    asked = KeyRequest("rented", 7, 0, 1, "tok", store_credentials=True)
    assert KeyRequest.from_json(asked.to_json()).store_credentials is True
    plain = asked.to_json() | {"store_credentials": "yes"}
    assert KeyRequest.from_json(plain).store_credentials is False  # only a JSON true asks
    reply = KeyReply("run-a", RunKeyRing.of(b"\x01" * 32),
                     {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"})
    assert KeyReply.from_json(reply.to_json()) == reply
    assert "store_env" not in KeyReply("run-a", RunKeyRing.of(b"\x01" * 32)).to_json()
    with pytest.raises(ValueError):
        KeyReply.from_json({"run": "r", "data_key": "01", "store_env": {"LD_PRELOAD": "x"}})
