"""Running a hook for Slurm: never raise, never fail the job for slurm-geo's own trouble.

A node Prolog that exits non-zero drains the node and requeues the job, so every hook
here logs what went wrong and exits 0: a broken config or an unreachable store must cost
at most the geo extras of one job, never a node. A job whose uid or gid Slurm did not
pass gets one log line and nothing else: the hooks run as root and act as the job's user,
never as root in its stead. The thin scripts in slurm_geo/share/hooks/ call
`run_hook` only for geo jobs; everything else has already exited.

Log: $SLURM_GEO_HOOK_LOG, else /var/log/slurm-geo/hooks.log when that directory exists,
else stderr (which slurmd discards).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from slurm_geo.jobenv import JobEnv

log = logging.getLogger("slurm_geo.hooks")

DEFAULT_LOG = Path("/var/log/slurm-geo/hooks.log")
HOOKS = ("prolog", "epilog", "prolog_slurmctld", "epilog_slurmctld")


def run_hook(name: str, env: Mapping[str, str] = os.environ,
             clock: Callable[[], float] = time.time) -> int:
    _set_up_logging(env)
    try:
        from slurm_geo.hooks.context import job_context

        job = job_context(env)
        if not job.ids_known:
            slurm = JobEnv.from_environ(env)
            log.warning("%s of job %s does nothing: SLURM_JOB_UID/SLURM_JOB_GID missing or "
                        "not an id (%r/%r), and a hook never acts as root for a job", name,
                        slurm.job_id or "?", slurm.uid or None, slurm.gid or None)
            return 0
        site = _site_or_none()
        _dispatch(name, job, site, env, clock())
    except Exception as exc:
        if type(exc).__name__ == "RecordsRefused":  # slurm_geo.jobrecords, imported or not
            # A co-tenant's directory in place of the job's records: one line, no traceback.
            log.error("%s of job %s: %s", name, JobEnv.from_environ(env).job_id or "?", exc)
        else:
            log.exception("%s of job %s failed; the job goes on without it", name,
                          JobEnv.from_environ(env).job_id or "?")
    return 0


def _dispatch(name: str, job: Any, site: Any, env: Mapping[str, str], now: float) -> None:
    from slurm_geo.hooks import ctld, node

    if name == "prolog":
        node.prolog(job, now)
    elif name == "epilog":
        node.epilog(job, protection_of(site, job), now, sync_judge(site, job),
                    cluster_store(site, job))
    elif name in ("prolog_slurmctld", "epilog_slurmctld"):
        from slurm_geo.registry import Registry

        if site is None:
            log.warning("%s: no config, so no registry to record job %s in", name, job.tag)
            return
        with Registry(site.registry_path) as registry:
            if name == "prolog_slurmctld":
                ctld.prolog_slurmctld(job, registry, now)
            else:
                max_restarts = site.policy.max_restarts
                ctld.epilog_slurmctld(job, registry, max_restarts,
                                      lambda: controller_client(site, job.cluster, env), now)
    else:
        raise ValueError(f"unknown hook {name!r}; expected one of {', '.join(HOOKS)}")
    log.info("%s done for job %s (restart %d)", name, job.tag, job.restart)


def _set_up_logging(env: Mapping[str, str]) -> None:
    path = Path(env["SLURM_GEO_HOOK_LOG"]) if env.get("SLURM_GEO_HOOK_LOG") else DEFAULT_LOG
    handler: logging.Handler
    try:
        handler = logging.FileHandler(path) if path.parent.is_dir() else logging.StreamHandler()
    except OSError:
        handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s {os.getpid()} %(levelname)s %(message)s"))
    root = logging.getLogger("slurm_geo")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)


def _site_or_none() -> Any:
    from slurm_geo.config import load_config
    from slurm_geo.errors import ConfigError

    try:
        return load_config()
    except ConfigError as exc:
        log.warning("no usable slurm-geo config (%s); going on with defaults", exc)
        return None


def protection_of(site: Any, job: Any) -> Any:
    """Whether checkpoint-sync replicates the job's directory: as one of its roots, as a
    registered job's directory, or not (slurm_geo.sync.jobdirs)."""
    from slurm_geo.sync.jobdirs import protection, sync_site

    real_path = os.path.realpath(job.directives.ckpt_dir)
    if site is None or site.sync is None:
        return protection(real_path, job.directives, job.cluster, None)
    urls = {name: store.url for name, store in site.stores.items()}
    destination = site.stores[site.sync.destination]
    return protection(real_path, job.directives, job.cluster,
                      sync_site(site.sync.roots, urls, site.sync.destination,
                                destination.region, site.home_cluster, site.policy,
                                os.path.realpath))


