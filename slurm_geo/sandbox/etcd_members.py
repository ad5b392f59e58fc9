"""The sandbox's etcd cluster: one member per site (home, control, remote), each in its
site's namespace on its site address. What the federation replicas keep their state in
(docs/federation.md, "Replicated state on etcd"); pure but for `is_healthy` and `ensure_auth`.

Three members so that losing any one site leaves a quorum of two: isolating home leaves
control's and remote's, which still reach each other over control-remote. The remote
member is the rented provider's disk: it holds only sealed values and key names (the
state is sealed under a key of the master key, which never goes there), in a data
directory of its own (`etcd/remote`), apart from the trusted sites' (`etcd/home`,
`etcd/control`). With `EtcdFiles` (the sandbox always gives them) members speak https
to clients and to each other, and let nobody in who presents no certificate: their
traffic crosses the WAN links, and the state in it says what runs where. A member's
certificate for its peers is of a CA of their own, which no client port trusts; the
rented site's member has no other certificate that a client port would take (a
server's only), so nothing on the provider's disk makes a client of the data. With
auth on (`ensure_auth`, RBAC), the replicas' user reads and writes the federation's
prefix and nothing else, and only the administrator (user root, by certificate) changes
who may: the replicas name only the trusted sites' members (`client_endpoints`), the
only ones their password and token go to.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from slurm_geo.errors import SandboxError
from slurm_geo.sandbox.sites import Site, Topology

ETCD_PROGRAM = "etcd"
MEMBER_SITES = (Site.HOME, Site.CONTROL, Site.REMOTE)  # the trusted sites first
CLIENT_SITES = (Site.HOME, Site.CONTROL)  # whose members serve the replicas
REPLICA_USER = "slurm-geo-replica"  # the etcd user the replicas act as
REPLICA_ROLE = "slurm-geo-federation"  # read and write of the federation's prefix
HEALTH_TIMEOUT_S = 2.0  # etcd gives its own verdict within 1 s
# Every write is a new revision (a lease renewal each second is one); etcd keeps every
# revision until compacted, and once its database reaches its 2 GiB quota it refuses all
# writes. Keeping the last 10,000 bounds it; 3.4 compacts every five minutes in this mode.
COMPACTION = ("--auto-compaction-mode", "revision", "--auto-compaction-retention", "10000")
# etcd 3.4 starts only on amd64 and ppc64le unless ETCD_UNSUPPORTED_ARCH names the
# architecture it runs on (Go's name for it); arm64 is one of those it refuses.
_SUPPORTED_GOARCH = ("amd64", "ppc64le")
_GOARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64",
           "ppc64le": "ppc64le", "s390x": "s390x", "riscv64": "riscv64", "armv7l": "arm",
           "i686": "386", "i386": "386"}


@dataclass(frozen=True)
class EtcdFiles:
    """The certificates of a cluster on TLS, in `directory`: of the site CA (`ca`), a
    member's for its clients, the one the replicas present (and the sandbox's own health
    checks) with their password, and the administrator's; of the peer CA, a member's for
    its peers."""

    ca: Path
    directory: Path

    def member_cert(self, site: Site) -> Path:
        return self.directory / f"etcd-{site.value}.pem"

    def member_key(self, site: Site) -> Path:
        return self.directory / f"etcd-{site.value}.key"

    def peer_cert(self, site: Site) -> Path:
        return self.directory / f"etcd-{site.value}-peer.pem"

    def peer_key(self, site: Site) -> Path:
        return self.directory / f"etcd-{site.value}-peer.key"

    @property
    def peer_ca(self) -> Path:
        return self.directory / "etcd-peer-ca.pem"

    @property
    def peer_ca_key(self) -> Path:
        return self.directory / "etcd-peer-ca.key"

    @property
    def root_cert(self) -> Path:
        return self.directory / "etcd-root.pem"

    @property
    def root_key(self) -> Path:
        return self.directory / "etcd-root.key"

    @property
    def password(self) -> Path:
        """REPLICA_USER's password (0600)."""
        return self.directory / "etcd-client.password"

    @property
    def client_cert(self) -> Path:
        return self.directory / "etcd-client.pem"

    @property
    def client_key(self) -> Path:
        return self.directory / "etcd-client.key"

    def ssl_context(self):
        """A client's TLS context: trusts the CA, presents the client certificate."""
        import ssl

        context = ssl.create_default_context(cafile=str(self.ca))
        context.load_cert_chain(str(self.client_cert), str(self.client_key))
        return context


