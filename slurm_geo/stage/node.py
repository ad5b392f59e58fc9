"""What a node lets an unprivileged job do to present its world, found by trying, and the
pure choice of how to present it (docs/training.md "A moved job's world").

    Node.probe(scratch)   -> Node(userns=None or why not, unsquashfs=path, ...)
    choose(node, env_kind) -> Choice(mode, why) or a one-line refusal
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from slurm_geo.errors import SlurmGeoError
from slurm_geo.exitcodes import ExitCode
from slurm_geo.policy.directives import quote
from slurm_geo.stage import nsexec

Mode = Literal["namespace", "container", "apptainer", "mapped"]
EnvKind = Literal["none", "directory", "squashfs", "sif"]
PROBE_TIMEOUT_S = 30


class NodeLacks(SlurmGeoError):
    """The node cannot run the job's environment: one line naming what it lacks."""

    exit_code = ExitCode.USAGE


def env_kind(env: str | None) -> EnvKind:
    if env is None:
        return "none"
    if env.endswith((".sqsh", ".squashfs")):
        return "squashfs"
    if env.endswith(".sif"):
        return "sif"
    return "directory"


@dataclass(frozen=True)
class Node:
    userns: str | None  # None: user and mount namespaces work; else why not
    unsquashfs: str | None = None  # paths of the tools found, None where absent
    apptainer: str | None = None
    squashfuse: str | None = None

    @classmethod
    def probe(cls, scratch: Path, python: str = sys.executable,
              which: Callable[[str], str | None] = shutil.which) -> Node:
        """Try the namespace sequence in a child (slurm_geo.stage.nsexec --probe) on
        `scratch`, an empty directory of the user's; look up the tools on PATH."""
        try:
            done = subprocess.run([python, "-I", nsexec.__file__, "--probe", str(scratch)],
                                  capture_output=True, text=True,
                                  timeout=PROBE_TIMEOUT_S, check=False)
            why = None if done.returncode == 0 else (
                done.stderr.strip().splitlines() or ["the probe failed"])[-1]
        except (OSError, subprocess.TimeoutExpired) as exc:
            why = f"the probe could not run: {exc}"
        if why is not None:
            why = why.removeprefix("slurm-geo: error: no user namespace here: ")
        return cls(why, which("unsquashfs"), which("apptainer"), which("squashfuse"))


@dataclass(frozen=True)
class Choice:
    mode: Mode
    why: str  # the reason, for the mode line


def choose(node: Node, env: str | None) -> Choice:
    """How to present a world whose environment is `env` on `node`; `NodeLacks` where it
    cannot be run there at all. Pure."""
    kind = env_kind(env)
    if kind == "sif":
        if node.apptainer:
            return Choice("apptainer", f"the Apptainer image runs with {node.apptainer}")
        raise NodeLacks(f"--geo-env {quote(env or '')} is an Apptainer image and this node "
                        "has no apptainer on PATH; use a node with Apptainer, or a venv or "
                        "an enroot squashfs image")
    if kind == "squashfs":
        if node.userns is not None:
            raise NodeLacks(f"--geo-env {quote(env or '')} is a container image and this "
                            f"node allows no user namespace to run it in ({node.userns}); "
                            "use a venv or conda directory, or a node that allows them")
        if not node.unsquashfs:
            raise NodeLacks(f"--geo-env {quote(env or '')} is a squashfs image and this "
                            "node has no unsquashfs (Debian: squashfs-tools) to unpack it; "
                            "use a venv or conda directory, or a node that has it")
        return Choice("container", "the image unpacked with unsquashfs is the job's root")
    if node.userns is None:
        return Choice("namespace", "user namespaces allowed")
    return Choice("mapped", f"no user namespace on this node ({node.userns})")


def unpack(image: Path, target: Path, unsquashfs: str) -> None:
    """The squashfs `image` unpacked into `target` (which must not exist), as the user."""
    if os.path.lexists(target):
        raise NodeLacks(f"cannot unpack {quote(str(image))}: {quote(str(target))} exists")
    done = subprocess.run([unsquashfs, "-no-xattrs", "-quiet", "-no-progress", "-d",
                           str(target), str(image)], capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["it failed"])[-1]
        raise NodeLacks(f"unsquashfs could not unpack {quote(str(image))}: {last}")
