"""etcd behind its endpoints, every value sealed.

etcd3gw speaks etcd's grpc-gateway (JSON over HTTP). Every value is sealed (docs/format.md
§5, kind 6) under the state key `S` with a name of the etcd key and the place the value
takes in that key's history (`sealed_name`): the version etcd gives the key when it is
written (1 at its creation, one more at each write), and, from the second write on, the
revision that created it. The member at the rented site stores nothing it can read; a
value copied under another key, or put back under its own after it was written over (a
replay: etcd counts the key's version past it), fails to open (SealBroken). Keys are
ASCII (federation.etcd.layout quotes every name in them). `S` is derived
from the master key file, followed as a rotation rewrites it: values are sealed under the
first key of the file, and open under the key of the file their header names.

A request that never reached a member (connection refused, connect timeout) goes to the
next endpoint, and so does a read, a lease grant or a keepalive that timed out or found
the member unavailable (503: no quorum). A transaction whose connection broke after it
was sent may have been applied: it is not sent again, and StateUnavailable says its
outcome is unknown (the next read shows it). etcd's refusal (an unknown lease, a bad
request) is EtcdRefused, whatever the request.

Where the members have auth on, the replicas act as `EtcdTLS.user`: the gateway takes no
user from a client certificate (etcd refuses one that names any, CVE-2018-16886), so each
endpoint's client trades the password for a token on its first request, and again when
the member no longer knows the token (it lapses `--auth-token-ttl` after its last use).
"""

from __future__ import annotations

import base64
import json
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import etcd3gw
import requests
import urllib3
from etcd3gw import exceptions as etcd_errors

from slurm_geo.ckpt.errors import CkptError
from slurm_geo.ckpt.format.keys import SALT_SIZE, MasterKeys, RandomBytes, federation_state_key
from slurm_geo.ckpt.format.seal import Kind, open_with_ring, seal
from slurm_geo.errors import ConfigError
from slurm_geo.federation.model import FederationStateError, StateUnavailable

T = TypeVar("T")

# etcd 3.4 serves the gateway at /v3/ (and /v3beta/); naming it saves etcd3gw's discovery
# request to /version on every new client.
API_PATH = "/v3/"
# Per socket operation, not per request: under the leader's keepalive interval (a third of
# its 5 s lease), so a member that stopped answering leaves time to try the next one.
TIMEOUT_S = 1.5

Request = dict[str, Any]
GRPC_NOT_FOUND = 5
GRPC_UNAUTHENTICATED = 16  # "invalid auth token": unknown to the member, or lapsed


class EtcdRefused(StateUnavailable):
    """etcd answered, and said no; `code` is its gRPC status code."""

    def __init__(self, detail: str, code: int | None):
        super().__init__(detail)
        self.code = code


@dataclass(frozen=True)
class At:
    """Where a key stands in its history: the revision that created it and its version
    (how many times it was written since); (0, 0) when there is no such key."""

    create_revision: int = 0
    version: int = 0

    def next(self) -> At:
        """Where the key stands once written again: one version on (a key created anew:
        version 1, its creation revision not known before etcd applies the write)."""
        return At(self.create_revision if self.version else 0, self.version + 1)


ABSENT = At()


def sealed_name(key: str, at: At) -> str:
    """The name a value of `key` at `at` is sealed with (the AEAD's associated data): the
    key, its version, and, from version 2 on, the revision that created it, so a value of
    an earlier life of a key deleted since does not open in a later one either. Version 1
    names no revision: the writer of a new key cannot know the revision etcd will give it."""
    created = at.create_revision if at.version > 1 else 0
    return f"{key}\x00{created}:{at.version}"


@dataclass(frozen=True)
class Held:
    """A key as etcd holds it: the revision that last wrote it, the one that created it,
    and how many times it was written since (its version)."""

    key: str
    mod_revision: int
    create_revision: int
    version: int

    @property
    def at(self) -> At:
        return At(self.create_revision, self.version)


@dataclass(frozen=True)
class Found(Held):
    """A key as etcd holds it, its value opened."""

    value: bytes


@dataclass(frozen=True)
class Sealed(Held):
    """A key as etcd holds it, its value not opened yet."""

    sealed: bytes

    @property
    def name(self) -> str:
        """The name its value must have been sealed with."""
        return sealed_name(self.key, self.at)


