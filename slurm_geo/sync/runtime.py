"""What the daemon derives from the site config: stores, regions, policy and the master key.

Built at start and again on SIGHUP, so a reload is "build a new Runtime, then switch".
`open_store` and the environment are passed in; tests hand in wrapped stores. Besides the
configured roots, a runtime reads the job directories the last scan chose to watch
(`watch_job_roots`, slurm_geo.sync.sources): a reload forgets them until the next scan,
which comes first.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from slurm_geo.ckpt.errors import CkptError
from slurm_geo.ckpt.format.keys import LiveKeyFile, MasterKeys
from slurm_geo.ckpt.stores.open_store import open_store as default_open_store
from slurm_geo.ckpt.stores.store import Store
from slurm_geo.ckpt.stores.transfer_plan import DEFAULT_PLAN, TransferPlan, plan_transfers
from slurm_geo.config.model import SiteConfig, SyncConfig, load_config
from slurm_geo.config.paths import master_key_path
from slurm_geo.errors import ConfigError
from slurm_geo.policy.geo import GeoPolicy
from slurm_geo.policy.retention import RetentionPolicy
from slurm_geo.sync.jobdirs import FILE
from slurm_geo.sync.ownedfiles import OwnedDirStore, SkippedFiles

OpenStore = Callable[..., Store]


@dataclass(frozen=True)
class JobRoot:
    """A job's checkpoint directory to read: its real path, and the uids of its users."""

    path: str
    owners: frozenset[int]


@dataclass
class Runtime:
    """One reading of the config, with stores opened on first use."""

    sync: SyncConfig
    policy: RetentionPolicy
    master_keys: MasterKeys = field(repr=False)  # followed as a rotation rewrites it
    destination: str
    destination_store: Store
    destination_region: str
    root_urls: dict[str, tuple[str, str | None]]  # root -> (url, endpoint_url)
    root_regions: dict[str, str]
    open_store: OpenStore = default_open_store
    home_cluster: str = ""
    home_region: str = ""           # of job directories and file:// URL roots
    geo_policy: GeoPolicy = field(default_factory=GeoPolicy)
    registry_path: Path | None = None
    destination_url: str = ""
    store_urls: dict[str, str] = field(default_factory=dict)  # [stores] name -> url
    transfer_plan: TransferPlan = DEFAULT_PLAN  # of the link to the destination
    skipped: SkippedFiles = field(default_factory=SkippedFiles, repr=False)
    _roots: dict[str, Store] = field(default_factory=dict, repr=False)
    _job_roots: dict[str, JobRoot] = field(default_factory=dict, repr=False)

    def root_store(self, root: str) -> Store:
        """The root's store; opening it again later if it failed (an unmounted PFS). A job's
        directory is read as its owner could read it (`slurm_geo.sync.ownedfiles`)."""
        if root not in self._roots:
            job = self._job_roots.get(root)
            if job is not None:
                self._roots[root] = OwnedDirStore(Path(job.path), job.owners, self.skipped)
            else:
                url, endpoint = self.root_urls.get(root, (root, None))
                if url.startswith(FILE):  # read without following links, as a job's
                    path = Path(url.removeprefix(FILE)).resolve()
                    self._roots[root] = OwnedDirStore(path, None, self.skipped)
                else:
                    self._roots[root] = self.open_store(url, endpoint_url=endpoint)
        return self._roots[root]

    def watch_job_roots(self, roots: Mapping[str, JobRoot]) -> None:
        """Read these job directories (file:// roots) too, and no others."""
        wanted = {root: job for root, job in roots.items() if root not in self.root_urls}
        for root in self._job_roots:
            if self._job_roots[root] != wanted.get(root):
                self._roots.pop(root, None)
        self._job_roots = wanted

    def reads(self, root: str) -> bool:
        return root in self.root_urls or root in self._job_roots

    def region_of(self, root: str) -> str:
        return self.root_regions.get(root, self.home_region)


def load_runtime(config_path: Path, env: Mapping[str, str] = os.environ,
                 open_store: OpenStore = default_open_store) -> Runtime:
    """Read the config and key; raises ConfigError or KeyFileError naming the mistake."""
    site = load_config(config_path)
    return runtime_from_site(site, env, open_store)


def runtime_from_site(site: SiteConfig, env: Mapping[str, str] = os.environ,
                      open_store: OpenStore = default_open_store) -> Runtime:
    if site.sync is None:
        raise ConfigError(f"{site.source} has no [sync] table; checkpoint-sync needs at "
                          "least roots = [...] and destination = \"...\" (see "
                          "docs/checkpoint-sync.md)")
    sync = site.sync
    master_keys = LiveKeyFile(master_key_path(sync.key_file, env))
    target = site.stores[sync.destination]
    plan = link_plan(sync)
    try:
        destination_store = open_store(target.url, endpoint_url=target.endpoint_url or None,
                                       plan=plan, ca_file=target.ca_file)
    except CkptError as exc:
        raise ConfigError(f"{site.source} [sync]: destination '{sync.destination}' cannot "
                          f"be opened: {exc}") from None
    home = site.clusters.get(site.home_cluster)
    urls, regions = {}, {}
    for root in sync.roots:
        if root in site.stores:
            store = site.stores[root]
            urls[root] = (store.url, store.endpoint_url or None)
            regions[root] = store.region
        else:
            urls[root] = (root, None)
            regions[root] = home.region if home is not None else ""
    return Runtime(sync=sync, policy=site.retention, master_keys=master_keys,
                   destination=sync.destination, destination_store=destination_store,
                   destination_region=target.region, root_urls=urls, root_regions=regions,
                   open_store=open_store, home_cluster=site.home_cluster,
                   home_region=home.region if home is not None else "",
                   geo_policy=site.policy, registry_path=site.registry_path,
                   destination_url=target.url,
                   store_urls={name: store.url for name, store in site.stores.items()},
                   transfer_plan=plan)


def link_plan(sync: SyncConfig) -> TransferPlan:
    """Streams and part sizes for the link to the destination: its rate is the cap (what
    checkpoint-sync may take of it; none: unknown), its round trip `wan_rtt_ms`."""
    return plan_transfers(sync.bandwidth_mb_s * 1e6 or None, sync.wan_rtt_ms / 1000)
