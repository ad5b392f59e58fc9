"""The facts `slurm-geo doctor` judges, gathered from the host it runs on.

Each function looks at one piece and returns its fact (slurm_geo.doctor.facts), catching
every failure into the fact: the doctor reports, it never stops at the first broken piece.
Slurm's commands run through slurm_geo.slurm; munge through slurm_geo.lease.munge; etcd
through slurm_geo.federation.state.etcd; stores through slurm_geo.ckpt.stores.open_store.
"""

from __future__ import annotations

import base64
import json
import os
import pwd
import re
import secrets
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import TYPE_CHECKING

from slurm_geo.doctor.facts import (
    CA_UNREADABLE,
    ClockFact,
    EtcdFact,
    JwtFact,
    LinkFact,
    MemberHealth,
    MungeFact,
    OperatorFact,
    SecretFileFact,
    SlurmConfFact,
    SpankFact,
    StoreFact,
    TlsFact,
    UnitFact,
)

if TYPE_CHECKING:
    from cryptography.x509 import Certificate

    from slurm_geo.ckpt.stores.store import Store
    from slurm_geo.config.daemons import FederationConfig

UNIT_DIRS = ("etc/systemd/system", "usr/local/lib/systemd/system", "lib/systemd/system",
             "usr/lib/systemd/system")
SPANK_NAME = "geo_directives"
TIMEOUT_S = 5.0


# --- Slurm ------------------------------------------------------------------------------

def parse_slurm_conf(text: str) -> dict[str, str]:
    """slurm.conf's one-per-line settings, keys lower-cased (Slurm reads them so); node and
    partition lines are kept by their first key only. A later line wins, as in Slurm."""
    settings: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        key, equals, value = line.partition("=")
        if equals and key and " " not in key.strip():
            settings[key.strip().lower()] = value.strip()
    return settings


def slurm_conf_fact(cluster: str, path: Path) -> SlurmConfFact:
    try:
        settings = parse_slurm_conf(path.read_text(errors="replace"))
    except OSError as exc:
        return SlurmConfFact(cluster, path, error=exc.strerror or str(exc))
    hooks = {}
    for key in ("prolog", "epilog", "prologslurmctld", "epilogslurmctld"):
        value = settings.get(key, "")
        if value:
            hook = Path(value)
            hooks[value] = hook.is_file() and os.access(hook, os.X_OK)
    return SlurmConfFact(cluster, path, settings, hooks_runnable=hooks)


def plugstack_plugin(text: str) -> Path | None:
    """The geo_directives.so a plugstack.conf loads (`required|optional PATH args`)."""
    for raw in text.splitlines():
        words = raw.split("#", 1)[0].split()
        if len(words) >= 2 and words[0] in ("required", "optional") \
                and Path(words[1]).name.startswith(SPANK_NAME):
            return Path(words[1])
    return None


def spank_fact(conf: SlurmConfFact, slurm_version: tuple[int, int] | None,
               slurm_error: str) -> SpankFact:
    from slurm_geo.doctor.elf import NotAPlugin, plugin_version

    named = conf.settings.get("plugstackconfig", "")
    if conf.error or not named:
        return SpankFact(conf.cluster, None)
    plugstack = Path(named)
    try:
        plugin = plugstack_plugin(plugstack.read_text(errors="replace"))
    except OSError as exc:
        return SpankFact(conf.cluster, plugstack, exc.strerror or str(exc))
    if plugin is None:
        return SpankFact(conf.cluster, plugstack)
    try:
        version = plugin_version(plugin)
    except OSError as exc:
        return SpankFact(conf.cluster, plugstack, plugin=plugin,
                         plugin_error=exc.strerror or str(exc))
    except NotAPlugin as exc:
        return SpankFact(conf.cluster, plugstack, plugin=plugin, plugin_error=str(exc))
    return SpankFact(conf.cluster, plugstack, plugin=plugin, plugin_version=version,
                     slurm_version=slurm_version, slurm_error=slurm_error)


def slurm_version(slurm_conf: Path) -> tuple[tuple[int, int] | None, str]:
    from slurm_geo.slurm.admin import client_slurm_version
    from slurm_geo.slurm.errors import SlurmCommandError

    try:
        return client_slurm_version(slurm_conf), ""
    except SlurmCommandError as exc:
        return None, _one_line(exc)