class SealBroken(FederationStateError):
    """A value that does not open under the state key: altered, moved from another key,
    put back after it was written over (a replay), or sealed under another site's master
    key."""

    def __init__(self, key: str, reason: str):
        super().__init__(f"the federation state in etcd: '{key}' refused ({reason}): "
                         "altered, replayed from an earlier write, or moved from another "
                         "key; see `slurm-geo audit verify` and who may write to etcd")
        self.key = key


@dataclass(frozen=True)
class EtcdTLS:
    """How https to the members is verified (`ca_file`; None: the system's CAs), for
    members that ask for one, the client certificate (`cert`, `key`), and for members
    with auth on, the etcd user and the file of its password."""

    ca_file: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    user: str = ""
    password_file: Path | None = None

    def password(self) -> str | None:
        """The user's password, None without a user; ConfigError for a file others may
        read, or none to read."""
        if not self.user or self.password_file is None:
            return None
        where = f"[federation] etcd_password_file {self.password_file}"
        try:
            with open(self.password_file, "rb") as handle:
                mode = os.fstat(handle.fileno()).st_mode
                text = handle.read().decode().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{where}: cannot read it ({exc})") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(f"{where}: mode {stat.S_IMODE(mode):04o} lets others in; "
                              "chmod 600 it")
        if not text:
            raise ConfigError(f"{where}: it is empty; write etcd_user's password in it")
        return text


@dataclass(frozen=True)
class Outcome:
    """A transaction's outcome; `reads`: the ranges of the branch etcd took, opened."""

    succeeded: bool
    revision: int
    reads: list[list[Found]]


