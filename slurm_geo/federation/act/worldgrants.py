"""The staged trees a job's key reply grants (issue 31: a job's world staged ahead): one
per root of its world, each in the domain of its owner and that root, with that domain's
key ring (docs/format.md §11.2, §11.8; slurm_geo.lease.protocol.TreeGrant).

The daemon never reads a user's path: it names the roots the job's record holds (its
`--geo-inputs`, its `--geo-env`, the working directory Slurm recorded) and derives their
tree ids from the site master key; the home job stages them itself, as its owner
(slurm_geo.stage.home). Each root is granted twice:

* its owner's tree, label `uid:<uid>:<path>`: two users who declare the same path get two
  trees in two domains, and bob's job is never granted the key of alice's;
* the root's shared tree, label `shared:<class>:<regions>:<path>` (the data class and
  regions the job's grant gives the root, so a grantee's narrower declaration makes
  another domain rather than narrowing where another's job may go), one per path for
  every user: the job stages into it only while every user may read the whole root at
  home (slurm_geo.stage.public, judged by the job as it walks), so its key gives no
  grantee anything it could not read at home, and a second user's job on the same
  dataset stores no new chunk (dedup across users; the stager's rules against what
  other grantees may write there: slurm_geo.stage.sharing).

At home, a grant also narrows the domain's residency (`tree-residency/<domain>`, sealed
under the master key; slurm_geo.stage.residency): the data class of the root (an input's
own, else the job's) and the regions it may reside in, which checkpoint-sync reads before
it copies any snapshot of the domain off-site (docs/format.md §11.10).

`world_roots` and `root_residency` are pure; `tree_grants` opens (or, at home, makes) the
domains' rings.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import PurePosixPath

from slurm_geo.ckpt.errors import CkptError, ObjectMissing
from slurm_geo.ckpt.format.keys import MasterKeys, as_master_keys
from slurm_geo.ckpt.stores.store import Store
from slurm_geo.federation.act.resubmit import ScriptOptions
from slurm_geo.federation.model import LogicalJob
from slurm_geo.lease.protocol import TreeGrant
from slurm_geo.policy.directives import DirectiveError, parse_options
from slurm_geo.policy.geo import GeoRules, effective_residency
from slurm_geo.stage.keys import MasterTreeKeys
from slurm_geo.stage.names import tree_id, tree_naming_key
from slurm_geo.stage.residency import TreeResidency, write_residency

log = logging.getLogger("slurm_geo.federation")

Root = tuple[str, str]  # (what: input, env or workdir; absolute home path)


def world_roots(job: LogicalJob) -> tuple[Root, ...]:
    """The roots of the job's world that its jobs stage and a moved incarnation
    materialises: each `--geo-inputs` path, the `--geo-env`, and the working directory
    (its --chdir, else where its owner ran sbatch), each path once, absolute only. A job
    that declares neither inputs nor an environment has none (its working directory is
    staged only for a job that declared a world). Its script needs no tree: the daemon
    holds its text and submits it again. A recorded directive that no longer parses gives
    none (said in the log). Pure."""
    try:
        world = job.world
    except DirectiveError as exc:
        log.warning("%s: no world staged: %s", job.logical_job, exc)
        return ()
    if not world.inputs and world.env is None:
        return ()
    options = ScriptOptions.from_json(job.spec) if job.spec else ScriptOptions()
    found: list[Root] = [("input", i.path) for i in world.inputs]
    if world.env is not None:
        found.append(("env", world.env))
    workdir = options.working_dir or options.submit_dir
    if workdir:
        found.append(("workdir", workdir))
    roots: list[Root] = []
    for what, path in found:
        normal = _normal(path)
        if normal is not None and normal not in (p for _, p in roots):
            roots.append((what, normal))
    return tuple(roots)


def _normal(path: str) -> str | None:
    """The absolute path without a trailing '/' or '.' parts; None for a relative one."""
    pure = PurePosixPath(path)
    if not pure.is_absolute() or ".." in pure.parts:
        return None
    return str(pure)


def tree_label(uid: int, path: str) -> str:
    """The label of the tree of `path` as `uid`'s (its id is the label's HMAC, §11.1)."""
    return f"uid:{uid}:{path}"


def shared_label(path: str, data_class: str, regions: Sequence[str]) -> str:
    """The label of the shared tree of `path` for grants of that class and those regions."""
    return f"shared:{data_class}:{','.join(sorted(regions))}:{path}"


def grant_ids(master_key: bytes, uid: int, roots: Sequence[Root]) -> tuple[tuple[str, str,
                                                                               str], ...]:
    """`(what, path, tree id)` of each root as `uid`'s; each tree is its own domain."""
    naming = tree_naming_key(master_key)
    return tuple((what, path, tree_id(naming, tree_label(uid, path))) for what, path in roots)


