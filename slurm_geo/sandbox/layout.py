"""Where everything of a sandbox lives and which ports it uses: pure data, no I/O.

Ports, as offsets from the port base (each daemon on its site's address):
    10-13  onprem: slurmctld, slurmdbd, its two slurmd           (home)
    20-25  rented: slurmctld, slurmdbd, two slurmd; 25 its TLS relay  (remote)
    30     MariaDB                                                (login host, 127.0.0.1)
    40-48  the S3 server (40) and its own ports; 45 checkpoint-sync's metrics (home)
    50     the federation daemon                                  (home; replicated: and control)
    60-61  each site's etcd member: clients, peers (the same at each site's address)
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from slurm_geo.sandbox.etcd_members import EtcdCluster, EtcdFiles, cluster_in
from slurm_geo.sandbox.sites import Site, Topology, topology

DEFAULT_ROOT = Path("/var/lib/slurm-geo/sandbox")
SITE_PYTHON_DIR = Path("/var/lib/slurm-geo/site-python")
ROOT_ENV = "SLURM_GEO_SANDBOX_DIR"
DEFAULT_PORT_BASE = 16800
S3_BUCKET = "slurm-geo"
S3_PREFIX = "checkpoints"  # the offsite store's keys in S3_BUCKET
S3_REGION = "us-east-1"  # the one the S3 server answers for; clients sign with it
# The daemons' own account on the rented cluster: the service account (sandbox.
# service_account.NAME), a Slurm operator there as at home; never root.
REST_USER = "slurm-geo"
# slurmrestd refuses to run as root or as SlurmUser; this account exists on every Debian.
RESTD_OS_USER = "nobody"
RESTD_OS_GROUP = "nogroup"


@dataclass(frozen=True)
class ClusterLayout:
    """One cluster of the sandbox, in its site: its daemons run in the site's network
    namespace and listen on the site's address."""

    name: str
    region: str
    root: Path
    site: Site
    namespace: str
    address: str
    ctld_port: int
    dbd_port: int
    node_ports: tuple[int, ...]
    rest_port: int | None = None  # the TLS relay in front of slurmrestd: what users reach

    @property
    def etc(self) -> Path:
        return self.root / "etc"

    @property
    def slurm_conf(self) -> Path:
        return self.etc / "slurm.conf"

    @property
    def slurmdbd_conf(self) -> Path:
        # slurmdbd reads slurmdbd.conf from the directory of SLURM_CONF.
        return self.etc / "slurmdbd.conf"

    @property
    def jwt_key(self) -> Path:
        return self.etc / "jwt.key"

    @property
    def token_file(self) -> Path:
        return self.root / "jwt.token"

    def user_token_file(self, user: str) -> Path:
        """The JWT of a home user's mapped account here (slurmrestd clusters)."""
        return self.root / "tokens" / f"{user}.jwt"

    @property
    def database(self) -> str:
        return f"slurm_acct_{self.name}"

    @property
    def node_names(self) -> tuple[str, ...]:
        return tuple(f"{self.name}-n{i}" for i in range(1, len(self.node_ports) + 1))

    @property
    def restd_socket(self) -> Path:
        """slurmrestd's own plain-http listener, a unix socket: the TLS relay's upstream,
        on no network at all."""
        return self.root / "restd" / "slurmrestd.socket"

    @property
    def rest_url(self) -> str:
        return f"https://{self.address}:{self.rest_port}" if self.rest_port else ""


    @property
    def uses_rest(self) -> bool:
        return self.rest_port is not None


# A replicated sandbox's federation daemons: one per trusted site, sharing the state in
# the sites' etcd (docs/federation.md, "Replicas"). The rented provider's site has none.
REPLICA_NAMES = {Site.HOME: "home", Site.CONTROL: "control"}