class EtcdKV:
    def __init__(self, endpoints: Sequence[str], master_keys: MasterKeys, *,
                 timeout_s: float = TIMEOUT_S, random_bytes: RandomBytes = os.urandom,
                 tls: EtcdTLS = EtcdTLS()):
        if not endpoints:
            raise ValueError("etcd: give at least one endpoint (http://host:port)")
        self.endpoints = tuple(endpoints)
        self._clients = [_client(url, timeout_s, tls) for url in self.endpoints]
        self._current = 0
        self._master_keys = master_keys
        self._random_bytes = random_bytes
        self._user, self._password = tls.user, tls.password()

    def state_keys(self) -> tuple[bytes, ...]:
        """The state key of each key of the master key file: the first seals."""
        return tuple(federation_state_key(key) for key in self._master_keys.keys())

    def close(self) -> None:
        for client in self._clients:
            client.session.close()

    # --- reads ---------------------------------------------------------------------------

    def get(self, key: str) -> Found | None:
        found = [self.open(item) for item in self._range(key, None)]
        return found[0] if found else None

    def get_sealed(self, key: str) -> Sealed | None:
        found = self._range(key, None)
        return found[0] if found else None

    def range(self, prefix: str, *, start: str | None = None) -> list[Found]:
        """Every key under `prefix` (from `start` on, when given), in key order."""
        return [self.open(item) for item in self.range_sealed(prefix, start=start)]

    def range_sealed(self, prefix: str, *, start: str | None = None) -> list[Sealed]:
        """The same, not opened yet: for a reader that reports a value that does not open
        and goes on (`slurm-geo audit verify`)."""
        return self._range(start or prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1))

    def _range(self, key: str, end: str | None) -> list[Sealed]:
        request: Request = {"key": _b64(key)}
        if end is not None:
            request["range_end"] = _b64(end)
        reply = self._call(lambda c: c.post(c.get_url("/kv/range"), json=request),
                           replayable=True)
        return _sealed(reply.get("kvs", []))

    def open(self, item: Sealed) -> Found:
        try:
            value = open_with_ring(self.state_keys(), Kind.FEDERATION_STATE, item.sealed,
                                   item.name)
        except CkptError as exc:
            raise SealBroken(item.key, str(exc)) from None
        return Found(item.key, item.mod_revision, item.create_revision, item.version,
                     value=value)

    # --- transactions --------------------------------------------------------------------

    def put(self, key: str, value: bytes, lease: int = 0, *, at: At) -> Request:
        """A put of `value` for `commit`, sealed for the place it takes in `key`'s history:
        the key stands at `at` now (ABSENT: it is not there), and the commit must compare
        that it still does (its mod_revision, or its creation for a new key)."""
        sealed = seal(self.state_keys()[0], Kind.FEDERATION_STATE,
                      self._random_bytes(SALT_SIZE), value, sealed_name(key, at.next()))
        put: Request = {"key": _b64(key), "value": base64.b64encode(sealed).decode()}
        if lease:
            put["lease"] = lease
        return {"request_put": put}

    def commit(self, compares: list[Request], success: list[Request],
               failure: list[Request]) -> Outcome:
        txn = {"compare": compares, "success": success, "failure": failure}
        reply = self._call(lambda c: c.transaction(txn), replayable=False)
        reads = [[self.open(item) for item in _sealed(r["response_range"].get("kvs", []))]
                 for r in reply.get("responses", []) if "response_range" in r]
        # The gateway leaves out false and zero (proto3 JSON).
        return Outcome(bool(reply.get("succeeded", False)),
                       int(reply["header"]["revision"]), reads)

    def replace_sealed(self, key: str, mod_revision: int, sealed: bytes) -> bool:
        """Put `sealed` (sealed already: a rotation's, for the key's next version) under
        `key` if nobody wrote it since `mod_revision`, keeping the lease it is bound to;
        False if somebody did."""
        put = {"key": _b64(key), "value": base64.b64encode(sealed).decode(),
               "ignore_lease": True}
        return self.commit([modified_at(key, mod_revision)], [{"request_put": put}],
                           []).succeeded

    # --- leases --------------------------------------------------------------------------

    def grant(self, ttl_s: int) -> int:
        # Sent again after a broken connection, the first grant runs out unused.
        reply = self._call(lambda c: c.post(c.get_url("/lease/grant"),
                                            json={"TTL": ttl_s, "ID": 0}), replayable=True)
        return int(reply["ID"])

    def keepalive(self, lease: int) -> int:
        """The lease's TTL from now; 0 when etcd no longer has it."""
        reply = self._call(lambda c: c.post(c.get_url("/lease/keepalive"), json={"ID": lease}),
                           replayable=True)
        return max(0, int(reply["result"].get("TTL", 0)))

    def revoke(self, lease: int) -> None:
        """Drop the lease and every key bound to it; one etcd no longer has is gone too."""
        try:
            self._call(lambda c: c.post(c.get_url("/kv/lease/revoke"), json={"ID": lease}),
                       replayable=True)
        except EtcdRefused as exc:
            if exc.code != GRPC_NOT_FOUND:
                raise

    # --- members ---------------------------------------------------------------------------

    def ask_each_member(self, path: str) -> list[tuple[str, dict[str, Any] | str]]:
        """POST {} to `path` (/maintenance/status) of every endpoint on its own: each
        endpoint with its reply, or why none came."""
        answers: list[tuple[str, dict[str, Any] | str]] = []
        for url, client in zip(self.endpoints, self._clients, strict=True):
            try:
                answers.append((url, self._authorized(
                    client, url, lambda c: c.post(c.get_url(path), json={}))))
            except etcd_errors.Etcd3Exception as exc:
                answers.append((url, _reason(exc)))
            except EtcdRefused as exc:
                answers.append((url, str(exc)))
        return answers

    # --- plumbing ------------------------------------------------------------------------

    def _call(self, request: Callable[[etcd3gw.Etcd3Client], T], *, replayable: bool) -> T:
        failures = []
        for offset in range(len(self._clients)):
            index = (self._current + offset) % len(self._clients)
            url = self.endpoints[index]
            try:
                result = self._authorized(self._clients[index], url, request)
            except (etcd_errors.ConnectionFailedError,
                    etcd_errors.ConnectionTimeoutError) as exc:
                if not (replayable or _never_sent(exc)):
                    raise StateUnavailable(
                        f"{url} stopped answering a write ({_reason(exc)}); it may or may not "
                        "have been applied: read again to see") from None
                failures.append(f"{url}: {_reason(exc)}")
                continue
            except etcd_errors.Etcd3Exception as exc:
                raise EtcdRefused(f"{url} refused the request: {_reason(exc)}",
                                  _grpc_code(exc)) from None
            self._current = index
            return result
        raise StateUnavailable("no endpoint answers; " + "; ".join(failures))

    def _authorized(self, client: etcd3gw.Etcd3Client, url: str,
                    request: Callable[[etcd3gw.Etcd3Client], T]) -> T:
        """`request` with this client's token, which it gets first if it has none, and
        again once should the member no longer know it (refused before it was applied)."""
        if self._password is None:
            return request(client)
        if "Authorization" not in client.session.headers:
            self._authenticate(client, url)
        try:
            return request(client)
        except etcd_errors.Etcd3Exception as exc:
            if _grpc_code(exc) != GRPC_UNAUTHENTICATED:
                raise
        self._authenticate(client, url)
        return request(client)

    def _authenticate(self, client: etcd3gw.Etcd3Client, url: str) -> None:
        body = {"name": self._user, "password": self._password}
        client.session.headers.pop("Authorization", None)  # etcd refuses a lapsed one here too
        try:
            reply = client.post(client.get_url("/auth/authenticate"), json=body)
        except (etcd_errors.ConnectionFailedError, etcd_errors.ConnectionTimeoutError):
            raise
        except etcd_errors.Etcd3Exception as exc:
            raise EtcdRefused(f"{url} refused etcd user '{self._user}' ({_reason(exc)}); "
                              "check [federation] etcd_user and etcd_password_file against "
                              "the members' users", _grpc_code(exc)) from None
        client.session.headers["Authorization"] = str(reply["token"])