def shared_ids(master_key: bytes, roots: Sequence[Root],
               residency: dict[str, tuple[str, tuple[str, ...]]]
               ) -> tuple[tuple[str, str, str], ...]:
    """`(what, path, tree id)` of each root's shared tree (its own domain), whoever asks:
    by the root's class and regions in `residency` (none known: `-` and none). Pure."""
    naming = tree_naming_key(master_key)
    return tuple((what, path, tree_id(naming, shared_label(path, *residency.get(
        path, ("-", ()))))) for what, path in roots)


def root_residency(job: LogicalJob, rules: GeoRules) -> dict[str, tuple[str, tuple[str, ...]]]:
    """`{path: (data class, regions)}` of each root of the job's world: an input's own
    class, else the job's (its --geo-data-class, else the site's default), for the env
    and working directory the job's; the regions that class allows within the job's
    residency. A job whose directives no longer parse gets no region but its home's
    (nothing of it leaves). Pure."""
    try:
        directives = parse_options(job.directives)
    except DirectiveError:
        return {path: ("-", ()) for _, path in world_roots(job)}
    job_class = directives.data_class or rules.policy.default_data_class
    residency = effective_residency(directives, rules)
    classes = {_normal(i.path): i.class_given(job_class) for i in job.world.inputs}
    found = {}
    for _, path in world_roots(job):
        data_class = classes.get(path) or job_class
        allowed = rules.allowed_regions(data_class)
        found[path] = (data_class, tuple(sorted(r for r in residency if r in allowed)))
    return found


def tree_grants(job: LogicalJob, store: Store, master_keys: bytes | MasterKeys,
                create: bool, rules: GeoRules | None = None) -> tuple[TreeGrant, ...]:
    """The job's grants, the rings from `store`: at home `create` makes a domain's ring
    the first time (the home job stages into it) and, given the site's `rules`, narrows
    its residency; elsewhere a domain without a ring there was never copied there and is
    left out (nothing of it is there to read). A job with no recorded owner gets none:
    its trees could not be told apart from another user's."""
    if job.owner is None:
        return ()
    roots = world_roots(job)
    if not roots:
        return ()
    keys = as_master_keys(master_keys)
    rings = MasterTreeKeys(store, keys)
    residency = root_residency(job, rules) if rules is not None else {}
    master = keys.keys()[0]
    grants = []
    for shared, ids in ((False, grant_ids(master, job.owner.uid, roots)),
                        (True, shared_ids(master, roots, residency))):
        for what, path, tree in ids:
            try:
                ring = rings.ring(tree, create=create)
                if create and path in residency:
                    data_class, regions = residency[path]
                    write_residency(store, keys, TreeResidency(tree, (data_class,), regions))
            except ObjectMissing:
                continue
            except CkptError as exc:
                log.warning("%s: no key of the staged tree of %s: %s", job.logical_job, path,
                            exc)
                continue
            grants.append(TreeGrant(what, path, tree, tree, ring, shared))
    return tuple(grants)