def sync_judge(site: Any, job: Any) -> Any:
    """What checkpoint-sync's state says of the job's directory, read now (as root: the
    database is the service account's), judged once the epilog knows the final
    checkpoint's run (slurm_geo.sync.truth). Where the state cannot be read here (it
    lives on checkpoint-sync's host), the record says so beside the configuration's
    answer."""
    from slurm_geo.sync.jobdirs import file_roots, job_root

    if site is None or site.sync is None:
        return None
    real_path = os.path.realpath(job.directives.ckpt_dir)
    urls = {name: store.url for name, store in site.stores.items()}
    roots = {name: os.path.realpath(path)
             for name, path in file_roots(site.sync.roots, urls).items()}
    # The replicas' root: a configured root's name, else the job directory's own.
    configured = next((name for name, path in sorted(roots.items()) if path == real_path),
                      None)
    root = configured or job_root(real_path)
    kind = "root" if configured else "job"  # a root's row, never a job's that named it
    return state_judge(site, root, kind)


def cluster_store(site: Any, job: Any) -> Any:
    """The store the config gives the job's cluster, where a FederatedRun saves, with
    checkpoint-sync's answer for it (slurm_geo.lease.places): the epilog judges a
    federated run by it."""
    from slurm_geo.hooks.node import ClusterStore
    from slurm_geo.lease import places
    from slurm_geo.sync.jobdirs import Protection

    if site is None:
        return None
    if job.cluster not in site.clusters:
        return ClusterStore("", "", Protection(None, False, f"the slurm-geo config names no "
                                               f"cluster '{job.cluster}', nor its store"))
    name = site.clusters[job.cluster].store
    url = site.stores[name].url
    sync = None if site.sync is None else places.SyncFacts(
        site.sync.roots, site.sync.destination, site.home_cluster)
    place = places.where(job.cluster, name, url, sync)
    if not place.replicated:
        return ClusterStore(name, url, Protection(None, False, place.why))
    assert site.sync is not None
    root = name if name in site.sync.roots else url  # as [sync] roots names it
    return ClusterStore(name, url, Protection(root, True, "root"),
                        state_judge(site, root, "root"))


def state_judge(site: Any, root: str, kind: str) -> Any:
    """checkpoint-sync's state of one root (`kind` "root") or job directory ("job"),
    read now as root, as a judge of the configuration's answer (slurm_geo.sync.truth)."""
    from dataclasses import replace

    from slurm_geo.sync.state import StateDB, SyncError
    from slurm_geo.sync.truth import sync_verdict

    try:
        state = StateDB(site.sync.state, readonly=True)
        try:
            source = next((s for s in state.sources() if s.root == root and s.kind == kind),
                          None)
            replicas = state.replicas("root = ?", [root])
        finally:
            state.close()
    except (SyncError, OSError) as exc:
        unread = f"unconfirmed: checkpoint-sync's state is not readable here ({exc})"
        return lambda meant, _run: replace(meant, note=unread) if meant.replicated else meant
    return lambda meant, run: sync_verdict(meant, source, replicas, run)


def controller_client(site: Any, cluster: str, env: Mapping[str, str]) -> Any:
    """This controller, by its own commands: the hook runs on the controller's host."""
    from slurm_geo.slurm import CliSlurmClient

    configured = site.clusters.get(cluster) if site else None
    conf = (JobEnv.from_environ(env).slurm_conf or (configured and configured.slurm_conf)
            or "/etc/slurm/slurm.conf")
    timeout = configured.timeout_s if configured else 10.0
    return CliSlurmClient(cluster, Path(conf), timeout)
