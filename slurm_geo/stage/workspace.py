"""Where a moved job's world is materialised on the node: private to the job's user.

    <base>/slurm-geo-<uid>/            0700, the user's own (refused if anyone else's)
    <base>/slurm-geo-<uid>/job-<id>/   0700, one per job, held by a lock while it runs
    <base>/slurm-geo-<uid>/job-<id>.<node>/   the same, of a node's world for the tasks of
                                       the job's srun steps (stage.steps)
    <base>/slurm-geo-<uid>/.new-<random>/  one being made: locked, then renamed into place
        .lock                          flock(2)ed by the presenting process
        world/<home path>              each materialised tree at its home path below
        image/                         a container image's unpacked root
        root/                          the mount point of a new root (namespace mode)

`base` is node-local or scratch storage (`default_base`). Another user cannot look into a
0700 directory, so cannot read a tree materialised under it whatever the tree's own modes.
A job directory whose lock is free is stale (its job was killed before its cleanup): the
next job of the same user on the node removes it, and an incarnation of the same job
takes its place, so a killed job never blocks the next. Nothing here follows a link: the
user's directory is checked with lstat, and removal never descends through one.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import time
from pathlib import Path

from slurm_geo.errors import SlurmGeoError
from slurm_geo.exitcodes import ExitCode

BASE_VARIABLE = "SLURM_GEO_SCRATCH"  # the site's node-local or scratch storage, if set
NEW_PREFIX = ".new-"  # a job directory being made, renamed to job-<id> once locked
STALE_NEW_S = 3600


class WorkspaceError(SlurmGeoError):
    exit_code = ExitCode.USAGE


def default_base(environ: dict[str, str] | None = None) -> Path:
    """$SLURM_GEO_SCRATCH, else /scratch, else $TMPDIR, else /tmp: the first that is a
    directory this user may create in."""
    environ = dict(os.environ) if environ is None else environ
    candidates = [environ.get(BASE_VARIABLE), "/scratch", environ.get("TMPDIR"), "/tmp"]
    for candidate in candidates:
        if candidate and os.path.isdir(candidate) and os.access(candidate, os.W_OK | os.X_OK):
            return Path(candidate)
    raise WorkspaceError("no node-local storage to materialise the job's world in: set "
                         f"{BASE_VARIABLE} to a directory you may write")


def remove_tree(path: Path) -> None:
    """Remove `path` and everything under it, read-only directories included."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(info.st_mode):
        os.unlink(path)
        return

    def writable(function, name, _exc_info):  # type: ignore[no-untyped-def]
        parent = os.path.dirname(name)
        if not os.path.islink(parent):
            os.chmod(parent, 0o700)
        if os.path.isdir(name) and not os.path.islink(name):
            os.chmod(name, 0o700)
        function(name)

    for directory, subdirectories, _files in os.walk(path):
        os.chmod(directory, 0o700)
        subdirectories[:] = [d for d in subdirectories
                             if not os.path.islink(os.path.join(directory, d))]
    shutil.rmtree(path, onerror=writable)


class Workspace:
    """The job's private directory on the node, made (and stale ones swept) on open."""

    def __init__(self, base: Path, job: str, uid: int | None = None):
        if not job or "/" in job or job.startswith("."):
            raise WorkspaceError(f"job id {job!r}: give the job's id (letters, digits)")
        self.uid = os.getuid() if uid is None else uid
        self.user_dir = Path(base) / f"slurm-geo-{self.uid}"
        self.path = self.user_dir / f"job-{job}"
        self._lock: int | None = None

    @property
    def world(self) -> Path:
        return self.path / "world"

    @property
    def image(self) -> Path:
        return self.path / "image"

    @property
    def new_root(self) -> Path:
        return self.path / "root"

    def at(self, home_path: str) -> Path:
        """Where the tree of `home_path` lies under the world directory."""
        return self.world / home_path.lstrip("/")

    def open(self) -> Workspace:
        """Made under a name no sweep touches, locked, then renamed into place: another
        process of the user sweeping at the same time (a step's task on another "node" of
        the same machine) never sees it unlocked."""
        self._user_dir()
        self.sweep()
        temp = self.user_dir / f"{NEW_PREFIX}{os.urandom(6).hex()}"
        temp.mkdir(mode=0o700)
        self._lock = os.open(temp / ".lock", os.O_WRONLY | os.O_CREAT | os.O_EXCL
                             | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        for name in ("world", "image", "root"):
            (temp / name).mkdir(mode=0o700)
        try:
            os.rename(temp, self.path)  # fails where the job's directory exists (not empty)
        except OSError:
            os.close(self._lock)
            self._lock = None
            remove_tree(temp)
            raise WorkspaceError(f"'{self.path}' is in use by another process of this job; "
                                 "wait for it to end") from None
        return self

    def _user_dir(self) -> None:
        try:
            self.user_dir.mkdir(mode=0o700)
        except FileExistsError:
            pass
        info = os.lstat(self.user_dir)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != self.uid:
            raise WorkspaceError(f"'{self.user_dir}' is not a directory of uid {self.uid}; "
                                 f"remove it or set {BASE_VARIABLE} elsewhere")
        if stat.S_IMODE(info.st_mode) != 0o700:
            os.chmod(self.user_dir, 0o700)

    def sweep(self) -> list[Path]:
        """Remove the user's job directories that no process holds (stale); their paths.
        One still being made (NEW_PREFIX) is left alone unless it is an hour old."""
        removed = []
        for entry in sorted(self.user_dir.iterdir()):
            if entry.is_symlink():
                continue
            if entry.name.startswith(NEW_PREFIX):
                try:
                    if time.time() - os.lstat(entry).st_mtime < STALE_NEW_S:
                        continue
                except FileNotFoundError:
                    continue
            elif not entry.name.startswith("job-"):
                continue
            if self._held(entry):
                continue
            remove_tree(entry)
            removed.append(entry)
        return removed

    @staticmethod
    def _held(directory: Path) -> bool:
        try:
            fd = os.open(directory / ".lock", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)

    def close(self) -> None:
        """Remove the job's directory (the end of the job)."""
        remove_tree(self.path)
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def __enter__(self) -> Workspace:
        return self.open()

    def __exit__(self, *_exc: object) -> None:
        self.close()