@dataclass(frozen=True)
class EtcdMember:
    """One member: its site's namespace and address, its ports there, its data."""

    site: Site
    namespace: str
    address: str
    client_port: int
    peer_port: int
    data_dir: Path
    secure: bool = False  # https, its cluster's EtcdFiles

    @property
    def name(self) -> str:
        """The member's name in the cluster: its site's."""
        return self.site.value

    @property
    def client_url(self) -> str:
        return f"{self._scheme}://{self.address}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"{self._scheme}://{self.address}:{self.peer_port}"

    @property
    def _scheme(self) -> str:
        return "https" if self.secure else "http"

    @property
    def health_url(self) -> str:
        return f"{self.client_url}/health"


@dataclass(frozen=True)
class EtcdCluster:
    """The members and the token that keeps them from joining another sandbox's."""

    token: str
    members: tuple[EtcdMember, ...]
    files: EtcdFiles | None = None  # None: plain http (a test's cluster)

    @property
    def initial_cluster(self) -> str:
        return ",".join(f"{member.name}={member.peer_url}" for member in self.members)

    @property
    def endpoints(self) -> tuple[str, ...]:
        """Every member's client URL, the trusted sites' first."""
        return tuple(member.client_url for member in self.members)

    @property
    def client_members(self) -> tuple[EtcdMember, ...]:
        """The members that serve the replicas: the trusted sites'."""
        return tuple(member for member in self.members if member.site in CLIENT_SITES)

    @property
    def client_endpoints(self) -> tuple[str, ...]:
        """What a replica names: the trusted sites' members. The rented site's serves no
        client (its JSON gateway has no certificate to reach its gRPC with), and would
        see the replicas' token."""
        return tuple(member.client_url for member in self.client_members)

    def member(self, site: Site) -> EtcdMember:
        return next(member for member in self.members if member.site is site)

    def argv(self, member: EtcdMember, program: str = ETCD_PROGRAM) -> list[str]:
        """`member`'s command line. The initial-cluster flags count only at its first
        start; after that its data directory says who the members are."""
        return [program, "--name", member.name, "--data-dir", str(member.data_dir),
                "--listen-client-urls", member.client_url,
                "--advertise-client-urls", member.client_url,
                "--listen-peer-urls", member.peer_url,
                "--initial-advertise-peer-urls", member.peer_url,
                "--initial-cluster", self.initial_cluster, "--initial-cluster-state", "new",
                "--initial-cluster-token", self.token, *COMPACTION,
                *self._tls_flags(member),
                "--logger", "zap", "--log-outputs", "stderr"]

    def _tls_flags(self, member: EtcdMember) -> list[str]:
        files = self.files
        if files is None:
            return []
        site = member.site
        return ["--cert-file", str(files.member_cert(site)),
                "--key-file", str(files.member_key(site)), "--client-cert-auth",
                "--trusted-ca-file", str(files.ca),
                "--peer-cert-file", str(files.peer_cert(site)),
                "--peer-key-file", str(files.peer_key(site)), "--peer-client-cert-auth",
                "--peer-trusted-ca-file", str(files.peer_ca)]

    def ctl_flags(self) -> list[str]:
        """What etcdctl needs to be let in: the CA and the administrator's certificate
        (etcd takes its common name, root, as the user; only the gRPC API does)."""
        files = self.files
        if files is None:
            return []
        return ["--cacert", str(files.ca), "--cert", str(files.root_cert),
                "--key", str(files.root_key)]

    def auth_steps(self, prefix: str) -> list[tuple[list[str], bool]]:
        """etcdctl's arguments that turn auth on with `prefix` (every key of the
        federation's, `/name`) the replicas' alone, each with whether it reads
        REPLICA_USER's password on its stdin. Each may run again: an "already exists"
        is no failure (`ensure_auth`)."""
        return [(["user", "add", "root", "--no-password"], False),
                (["user", "grant-role", "root", "root"], False),
                (["role", "add", REPLICA_ROLE], False),
                (["role", "grant-permission", REPLICA_ROLE, "readwrite", prefix + "/",
                  "--prefix=true"], False),
                (["user", "add", REPLICA_USER, "--interactive=false"], True),
                (["user", "passwd", REPLICA_USER, "--interactive=false"], True),
                (["user", "grant-role", REPLICA_USER, REPLICA_ROLE], False),
                (["auth", "enable"], False)]

    def is_healthy(self, member: EtcdMember, timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
        return is_healthy(member.health_url, timeout_s,
                          None if self.files is None else self.files.ssl_context())


def ensure_auth(cluster: EtcdCluster, prefix: str, program: str = "etcdctl",
                timeout_s: float = 20) -> None:
    """Turn on auth in `cluster` (its `auth_steps`), asking its client members from the
    first one's namespace (none: this one), as the administrator; SandboxError naming the
    step that failed."""
    files = cluster.files
    if files is None:
        raise ValueError("auth needs the cluster on TLS: give it EtcdFiles")
    password = files.password.read_text().strip()
    first = cluster.client_members[0]
    enter = ["nsenter", f"--net=/run/netns/{first.namespace}"] if first.namespace else []
    base = [*enter, program, "--endpoints", ",".join(cluster.client_endpoints),
            *cluster.ctl_flags()]
    for args, reads_password in cluster.auth_steps(prefix):
        done = subprocess.run([*base, *args], input=password if reads_password else "",
                              capture_output=True, text=True, timeout=timeout_s,
                              check=False)
        if done.returncode != 0 and "already exists" not in done.stderr:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise SandboxError(f"etcd auth: `etcdctl {' '.join(args)}` failed: {last}; see "
                               "the members' logs, or `slurm-geo sandbox status`")


def cluster_in(topo: Topology, client_port: int, peer_port: int, data_root: Path,
               files: EtcdFiles | None = None) -> EtcdCluster:
    """A member at each site of `topo`, on the same ports at each site's own address,
    its data in `data_root`/<site>; on TLS with `files`."""
    return EtcdCluster(f"slurm-geo-{topo.prefix.rstrip('-')}", tuple(
        EtcdMember(site, topo.namespace(site), str(topo.site_address(site)), client_port,
                   peer_port, data_root / site.value, secure=files is not None)
        for site in MEMBER_SITES), files)


def unsupported_arch_env(machine: str) -> dict[str, str]:
    """What etcd needs in its environment to start on `machine` (platform.machine())."""
    goarch = _GOARCH.get(machine, machine)
    return {} if goarch in _SUPPORTED_GOARCH else {"ETCD_UNSUPPORTED_ARCH": goarch}


def parse_health(body: str) -> bool:
    """etcd's GET /health: `{"health":"true"}` once the member sees a leader and a
    quorum read through it succeeded; anything else (or not JSON) is not healthy."""
    try:
        reply = json.loads(body)
    except ValueError:
        return False
    return isinstance(reply, dict) and reply.get("health") == "true"


def is_healthy(health_url: str, timeout_s: float = HEALTH_TIMEOUT_S, context=None) -> bool:
    """GET a member's /health from this namespace: it serves, with a quorum behind it
    (`context`: the TLS a member on https asks for)."""
    # Imported here: urllib.request takes 40 ms, and `slurm-geo --help` imports this
    # module (through the sandbox's layout).
    import http.client
    import urllib.request

    try:
        with urllib.request.urlopen(health_url, timeout=timeout_s, context=context) as reply:
            return parse_health(reply.read().decode(errors="replace"))
    except (OSError, http.client.HTTPException, ValueError):  # URLError is an OSError
        return False