@dataclass(frozen=True)
class SandboxLayout:
    root: Path
    port_base: int = DEFAULT_PORT_BASE
    replicated: bool = False  # `up --replicated`: federation replicas at home and control
    # `up --remote-slurm`: rented is Debian's Slurm from the host's disk ("host"), or the
    # provider's stock Slurm on a machine of its own ("provider", sandbox.remote_site; what
    # `Sandbox` makes by default)
    remote_slurm: str = "host"

    @property
    def federation_sites(self) -> tuple[Site, ...]:
        """Where a federation daemon runs: home, and control too when replicated."""
        return tuple(REPLICA_NAMES) if self.replicated else (Site.HOME,)

    def federation_config(self, site: Site) -> Path:
        """The config file of the federation daemon at `site`: home's is the sandbox's
        site config; control's differs in its [federation] replica and addresses."""
        if site is Site.HOME:
            return self.site_config
        return self.root / f"slurm-geo-{REPLICA_NAMES[site]}.toml"

    @property
    def topology(self) -> Topology:
        """The sandbox's sites and links (sandbox.sites), named and numbered from its
        directory."""
        return topology(self.network_prefix, self.network_block_index)

    def address(self, site: Site) -> str:
        return str(self.topology.site_address(site))

    def namespace(self, site: Site) -> str:
        return self.topology.namespace(site)

    @property
    def onprem(self) -> ClusterLayout:
        b, home = self.port_base, Site.HOME
        return ClusterLayout(
            "onprem", "home", self.root / "onprem", home, self.namespace(home),
            self.address(home), b + 10, b + 11, (b + 12, b + 13)
        )

    @property
    def rented(self) -> ClusterLayout:
        b, remote = self.port_base, Site.REMOTE
        return ClusterLayout(
            "rented", "remote", self.root / "rented", remote, self.namespace(remote),
            self.address(remote), b + 20, b + 21, (b + 22, b + 23), b + 25
        )

    @property
    def clusters(self) -> tuple[ClusterLayout, ClusterLayout]:
        return (self.onprem, self.rented)

    @property
    def host_clusters(self) -> tuple[ClusterLayout, ...]:
        """The clusters whose Slurm runs from the host's disk (slurm.conf, daemons here)."""
        return self.clusters if self.remote_slurm == "host" else (self.onprem,)

    @property
    def provider_dir(self) -> Path:
        """The provider's machine (remote_slurm "provider"): its site (sandbox.provider)."""
        return self.root / "provider"

    def cluster(self, name: str) -> ClusterLayout | None:
        return next((c for c in self.clusters if c.name == name), None)

    @property
    def mariadb_port(self) -> int:
        return self.port_base + 30

    @property
    def s3_port(self) -> int:
        return self.port_base + 40

    @property
    def s3_endpoint(self) -> str:
        """The offsite store's S3 endpoint, at the remote site: TLS with a certificate of
        the site CA (`ca_cert`), as its traffic crosses the WAN."""
        return f"https://{self.address(Site.REMOTE)}:{self.s3_port}"

    @property
    def s3_internal_ports(self) -> tuple[int, int, int, int, int, int, int]:
        """The S3 server's own ports behind the S3 one (sandbox.seaweed.SeaweedServer);
        45 is checkpoint-sync's metrics."""
        b = self.port_base
        return (b + 41, b + 42, b + 43, b + 44, b + 46, b + 47, b + 48)

    @property
    def s3_dir(self) -> Path:
        """The S3 server's keys and objects (0700); `down` keeps it, so objects persist."""
        return self.root / "s3"

    @property
    def s3_data_dir(self) -> Path:
        return self.s3_dir / "offsite"

    @property
    def s3_identities(self) -> Path:
        """Its -s3.config: who may do what, with their secrets (0600)."""
        return self.s3_dir / "identities.json"

    @property
    def s3_daemon_credentials(self) -> Path:
        """The daemons' key to the S3 server (an env file, 0600): full access."""
        return self.s3_dir / "daemons.env"

    @property
    def etcd_client_port(self) -> int:
        return self.port_base + 60

    @property
    def etcd_peer_port(self) -> int:
        return self.port_base + 61

    @property
    def etcd_dir(self) -> Path:
        """The members' data, one directory (0700) per site: `etcd/remote` is the rented
        provider's disk and holds sealed values only. `down` keeps them."""
        return self.root / "etcd"

    @property
    def etcd_cluster(self) -> EtcdCluster:
        """The etcd members, one per site (sandbox.etcd_members)."""
        return cluster_in(self.topology, self.etcd_client_port, self.etcd_peer_port,
                          self.etcd_dir, EtcdFiles(self.ca_cert, self.tls_dir))

    @property
    def etcd_endpoints(self) -> tuple[str, ...]:
        """The members' client URLs (home, control, remote): what a federation replica
        names to reach the state; `sandbox status --json` shows each."""
        return self.etcd_cluster.endpoints

    @property
    def munge_dir(self) -> Path:
        return self.root / "munge"

    @property
    def munge_socket(self) -> Path:
        return self.munge_dir / "munge.socket"

    @property
    def mariadb_dir(self) -> Path:
        return self.root / "mariadb"

    @property
    def mariadb_socket(self) -> Path:
        return self.mariadb_dir / "mysqld.sock"

    @property
    def db_password_file(self) -> Path:
        return self.mariadb_dir / "slurm.password"

    @property
    def pfs_dir(self) -> Path:
        """Stands for the on-prem parallel filesystem."""
        return self.root / "pfs"

    @property
    def projects_dir(self) -> Path:
        return self.root / "projects"

    def project_dir(self, user: str) -> Path:
        """A user's own directory for job scripts, outputs and traces (0700, theirs)."""
        return self.projects_dir / user

    @property
    def site_python_dir(self) -> Path:
        """The venv every sandbox user's jobs run (sandbox.users): one for all sandboxes
        of this machine, as a site has one software tree, kept by `down --purge`."""
        return SITE_PYTHON_DIR

    @property
    def site_python(self) -> Path:
        return self.site_python_dir / "bin" / "python3"

    @property
    def master_key(self) -> Path:
        """The site master key checkpoints are sealed under (it stays on-prem)."""
        return self.root / "master.key"

    @property
    def offsite_job_credentials(self) -> Path:
        """What jobs the federation daemon moves to rented get for the offsite store."""
        return self.root / "offsite-job.env"

    @property
    def tls_dir(self) -> Path:
        """The sandbox's site CA and the certificates it issues (sandbox.certs)."""
        return self.root / "tls"

    @property
    def ca_cert(self) -> Path:
        return self.tls_dir / "site-ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.tls_dir / "site-ca.key"

    @property
    def federation_cert(self) -> Path:
        return self.tls_dir / "federation.pem"

    @property
    def federation_key(self) -> Path:
        return self.tls_dir / "federation.key"

    @property
    def rest_cert(self) -> Path:
        """The certificate the TLS relay in front of rented's slurmrestd presents."""
        return self.tls_dir / "slurmrestd.pem"

    @property
    def rest_key(self) -> Path:
        return self.tls_dir / "slurmrestd.key"

    @property
    def site_config(self) -> Path:
        return self.root / "slurm-geo.toml"

    @property
    def state_file(self) -> Path:
        return self.root / "sandbox.json"

    @property
    def sites_file(self) -> Path:
        """The WAN rate the sites were last given (`up --wan-mbit`, `wan --mbit`); apart
        from sandbox.json, which `up` rewrites whole."""
        return self.root / "sites.json"

    @property
    def _root_digest(self) -> str:
        return hashlib.sha256(os.path.abspath(self.root).encode()).hexdigest()

    @property
    def network_prefix(self) -> str:
        """Names of this sandbox's namespaces and links (sandbox.sites): `sg` and 4 hex
        digits of its directory, so two sandboxes of one machine never share one."""
        return f"sg{self._root_digest[:4]}-"

    @property
    def preferred_block_index(self) -> int:
        """The B its directory suggests (1-254); `up` takes the next free one when another
        network already holds it, and remembers which in `network_block_file`."""
        return 1 + int(self._root_digest[4:12], 16) % 254

    @property
    def network_block_file(self) -> Path:
        return self.root / "network-block"

    @property
    def network_block_index(self) -> int:
        """B of the sandbox's addresses, 10.77.B.0/24: the one `up` chose and remembered,
        else the one its directory suggests."""
        try:
            chosen = int(self.network_block_file.read_text().strip())
        except (OSError, ValueError):
            return self.preferred_block_index
        return chosen if 1 <= chosen <= 254 else self.preferred_block_index


def root_from_env(explicit: Path | None = None) -> Path:
    return explicit or Path(os.environ.get(ROOT_ENV) or DEFAULT_ROOT)
