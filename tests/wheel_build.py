"""The sdist and the wheel a site installs, built from this checkout as a release is.

Shared by the tests that install the package as a site would (tests/test_site_install.py,
tests/test_install_walk.py): the checkout is copied first (its tracked and unignored
files), so nothing is built in it; the sdist by setuptools' standard backend, the wheel
from the unpacked sdist (so the sdist is complete), without build isolation (no network:
the dev extras carry setuptools and wheel).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(argv: list[str | Path], **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True,
                          timeout=kwargs.pop("timeout", 300), check=False, **kwargs)


def build_artifacts(tmp: Path) -> dict[str, Path]:
    """The sdist built from a copy of the checkout, and the wheel built from the sdist,
    both under `tmp`/dist: {"sdist": PATH, "wheel": PATH}."""
    source = tmp / "source"
    listed = run(["git", "-C", REPO, "ls-files", "-z", "--cached", "--others",
                  "--exclude-standard"])
    if listed.returncode == 0:
        for name in filter(None, listed.stdout.split("\0")):
            if (REPO / name).is_file():
                (source / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / name, source / name)
    else:  # not a git checkout: the tree less what builds and runs leave
        shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
            ".git", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", "slurm-*.out"))
    dist = tmp / "dist"
    dist.mkdir()
    done = run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                "print(build_meta.build_sdist(sys.argv[1]))", dist], cwd=source)
    assert done.returncode == 0, done.stderr[-2000:]
    sdist = dist / done.stdout.strip().splitlines()[-1]
    with tarfile.open(sdist) as archive:  # filter= from 3.11.4; Debian 12 has 3.11.2
        if hasattr(tarfile, "data_filter"):
            archive.extractall(tmp / "unpacked", filter="data")
        else:
            archive.extractall(tmp / "unpacked")  # noqa: S202 - our own sdist
    [unpacked] = (tmp / "unpacked").iterdir()
    done = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                "--disable-pip-version-check", "-w", dist, unpacked])
    assert done.returncode == 0, done.stderr[-2000:]
    [wheel] = dist.glob("*.whl")
    return {"sdist": sdist, "wheel": wheel}
