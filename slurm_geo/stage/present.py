"""A moved job sees its world at its home paths (issue 31 item 3; docs/training.md "A
moved job's world"; docs/format.md §11.7).

The moved job's preamble, as the job's user, calls `prepare` with the job's `World`, its
working directory and script, and per home path either a directory already materialised
or the staged tree to materialise from the site's store (`StagedRoot`, read with
`Trees`, every chunk verified). Each tree is materialised under the job's private
workspace (workspace.Workspace: 0700, on node-local or scratch storage), then presented
one of four ways, chosen by what the node allows (node.choose):

* namespace: a user and mount namespace of the job's own shows each tree at its home
  path (inputs, environment and script read-only; outputs and the working directory
  writable copies), and the trainer runs in it as the job's uid (stage.nsexec);
* container: the same, with an enroot squashfs image unpacked as the root;
* apptainer: `apptainer exec` of a SIF image, each tree bound at its home path;
* mapped: no namespace allowed: each home path P lies at $SLURM_GEO_WORLD_ROOT/P.

In every mode the job finds its roots in variables (`variables`): SLURM_GEO_INPUT_<n>
(declared order, from 0), SLURM_GEO_ENV, SLURM_GEO_OUTPUT_<n>, SLURM_GEO_WORKDIR,
SLURM_GEO_SCRIPT, each the path to use, and SLURM_GEO_WORLD_ROOT ("" where the home paths
themselves work), so that `$SLURM_GEO_WORLD_ROOT$P` is right in all of them.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

from slurm_geo.errors import SlurmGeoError
from slurm_geo.exitcodes import ExitCode
from slurm_geo.policy.directives import quote
from slurm_geo.policy.world import World
from slurm_geo.stage import nsexec
from slurm_geo.stage.node import Choice, Node, choose, env_kind, unpack
from slurm_geo.stage.nsexec import PLAN_VARIABLE
from slurm_geo.stage.trees import Trees
from slurm_geo.stage.workspace import Workspace

What = Literal["input", "env", "workdir", "script", "output"]
# Host paths a container's root gets from the node, bound at the same place.
CONTAINER_CARRY = ("/dev", "/proc", "/sys", "/tmp", "/etc/resolv.conf", "/etc/hosts")
ENV_PREFIX = "SLURM_GEO_"


class PresentError(SlurmGeoError):
    exit_code = ExitCode.USAGE


@dataclass(frozen=True)
class StagedRoot:
    """A home path's staged tree in the site's store: which snapshot to materialise."""

    tree: str
    snapshot: int
    domain: str | None = None


Source = Path | StagedRoot


@dataclass(frozen=True)
class Root:
    what: What
    home: str  # the path the job used at home
    at: Path  # where it lies on the node
    read_only: bool
    file: bool = False


@dataclass(frozen=True)
class Presentation:
    choice: Choice
    roots: tuple[Root, ...]
    uid: int
    gid: int
    world_dir: Path  # mapped mode: $SLURM_GEO_WORLD_ROOT
    new_root: Path  # namespace mode's mount point for a new "/"
    image: Path | None = None  # container mode: the unpacked root; apptainer: the SIF
    env_kind: str = "none"
    extra: Mapping[str, str] = field(default_factory=dict)

    @property
    def mode(self) -> str:
        return self.choice.mode

    def where(self, root: Root) -> str:
        """The path the job uses for `root` in this mode."""
        return str(root.at) if self.mode == "mapped" else root.home

    def variables(self, path: str | None = None) -> dict[str, str]:
        """The job's variables; `path`: the PATH the environment's bin goes in front of."""
        found = {f"{ENV_PREFIX}WORLD_MODE": self.mode,
                 f"{ENV_PREFIX}WORLD_ROOT": str(self.world_dir) if self.mode == "mapped"
                 else ""}
        counts = {"input": 0, "output": 0}
        for root in self.roots:
            if root.what in counts:
                found[f"{ENV_PREFIX}{root.what.upper()}_{counts[root.what]}"] = self.where(root)
                counts[root.what] += 1
            else:
                found[f"{ENV_PREFIX}{root.what.upper()}"] = self.where(root)
        found[f"{ENV_PREFIX}INPUTS"] = str(counts["input"])
        found[f"{ENV_PREFIX}OUTPUTS"] = str(counts["output"])
        env = next((r for r in self.roots if r.what == "env" and not r.file), None)
        if env is not None:
            found.update(_env_variables(self.where(env), env.at,
                                        os.environ.get("PATH", "") if path is None else path))
        return {**found, **self.extra}

    def line(self) -> str:
        """The one line the job's output gets: the mode, why, and what is where."""
        ro = [r.home for r in self.roots if r.read_only]
        rw = [r.home for r in self.roots if not r.read_only]
        shown = (f"read-only {', '.join(ro) or '-'}; writable {', '.join(rw) or '-'}")
        if self.mode == "mapped":
            venv = "; a venv may need its home path" if self.env_kind == "directory" else ""
            return (f"slurm-geo: world: mapped ({self.choice.why}): each home path P is at "
                    f"$SLURM_GEO_WORLD_ROOT/P, SLURM_GEO_WORLD_ROOT={self.world_dir}; "
                    f"{shown}{venv}")
        return f"slurm-geo: world: {self.mode} ({self.choice.why}): at home paths, {shown}"

    def to_json(self) -> dict[str, object]:
        """What `from_json` reads back: the presentation of a node's world, written in its
        workspace for the tasks of the job's steps there (stage.steps)."""
        return {"mode": self.choice.mode, "why": self.choice.why, "uid": self.uid,
                "gid": self.gid, "world_dir": str(self.world_dir),
                "new_root": str(self.new_root),
                "image": None if self.image is None else str(self.image),
                "env_kind": self.env_kind, "extra": dict(self.extra),
                "roots": [{"what": r.what, "home": r.home, "at": str(r.at),
                           "read_only": r.read_only, "file": r.file} for r in self.roots]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Presentation:
        roots = tuple(Root(r["what"], str(r["home"]), Path(r["at"]), bool(r["read_only"]),
                           bool(r["file"])) for r in data["roots"])
        return cls(Choice(data["mode"], str(data["why"])), roots, int(data["uid"]),
                   int(data["gid"]), Path(data["world_dir"]), Path(data["new_root"]),
                   None if data["image"] is None else Path(data["image"]),
                   str(data["env_kind"]), {str(k): str(v) for k, v in data["extra"].items()})

    def plan(self) -> dict[str, object]:
        """What stage.nsexec mounts (namespace and container modes)."""
        binds = [{"source": str(r.at), "target": r.home, "read_only": r.read_only,
                  "file": r.file} for r in self.roots
                 if not (r.what == "env" and self.mode == "container")]
        container = self.mode == "container"
        return {"uid": self.uid, "gid": self.gid, "binds": binds,
                "root": str(self.image) if container else None,
                "carry": list(CONTAINER_CARRY) if container else [],
                "scratch_root": str(self.new_root), "cwd": self._cwd()}

    def _cwd(self) -> str | None:
        workdir = next((r for r in self.roots if r.what == "workdir"), None)
        return None if workdir is None else self.where(workdir)

    def command(self, argv: list[str], environ: Mapping[str, str] | None = None,
                python: str = sys.executable) -> tuple[list[str], dict[str, str], str | None]:
        """`(argv, environment, cwd)` that run `argv` in the presented world (`python`
        runs stage.nsexec, by its file: it needs the standard library only)."""
        base = dict(os.environ if environ is None else environ)
        env = {**base, **self.variables(base.get("PATH", ""))}
        if self.mode in ("namespace", "container"):
            env[PLAN_VARIABLE] = json.dumps(self.plan())
            return [python, "-I", nsexec.__file__, "--", *argv], env, None
        if self.mode == "apptainer":
            return apptainer_argv(self, argv), env, None
        return list(argv), env, self._cwd()


def _env_variables(where: str, at: Path, path: str) -> dict[str, str]:
    """A venv or conda environment on PATH first, as its activation would put it."""
    found = {f"{ENV_PREFIX}ENV_BIN": f"{where}/bin"}
    if (at / "pyvenv.cfg").exists():
        found["VIRTUAL_ENV"] = where
    elif (at / "conda-meta").is_dir():
        found["CONDA_PREFIX"] = where
    found["PATH"] = f"{where}/bin:{path or '/usr/bin:/bin'}"
    return found


def apptainer_argv(presentation: Presentation, argv: list[str]) -> list[str]:
    """`apptainer exec` of the SIF with every other root bound at its home path."""
    assert presentation.image is not None
    command = ["apptainer", "exec"]
    for root in presentation.roots:
        if root.what == "env":
            continue
        command += ["--bind", f"{root.at}:{root.home}:{'ro' if root.read_only else 'rw'}"]
    cwd = presentation._cwd()
    if cwd:
        command += ["--pwd", cwd]
    return [*command, str(presentation.image), *argv]


def wanted_roots(world: World, workdir: str | None, script: str | None
                 ) -> list[tuple[What, str, bool]]:
    """`(what, home path, read_only)` of every root the job's world has, in the order
    presented. The script is left out where the working directory (or an input) holds it.
    Pure."""
    roots: list[tuple[What, str, bool]] = [("input", i.path, True) for i in world.inputs]
    if world.env:
        roots.append(("env", world.env, True))
    if workdir:
        roots.append(("workdir", workdir, False))
    if script and not any(script.startswith(path.rstrip("/") + "/") for _, path, _ in roots):
        roots.append(("script", script, True))
    roots += [("output", path, False) for path in world.outputs]
    return roots


def prepare(world: World, sources: Mapping[str, Source], workspace: Workspace,
            node: Node, trees: Trees | None = None, workdir: str | None = None,
            script: str | None = None) -> Presentation:
    """Materialise every root of the job's world into the (open) workspace and decide
    how it is presented. `sources` maps each home path of an input, the environment, the
    working directory and the script to its materialised directory or staged tree; an
    output needs none (an empty writable directory is made)."""
    choice = choose(node, world.env)
    roots = []
    for what, home, read_only in wanted_roots(world, workdir, script):
        at = workspace.at(home)
        if what == "output":
            at.mkdir(parents=True, mode=0o700)
            roots.append(Root(what, home, at, False))
            continue
        source = sources.get(home)
        if source is None:
            raise PresentError(f"no staged tree for the {what} {quote(home)}: the job was "
                               "handed none; stage it (--geo-failover=auto) or drop it")
        at = _materialised(source, at, trees, what, home)
        roots.append(Root(what, home, at, read_only, at.is_file()))
    image = None
    kind = env_kind(world.env)
    if kind in ("squashfs", "sif"):
        env_root = next(r for r in roots if r.what == "env")
        image = env_root.at
        if kind == "squashfs":
            assert node.unsquashfs is not None
            image = workspace.image / "rootfs"
            unpack(env_root.at, image, node.unsquashfs)
    return Presentation(choice, tuple(roots), os.getuid(), os.getgid(), workspace.world,
                        workspace.new_root, image, kind)


def _materialised(source: Source, at: Path, trees: Trees | None, what: str,
                  home: str) -> Path:
    if isinstance(source, StagedRoot):
        if trees is None:
            raise PresentError(f"the {what} {quote(home)} is a staged tree and no store "
                               "was given to read it from")
        at.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        trees.materialise(source.tree, source.snapshot, at, source.domain)
        return at
    path = Path(source)
    if not path.exists():
        raise PresentError(f"the {what} {quote(home)}: its materialised copy "
                           f"{quote(str(path))} does not exist")
    at.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    at.symlink_to(path.absolute())  # so that $SLURM_GEO_WORLD_ROOT/P holds in every mode
    return at


def run(presentation: Presentation, argv: list[str], out: TextIO = sys.stdout,
        python: str = sys.executable) -> int:
    """Say the mode in one line on the job's output, then run `argv` in the world; its
    exit code (its output goes to `out` too)."""
    import subprocess

    print(presentation.line(), file=out, flush=True)
    command, env, cwd = presentation.command(argv, python=python)
    return subprocess.run(command, env=env, cwd=cwd, stdout=out, check=False).returncode