def operator_fact(cluster: str, slurm_conf: Path, user: str) -> OperatorFact:
    from slurm_geo.slurm.admin import admin_level
    from slurm_geo.slurm.errors import SlurmCommandError

    try:
        return OperatorFact(cluster, user, admin_level(slurm_conf, user))
    except SlurmCommandError as exc:
        return OperatorFact(cluster, user, error=_one_line(exc))


def munge_fact(socket_path: Path | None) -> MungeFact:
    from slurm_geo.lease.munge import BadCredential, MungeCommands, MungeUnavailable

    munge = MungeCommands(socket_path, timeout_s=TIMEOUT_S)
    where = str(socket_path) if socket_path else "munge's default socket"
    try:
        decoded = munge.decode(munge.encode("slurm-geo doctor"))
    except (MungeUnavailable, BadCredential) as exc:
        return MungeFact(where, False, str(exc))
    if decoded.payload.strip() != "slurm-geo doctor":
        return MungeFact(where, False, "unmunge gave back another payload")
    return MungeFact(where, True)


# --- files ------------------------------------------------------------------------------

def secret_file_fact(what: str, path: Path, *, required: bool = True,
                     owners: tuple[str, ...] = (), create_fix: str = "") -> SecretFileFact:
    try:
        info = path.stat()
    except FileNotFoundError:
        return SecretFileFact(what, path, False, required, create_fix=create_fix)
    except OSError:
        return SecretFileFact(what, path, False, required, create_fix=create_fix)
    try:
        owner = pwd.getpwuid(info.st_uid).pw_name
    except KeyError:
        owner = ""
    return SecretFileFact(what, path, True, required, info.st_mode & 0o7777, info.st_uid,
                          owner, owners, create_fix)


def jwt_expiry(token: str) -> float | None:
    """The exp claim of a JWT, read without verifying it (only slurmctld holds the key)."""
    parts = token.strip().split(".")
    if len(parts) != 3:
        raise ValueError("not a JWT (three dot-separated parts)")
    payload = parts[1] + "=" * (-len(parts[1]) % 4)
    try:
        claims = json.loads(base64.urlsafe_b64decode(payload))
    except (ValueError, UnicodeDecodeError):
        raise ValueError("its payload is not base64url JSON") from None
    if not isinstance(claims, dict):
        raise ValueError("its payload is not a JSON object")
    exp = claims.get("exp")
    if exp is None:
        return None
    if not isinstance(exp, int | float):
        raise ValueError("its exp claim is not a number")
    return float(exp)


def jwt_fact(what: str, path: Path, user: str) -> JwtFact:
    renew = (f"on that cluster, `scontrol token username={user} lifespan=SECONDS` and write "
             f"the token to {path} (chmod 600)")
    try:
        text = path.read_text()
    except OSError as exc:
        return JwtFact(what, path, error=f"cannot read it: {exc.strerror or exc}", renew=renew)
    token = text.strip().removeprefix("SLURM_JWT=")
    try:
        return JwtFact(what, path, jwt_expiry(token), renew=renew)
    except ValueError as exc:
        return JwtFact(what, path, error=str(exc), renew=renew)


def tls_fact(what: str, path: Path, ca: Path | None = None, key: Path | None = None,
             renew: str = "") -> TlsFact:
    """A certificate (the first of a PEM chain), checked against `ca` (its issuer, or an
    issuer of the chain's next certificate) and its private key `key`."""
    from cryptography import x509

    try:
        chain = x509.load_pem_x509_certificates(path.read_bytes())
    except OSError as exc:
        return TlsFact(what, path, error=f"cannot read it: {exc.strerror or exc}", renew=renew)
    except ValueError as exc:
        return TlsFact(what, path, error=f"not a PEM certificate ({exc})", renew=renew)
    leaf = chain[0]
    signed: bool | None = None
    if ca is not None:
        try:
            authorities = x509.load_pem_x509_certificates(ca.read_bytes())
        except (OSError, ValueError) as exc:
            return TlsFact(what, path, ca=ca, error=f"its CA file {ca} cannot be read "
                           f"({exc})", renew=renew)
        signed = _chains_to(leaf, chain[1:], authorities)
    return TlsFact(what, path, leaf.not_valid_before_utc.timestamp(),
                   leaf.not_valid_after_utc.timestamp(), ca, signed, key,
                   _key_matches(leaf, key) if key is not None else None, renew=renew)