def _sealed(kvs: list[dict[str, Any]]) -> list[Sealed]:
    return [Sealed(base64.b64decode(kv["key"]).decode("ascii"), int(kv["mod_revision"]),
                   int(kv["create_revision"]), int(kv.get("version", 0)),
                   sealed=base64.b64decode(kv.get("value", ""))) for kv in kvs]


def created_at(key: str, revision: int) -> Request:
    """A compare: `key`'s create_revision is `revision` (0: there is no such key)."""
    return {"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": revision}


def modified_at(key: str, revision: int) -> Request:
    """A compare: `key` was last written at `revision` (0: there is no such key)."""
    return {"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": revision}


def delete(key: str) -> Request:
    return {"request_delete_range": {"key": _b64(key)}}


def read(key: str) -> Request:
    return {"request_range": {"key": _b64(key)}}


def _client(url: str, timeout_s: float, tls: EtcdTLS) -> etcd3gw.Etcd3Client:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or not parts.port:
        raise ValueError(f"etcd endpoint {url!r}: expected http://host:port or https://...")
    return etcd3gw.Etcd3Client(host=parts.hostname, port=parts.port, protocol=parts.scheme,
                               timeout=timeout_s, api_path=API_PATH, session=_session(tls))


def _session(tls: EtcdTLS) -> requests.Session:
    """requests' session for the members, verifying with `tls` only. Not trusting the
    environment: requests lets REQUESTS_CA_BUNDLE (set on many hosts, Debian's CA bundle)
    override a session's own CA, and then no member of a site CA is trusted; nor is an
    HTTPS_PROXY between a replica and its state wanted."""
    session = requests.Session()
    session.trust_env = False
    if tls.ca_file is not None:
        session.verify = str(tls.ca_file)
    if tls.cert is not None and tls.key is not None:
        session.cert = (str(tls.cert), str(tls.key))
    return session


def _b64(key: str) -> str:
    return base64.b64encode(key.encode("ascii")).decode()


def _never_sent(exc: etcd_errors.Etcd3Exception) -> bool:
    """etcd3gw raised `exc` from requests' error: was no byte of the request sent?"""
    cause = exc.__context__
    if isinstance(cause, requests.exceptions.ConnectTimeout):
        return True
    if isinstance(cause, requests.exceptions.ConnectionError) and cause.args:
        return isinstance(getattr(cause.args[0], "reason", None),
                          urllib3.exceptions.NewConnectionError)
    return False


def _grpc_code(exc: etcd_errors.Etcd3Exception) -> int | None:
    try:
        code = json.loads(exc.detail_text or "")["code"]
    except (ValueError, TypeError, KeyError):
        return None
    return code if isinstance(code, int) else None


def _reason(exc: etcd_errors.Etcd3Exception) -> str:
    return str(exc.detail_text or exc.__context__ or type(exc).__name__).strip()
