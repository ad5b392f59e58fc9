"""What `slurm-geo doctor` gathers from a host (slurm_geo.doctor.gather) and judges
(slurm_geo.doctor.checks): plain records, no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class SlurmConfFact:
    cluster: str
    path: Path
    settings: dict[str, str] = field(default_factory=dict)  # lower-case key -> value
    error: str = ""  # why it could not be read
    hooks_runnable: dict[str, bool] = field(default_factory=dict)  # hook path -> executable


@dataclass(frozen=True)
class SpankFact:
    cluster: str
    plugstack: Path | None  # None: slurm.conf names none
    plugstack_error: str = ""
    plugin: Path | None = None  # the geo_directives.so plugstack.conf loads
    plugin_error: str = ""
    plugin_version: int | None = None  # its plugin_version: the SLURM_VERSION_NUMBER it saw
    slurm_version: tuple[int, int] | None = None  # (major, minor) of the Slurm here
    slurm_error: str = ""


@dataclass(frozen=True)
class MungeFact:
    socket: str
    ok: bool
    detail: str = ""


@dataclass(frozen=True)
class SecretFileFact:
    what: str  # "master key", "tls key ([federation] tls_key)", ...
    path: Path
    exists: bool
    required: bool = True
    mode: int = 0
    uid: int = -1
    owner: str = ""
    owners: tuple[str, ...] = ()  # who may own it; empty: anyone
    create_fix: str = ""


@dataclass(frozen=True)
class JwtFact:
    what: str
    path: Path
    expires: float | None = None  # its exp claim (Unix seconds)
    error: str = ""
    renew: str = ""


@dataclass(frozen=True)
class TlsFact:
    what: str
    path: Path
    not_before: float | None = None
    not_after: float | None = None
    ca: Path | None = None
    signed_by_ca: bool | None = None  # None: no CA to check against
    key: Path | None = None
    key_matches: bool | None = None
    error: str = ""
    renew: str = ""


@dataclass(frozen=True)
class UnitFact:
    unit: str
    root: Path
    path: Path | None  # the unit file found; None: not installed
    enabled: bool = False
    user: str = ""  # its User=
    user_exists: bool = True


@dataclass(frozen=True)
class MemberHealth:
    endpoint: str
    healthy: bool
    error: str = ""


@dataclass(frozen=True)
class EtcdFact:
    members: tuple[MemberHealth, ...] = ()
    cluster_size: int = 0  # members in etcd's member list (as a healthy member says)
    error: str = ""


@dataclass(frozen=True)
class StoreFact:
    name: str
    url: str
    operations: tuple[tuple[str, str], ...] = ()  # (operation, error or "") in order


@dataclass(frozen=True)
class ClockFact:
    url: str
    our_time: float | None = None  # this host's clock, mid-request
    their_time: float | None = None  # the daemon's Date header
    error: str = ""  # starts with CA_UNREADABLE where the daemon was not asked


CA_UNREADABLE = "its CA file"


@dataclass(frozen=True)
class LinkFact:
    name: str
    url: str
    size: int = 0  # bytes sent up and read back
    up_s: float = 0.0
    down_s: float = 0.0
    error: str = ""


@dataclass(frozen=True)
class OperatorFact:
    cluster: str
    user: str
    level: str = ""  # AdminLevel in the cluster's accounting; "": no such user
    error: str = ""