def _chains_to(cert: Certificate, intermediates: list[Certificate],
               authorities: list[Certificate]) -> bool:
    current = cert
    for _ in range(len(intermediates) + 1):
        if any(_issued(current, authority) for authority in authorities):
            return True
        issuer = next((i for i in intermediates if _issued(current, i)), None)
        if issuer is None:
            return False
        current = issuer
    return False


def _issued(cert: Certificate, issuer: Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(issuer)
    except Exception:  # ValueError, TypeError, InvalidSignature (none of the first two)
        return False
    return True


def _key_matches(cert: Certificate, key: Path) -> bool | None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    try:
        private = load_pem_private_key(key.read_bytes(), password=None)
    except (OSError, ValueError, TypeError):
        return None  # not readable here (another account's): the secret-file check says so
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    der = serialization.Encoding.DER
    return bool(private.public_key().public_bytes(der, spki)
                == cert.public_key().public_bytes(der, spki))


# --- services ---------------------------------------------------------------------------

def unit_fact(unit: str, root: Path) -> UnitFact:
    """Where `unit` is installed under `root`, and whether it is enabled: `systemctl
    is-enabled` where systemd runs this root, else the *.wants/ symlinks systemd would
    follow (a chroot, an image, a host booted without systemd)."""
    path = next((root / d / unit for d in UNIT_DIRS if (root / d / unit).is_file()), None)
    if path is None:
        return UnitFact(unit, root, None)
    if root == Path("/") and Path("/run/systemd/system").is_dir():
        try:
            done = subprocess.run(["systemctl", "is-enabled", unit], capture_output=True,
                                  text=True, timeout=TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired):
            enabled = False
        else:
            enabled = done.stdout.strip() in ("enabled", "enabled-runtime", "static", "alias")
    else:
        enabled = any(link.is_symlink() or link.exists()
                      for link in (root / "etc/systemd/system").glob(f"*.wants/{unit}"))
    user = _unit_user(path.read_text(errors="replace"))
    return UnitFact(unit, root, path, enabled, user, not user or _user_exists(user))


def _unit_user(text: str) -> str:
    match = re.search(r"^\s*User\s*=\s*(\S+)", text, re.MULTILINE)
    return match.group(1) if match else ""


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def etcd_fact(config: FederationConfig) -> EtcdFact:
    """Each endpoint's /maintenance/status and the member list, through the federation's
    etcd client. No value is read or written, so no master key is opened: the client gets
    a throwaway one."""
    from slurm_geo.federation.operator.replication import member_views
    from slurm_geo.federation.state.open import open_kv

    class Throwaway:
        def keys(self) -> tuple[bytes, ...]:
            return (secrets.token_bytes(32),)

    try:
        kv = open_kv(config, Throwaway())
    except Exception as exc:  # a password file others may read, a bad URL
        return EtcdFact(error=f"cannot reach etcd: {exc}")
    try:
        listed = kv.ask_each_member("/cluster/member/list")
        views = member_views(kv.ask_each_member("/maintenance/status"),
                             next((m for _, m in listed if isinstance(m, dict)), {}))
        size = max((len(m.get("members", [])) for _, m in listed if isinstance(m, dict)),
                   default=0)
    finally:
        kv.close()
    return EtcdFact(tuple(MemberHealth(v.endpoint, v.healthy, short_reason(v.error))
                          for v in views), size)


def store_fact(name: str, url: str, endpoint_url: str, ca_file: Path | None) -> StoreFact:
    """Write, read back, list, check and delete one object under doctor/ with this
    process's credentials (a daemon's: run the doctor with the daemons' environment)."""
    from slurm_geo.ckpt.stores.open_store import Patience, open_store

    quick = Patience(attempts=2, connect_timeout_s=3.0, read_timeout_s=10.0)
    operations: list[tuple[str, str]] = []
    try:
        store = open_store(url, endpoint_url=endpoint_url or None, patience=quick,
                           ca_file=ca_file)
    except Exception as exc:
        return StoreFact(name, url, (("open", _one_line(exc)),))
    probe = f"doctor/{socket.gethostname() or 'host'}-{secrets.token_hex(6)}"
    body = secrets.token_bytes(64)

    def attempt(operation: str, act: Callable[[], object]) -> bool:
        try:
            outcome = act()
        except Exception as exc:
            operations.append((operation, _one_line(exc)))
            return False
        operations.append((operation, "" if outcome is not False else "wrong answer"))
        return outcome is not False

    if attempt("write", lambda: store.put(probe, body)):
        attempt("read", lambda: store.get(probe) == body)
        attempt("list", lambda: probe in store.list("doctor/"))
        attempt("delete", lambda: _deleted(store, probe))
    return StoreFact(name, url, tuple(operations))


LINK_PROBE_BYTES = 4_000_000


def link_fact(name: str, url: str, endpoint_url: str, ca_file: Path | None,
              size: int = LINK_PROBE_BYTES) -> LinkFact:
    """One timed write and read back of `size` random bytes under doctor/, then deleted."""
    from slurm_geo.ckpt.stores.open_store import Patience, open_store

    probe = f"doctor/link-{socket.gethostname() or 'host'}-{secrets.token_hex(6)}"
    body = secrets.token_bytes(size)
    try:
        store = open_store(url, endpoint_url=endpoint_url or None, ca_file=ca_file,
                           patience=Patience(attempts=1, read_timeout_s=60.0))
        started = time.monotonic()
        store.put(probe, body)
        sent = time.monotonic()
        same = store.get(probe) == body
        read = time.monotonic()
        store.delete(probe)
    except Exception as exc:
        return LinkFact(name, url, error=_one_line(exc))
    if not same:
        return LinkFact(name, url, error="read back other bytes")
    return LinkFact(name, url, size, sent - started, read - sent)


def _deleted(store: Store, name: str) -> bool:
    store.delete(name)
    return not store.exists(name)


def clock_fact(url: str, ca_file: Path | None) -> ClockFact:
    """The federation daemon's Date header (GET /v1/leader, which every replica answers)."""
    from slurm_geo.lease.protocol import LEADER_PATH

    try:  # a CA file that is missing or not PEM: this check's error, not a traceback
        context = ssl.create_default_context(cafile=None if ca_file is None else str(ca_file))
    except (OSError, ValueError) as exc:
        return ClockFact(url, error=f"{CA_UNREADABLE} {ca_file} cannot be read "
                                    f"({_one_line(exc)})")
    started = time.time()
    try:
        with urllib.request.urlopen(url.rstrip("/") + LEADER_PATH, timeout=TIMEOUT_S,
                                    context=context) as response:
            date = response.headers.get("Date")
    except urllib.error.HTTPError as exc:
        date = exc.headers.get("Date")
    except (OSError, ValueError) as exc:
        return ClockFact(url, error=_one_line(exc))
    ended = time.time()
    if not date:
        return ClockFact(url, error="its answer has no Date header")
    try:
        theirs = parsedate_to_datetime(date).timestamp()
    except (TypeError, ValueError):
        return ClockFact(url, error=f"its Date header {date!r} is not a date")
    # Date has whole seconds, truncated: the daemon's clock read somewhere in [theirs,
    # theirs + 1); ours is taken halfway through the request.
    return ClockFact(url, (started + ended) / 2, theirs + 0.5)


_ERRNO = re.compile(r"\[Errno -?\d+\] ([^'\")\]>]+)")


def short_reason(text: str) -> str:
    """The OS's words inside a client library's long message (requests, urllib3 wrap
    `[Errno 111] Connection refused` in a paragraph), else the message cut short."""
    found = _ERRNO.findall(text)
    if found:
        return found[-1].strip()
    if "ConnectTimeout" in text or "timed out" in text:
        return "no answer in time (timed out)"
    return text[:300]


def _one_line(exc: BaseException) -> str:
    return short_reason(" ".join(str(exc).split()) or type(exc).__name__)


def existing(paths: Iterable[Path | None]) -> list[Path]:
    """The distinct paths given, in order."""
    seen: list[Path] = []
    for path in paths:
        if path is not None and path not in seen:
            seen.append(path)
    return seen
