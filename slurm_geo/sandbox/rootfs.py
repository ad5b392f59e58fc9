"""The rented provider's machine image: a Debian root filesystem with today's stock Slurm.

A GPU cloud runs a Slurm of its own on its own disk. The sandbox stands for it with a root
filesystem built by mmdebstrap from Debian's newest suite (sid: Slurm 26.05), once per
machine, kept under /var/lib/slurm-geo/ next to the site Python (every sandbox here shares
it, read-only), and built again when it is missing or was built from another recipe.

The build is atomic: into a temporary directory beside the image, then renamed into place,
with a stamp (`STAMP`, JSON) naming the recipe (suite, packages, layout version) and what
it gave (`slurmctld -V`'s version, seconds, bytes). A half-built root is never taken for
an image: without its stamp it is built again. One build at a time (a lock file), since
two sandboxes may come up at once.

The image carries the mount points for what the provider site (sandbox.provider) lays
over it: the site's own /home, /tmp and /scratch, and the host's Python bound read-only
(provider.PYTHON_BINDS says why that stands for the provider's own image).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from slurm_geo.errors import SandboxError

IMAGE_DIR = Path("/var/lib/slurm-geo/provider-root")
# Where a sandbox's provider image is, when not IMAGE_DIR: a benchmark that times `sandbox
# up` from scratch, image included, builds one of its own there and leaves the shared one
# to the sandboxes running on it. Read from the sandbox operator's (root's) own shell.
IMAGE_DIR_ENV = "SLURM_GEO_PROVIDER_IMAGE"
STAMP = Path("etc/slurm-geo-image.json")  # inside the image
SUITE = "sid"  # Debian's newest: Slurm 26.05.5 (trixie has 24.11, bookworm 22.05)
MIRROR = "http://deb.debian.org/debian"
# The provider's Slurm and its accounting database (slurmdbd runs in the root too), the
# tools the site's setup runs inside (mount, umount), and the shared libraries the host's
# Python 3.11 and its extension modules load (libexpat, libffi, libssl, ...).
PACKAGES = (
    "slurmctld", "slurmd", "slurmdbd", "slurmrestd", "slurm-client", "slurm-wlm-jwt-plugin",
    "munge",
    "mariadb-server", "mount", "util-linux", "procps", "iproute2", "ca-certificates",
    "libexpat1", "libffi8", "libssl3t64", "libsqlite3-0", "libbz2-1.0", "liblzma5",
    "libuuid1", "libgomp1", "libncursesw6", "libreadline8t64",
)
# Home's Slurm of Debian 13 (trixie: 24.11), for the CLI backend's tests against it: the
# same image without slurmrestd (home is reached by Slurm's own commands) or MUNGE
# (auth/slurm), kept beside the provider's under its own name.
HOME_2411_IMAGE_DIR = Path("/var/lib/slurm-geo/home-root-trixie")
HOME_2411_PACKAGES = tuple(p for p in PACKAGES if p not in ("slurmrestd", "munge"))
# Bump when the hook below or what the provider site expects of the image changes: an
# image of another layout is rebuilt.
LAYOUT = 1
# Mount points the provider site binds over (the image itself is mounted read-only), and
# no documentation: an image, not a workstation.
MOUNT_POINTS = ("scratch", ".oldroot", "usr/lib/python3.11", "var/lib/slurm-geo/site-python")
FILE_MOUNT_POINTS = ("usr/bin/python3.11", "etc/hosts", "etc/hostname")
DPKG_EXCLUDES = ("/usr/share/doc/*", "/usr/share/man/*", "/usr/share/locale/*",
                 "/usr/share/info/*")
BUILD_TIMEOUT_S = 900
# What apt says when the registry cannot be reached (as opposed to a recipe it refuses).
UNREACHABLE_MARKERS = ("Temporary failure resolving", "Could not resolve", "Failed to fetch",
                       "Could not connect", "Network is unreachable", "Connection timed out")


class RegistryUnreachable(SandboxError):
    """mmdebstrap could not reach Debian's registry: no image can be built here now."""


@dataclass(frozen=True)
class Recipe:
    suite: str = SUITE
    mirror: str = MIRROR
    packages: tuple[str, ...] = PACKAGES
    layout: int = LAYOUT


HOME_2411 = Recipe(suite="trixie", packages=HOME_2411_PACKAGES)


@dataclass(frozen=True)
class Stamp:
    suite: str
    packages: list[str]
    layout: int
    slurm_version: str
    build_s: float
    size_bytes: int
    built_at: str


def customize_hook() -> str:
    """The shell run on the finished root ($1): mount points, `python3`, the image's own
    MariaDB data directory removed (each provider site initialises its own)."""
    dirs = " ".join(f'"$1/{d}"' for d in MOUNT_POINTS)
    files = " ".join(f'"$1/{f}"' for f in FILE_MOUNT_POINTS)
    return (f"mkdir -p {dirs} && touch {files} && "
            'ln -sf python3.11 "$1/usr/bin/python3" && '
            'rm -rf "$1/var/lib/mysql"/* "$1/var/lib/mariadb"/*')


