"""MUNGE, the home cluster's own proof of identity, behind one small interface.

A home job proves its uid to the federation daemon with a MUNGE credential (`munge -s
PAYLOAD`); the daemon decodes it with `unmunge`, which munged answers only once per
credential (a replay is refused) and only within its TTL (300 s by default). Both
programs talk to munged's socket: `[federation] munge_socket`, else the one the home
cluster's slurm.conf names (`AuthInfo=socket=PATH`), else munge's own default.

`MungeCommands` runs the real programs with a timeout; tests inject `FakeMunge`.
"""

from __future__ import annotations

import re
import secrets
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from slurm_geo.errors import SlurmGeoError
from slurm_geo.exitcodes import ExitCode

TIMEOUT_S = 5.0
# unmunge's exit statuses (munge_err_t) that say munged could not be asked, not that the
# credential is bad: socket, timeout, snafu, no memory.
_UNAVAILABLE = {1, 5, 6, 7}
REPLAYED = 17
UNAUTHORIZED = 18  # decoded by a uid the credential is restricted away from
_MESSAGES = {8: "not a valid credential", 11: "its MAC does not match",
             14: "not a valid credential", 15: "the credential has expired",
             16: "the credential is from the future (rewound clock)",
             17: "the credential was used already (replayed)",
             18: "this process may not decode the credential (restricted to another "
                 "user)"}


@dataclass(frozen=True)
class Decoded:
    uid: int
    gid: int
    payload: str


class MungeUnavailable(SlurmGeoError):
    """munged cannot be asked now (no socket, a timeout, no munge installed)."""

    exit_code = ExitCode.LEASE_UNREACHABLE


class BadCredential(Exception):
    """unmunge refused the credential: `status` is munge's error number (17: replayed)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Munge(Protocol):
    def encode(self, payload: str, restrict_uid: int | None = None) -> str: ...

    def decode(self, credential: str) -> Decoded: ...


class MungeCommands:
    """`munge` and `unmunge`, with `-S socket` when one is named."""

    def __init__(self, socket: Path | None = None, timeout_s: float = TIMEOUT_S):
        self.socket, self.timeout_s = socket, timeout_s

    def encode(self, payload: str, restrict_uid: int | None = None) -> str:
        """A credential of `payload` (encrypted by munged); with `restrict_uid`, only a
        process of that uid may decode it."""
        restrict = [] if restrict_uid is None else ["-u", str(restrict_uid)]
        # On stdin, never in argv: every user of the node may read a process's arguments.
        done = self._run(["munge", *restrict], payload)
        if done.returncode != 0:
            raise MungeUnavailable(f"munge failed: {_last_line(done.stderr)}")
        return done.stdout.strip()

    def decode(self, credential: str) -> Decoded:
        done = self._run(["unmunge", "-N"], credential)
        if done.returncode in _UNAVAILABLE:
            raise MungeUnavailable(f"unmunge failed: {_last_line(done.stderr)}")
        if done.returncode != 0:
            raise BadCredential(done.returncode, _MESSAGES.get(
                done.returncode, f"unmunge refused it: {_last_line(done.stderr)}"))
        return parse_unmunge(done.stdout)

    def _run(self, argv: list[str], stdin: str) -> subprocess.CompletedProcess[str]:
        if self.socket is not None:
            argv = [*argv, "-S", str(self.socket)]
        try:
            return subprocess.run(argv, input=stdin, capture_output=True, text=True,
                                  timeout=self.timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise MungeUnavailable(f"{argv[0]} gave no answer within {self.timeout_s:g} s "
                                   "(is munged running?)") from None
        except OSError as exc:
            raise MungeUnavailable(f"cannot run {argv[0]}: {exc}") from None


def parse_unmunge(text: str) -> Decoded:
    """`unmunge -N` output: `KEY: value` lines, a blank line, then the payload."""
    head, _, payload = text.partition("\n\n")
    fields = {}
    for line in head.splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    try:
        if fields["STATUS"] != "0":
            status = int(fields["STATUS"])
            raise BadCredential(status, _MESSAGES.get(status, f"unmunge status {status}"))
        return Decoded(int(fields["UID"]), int(fields["GID"]), payload)
    except (KeyError, ValueError):
        raise BadCredential(0, "unmunge's answer has no numeric STATUS, UID and GID") from None


_AUTH_INFO = re.compile(r"^\s*AuthInfo\s*=\s*(\S+)", re.IGNORECASE | re.MULTILINE)


def socket_from_slurm_conf(text: str) -> Path | None:
    """The munge socket a slurm.conf names (`AuthInfo=socket=PATH[,cred_expire=...]`)."""
    for match in _AUTH_INFO.finditer(text):
        for option in match.group(1).split(","):
            key, _, value = option.partition("=")
            if key.strip().lower() == "socket" and value:
                return Path(value)
    return None


def munge_socket(configured: Path | None, slurm_conf: Path | None) -> Path | None:
    """`[federation] munge_socket`, else the one `slurm_conf` names, else None (munge's
    default socket)."""
    if configured is not None or slurm_conf is None:
        return configured
    try:
        return socket_from_slurm_conf(slurm_conf.read_text(errors="replace"))
    except OSError:
        return None


class FakeMunge:
    """An in-memory munged for tests: `as_uid(uid)` encodes as that uid, every view
    decodes what any of them encoded, each credential once."""

    def __init__(self, uid: int = 0, *,
                 _issued: dict[str, tuple[int, str, int | None]] | None = None,
                 _decoded: set[str] | None = None):
        self.uid = uid
        self._issued = {} if _issued is None else _issued
        self._decoded = set() if _decoded is None else _decoded

    def as_uid(self, uid: int) -> FakeMunge:
        return FakeMunge(uid, _issued=self._issued, _decoded=self._decoded)

    def encode(self, payload: str, restrict_uid: int | None = None) -> str:
        credential = f"MUNGE:fake-{secrets.token_hex(12)}:"
        self._issued[credential] = (self.uid, payload, restrict_uid)
        return credential

    def decode(self, credential: str) -> Decoded:
        if credential not in self._issued:
            raise BadCredential(8, _MESSAGES[8])
        if credential in self._decoded:
            raise BadCredential(REPLAYED, _MESSAGES[REPLAYED])
        uid, payload, restricted_to = self._issued[credential]
        if restricted_to is not None and restricted_to != self.uid:
            raise BadCredential(UNAUTHORIZED, _MESSAGES[UNAUTHORIZED])
        self._decoded.add(credential)
        return Decoded(uid, uid, payload)


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no message"