def mmdebstrap_argv(recipe: Recipe, target: Path) -> list[str]:
    """The build command. Pure. The unstable suite's Release file is often past its
    Valid-Until date, which apt refuses unless told not to check it."""
    return [
        "mmdebstrap", "--variant=apt", "--mode=root",
        "--aptopt=Acquire::Check-Valid-Until \"false\"",
        *(f"--dpkgopt=path-exclude={pattern}" for pattern in DPKG_EXCLUDES),
        f"--include={','.join(recipe.packages)}",
        f"--customize-hook={customize_hook()}",
        recipe.suite, str(target), recipe.mirror,
    ]


def slurm_version(output: str) -> str:
    """'26.05.5' from `slurmctld -V` ('slurm-wlm 26.05.5' on Debian, 'slurm 26.05.5'
    elsewhere); '' if it names none. Pure."""
    found = re.search(r"\bslurm(?:-wlm)?\s+(\d+\.\d+\.\d+)", output)
    return found.group(1) if found else ""


def stamp_fits(stamp: dict[str, Any] | None, recipe: Recipe) -> bool:
    """Whether an image with this stamp was built from `recipe` (and gave a Slurm). Pure."""
    if not stamp:
        return False
    return (stamp.get("suite") == recipe.suite and stamp.get("layout") == recipe.layout
            and sorted(stamp.get("packages") or []) == sorted(recipe.packages)
            and bool(stamp.get("slurm_version")))


def provider_image_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """The provider image a sandbox uses: IMAGE_DIR, or $SLURM_GEO_PROVIDER_IMAGE."""
    named = environ.get(IMAGE_DIR_ENV, "")
    if named and not named.startswith("/"):
        raise SandboxError(f"${IMAGE_DIR_ENV}={named!r}: give an absolute path")
    return Path(named) if named else IMAGE_DIR


def read_stamp(image: Path = IMAGE_DIR) -> dict[str, Any] | None:
    try:
        doc = json.loads((image / STAMP).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def ensure_image(image: Path = IMAGE_DIR, recipe: Recipe = Recipe(),
                 progress: Callable[[str], None] = lambda _line: None) -> dict[str, Any]:
    """The image's stamp, building the image first when it is missing or of another
    recipe. Needs root (mmdebstrap's root mode; chroot)."""
    stamp = read_stamp(image)
    if stamp_fits(stamp, recipe):
        assert stamp is not None
        return stamp
    image.parent.mkdir(parents=True, exist_ok=True)
    with open(image.parent / f".{image.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another sandbox may be building it right now
        stamp = read_stamp(image)
        if stamp_fits(stamp, recipe):
            assert stamp is not None
            return stamp
        progress(f"building a root filesystem ({recipe.suite}, Slurm from Debian) into "
                 f"{image}")
        return _build(image, recipe)


def _build(image: Path, recipe: Recipe) -> dict[str, Any]:
    if shutil.which("mmdebstrap") is None:
        _run(["apt-get", "install", "-y", "-qq", "mmdebstrap"], "install mmdebstrap",
             env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    building = image.with_name(f".{image.name}.building")
    _remove_tree(building)
    began = time.monotonic()
    _run(mmdebstrap_argv(recipe, building), f"mmdebstrap {recipe.suite}")
    version = slurm_version(_run(["chroot", str(building), "slurmctld", "-V"],
                                 "slurmctld -V in the new root"))
    if not version:
        raise SandboxError(f"the root filesystem built in {building} has no slurmctld that "
                           "names its version; remove it and run `slurm-geo sandbox up`")
    stamp = Stamp(recipe.suite, sorted(recipe.packages), recipe.layout, version,
                  round(time.monotonic() - began, 1), _tree_bytes(building),
                  time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    (building / STAMP).write_text(json.dumps(asdict(stamp), indent=1) + "\n")
    old = image.with_name(f".{image.name}.old")
    _remove_tree(old)
    if image.exists():
        image.rename(old)
    building.rename(image)
    _remove_tree(old)
    return asdict(stamp)


def _run(argv: Sequence[str], what: str, env: dict[str, str] | None = None) -> str:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, env=env,
                              timeout=BUILD_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SandboxError(f"{what} failed: {exc}") from None
    if done.returncode != 0:
        text = done.stderr or done.stdout
        tail = text.strip().splitlines()[-3:]
        if any(marker in text for marker in UNREACHABLE_MARKERS):
            raise RegistryUnreachable(f"{what} cannot reach the registry: {' | '.join(tail)}")
        raise SandboxError(f"{what} failed (exit {done.returncode}): {' | '.join(tail)}")
    return done.stdout


def _remove_tree(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total
