"""Where a job's records lie in its checkpoint directory, and which of them to trust.

The node prolog and epilog (slurm_geo.hooks.node) and a FederatedRun (slurm_geo.lease.
places) keep a job's records in its `--geo-ckpt-dir`: `prolog-<cluster>-<job>-<restart>.
json`, `job-<cluster>-<job>.json`, `run-<cluster>-<job>.json` and the prolog's
`staging-*`. Each is written and read as the job's user.

* In a directory of the user's own (no group or other write bit) they lie in `.slurm-geo/`,
  as they always did.
* In a directory users share (mode 1777, or 2770 for a group), whoever owns a directory
  may remove or rename anything in it, sticky bit or not: a `.slurm-geo/` the first user's
  job made would be theirs, and so everyone's records in it. There each user's records lie
  in a directory of their own beside it, `.slurm-geo-<uid>/` (0755), which no other user
  may write, and which the shared directory's sticky bit keeps anyone but its owner (and
  the directory's) from removing or renaming.

Every reader and writer agrees by `records_dir`, and trusts a record only when the
directory it lies in is a real directory of the job's user that no one else may write, and
the record a regular file of that user, opened without following a link: a record another
user plants, under any name, is never taken for the job's (`refusal`, `read_json`). A
co-tenant can still make `.slurm-geo-<uid>/` before that user's first job does: its records
are then refused in one line (denial of service, never a forged record). A shared
directory without the sticky bit lets every writer rename anything in it; records there are
still never forged, but may be hidden: `chmod +t` it, as the stores ask
(slurm_geo.ckpt.stores.store).
"""

from __future__ import annotations

import json
import os
import pwd
import stat
from pathlib import Path
from typing import Any

META_DIR = ".slurm-geo"
OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


class RecordsRefused(PermissionError):
    """A records directory the job's user cannot trust; one line naming it and the fix."""


def is_shared(mode: int) -> bool:
    """Whether a checkpoint directory of this mode is one users share."""
    return bool(mode & OTHERS_WRITE)


def records_name(shared: bool, uid: int) -> str:
    """The name of the records directory of user `uid` in a checkpoint directory."""
    return f"{META_DIR}-{uid}" if shared else META_DIR


def refusal(info: os.stat_result | None, uid: int) -> str | None:
    """Why a records directory (its `lstat`) is not user `uid`'s to trust, if it is not;
    None when it is, or when it is missing (None)."""
    if info is None:
        return None
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory (a link, or a file)"
    if info.st_uid != uid:
        return f"belongs to {_user(info.st_uid)}, not to the job's user {_user(uid)}"
    if stat.S_IMODE(info.st_mode) & OTHERS_WRITE:
        return "may be written by group or others"
    return None


def records_dir(ckpt_dir: Path, uid: int | None = None) -> Path:
    """Where user `uid`'s (default: whoever runs this) records lie in `ckpt_dir`."""
    uid = os.geteuid() if uid is None else uid
    return ckpt_dir / records_name(is_shared(stat.S_IMODE(ckpt_dir.stat().st_mode)), uid)


def trusted_dir(ckpt_dir: Path, uid: int | None = None) -> Path | None:
    """The records directory of `uid` in `ckpt_dir` when it exists and is theirs to trust;
    None when it is missing; RecordsRefused when it is there and not theirs."""
    uid = os.geteuid() if uid is None else uid
    try:
        directory = records_dir(ckpt_dir, uid)
        info = directory.lstat()
    except FileNotFoundError:
        return None
    why = refusal(info, uid)
    if why is not None:
        raise RecordsRefused(_refused(directory, why))
    return directory


def ensure_dir(ckpt_dir: Path) -> Path:
    """The records directory of whoever runs this (the job's user) in `ckpt_dir`, made if
    missing (0755); RecordsRefused when one is there that is not theirs."""
    uid = os.geteuid()
    directory = records_dir(ckpt_dir, uid)
    try:
        directory.mkdir(mode=0o755)
    except FileExistsError:
        pass
    info = directory.lstat()
    if info.st_uid == uid and stat.S_ISDIR(info.st_mode) and \
            stat.S_IMODE(info.st_mode) & OTHERS_WRITE:
        # Its own, left shared by a version that shared one `.slurm-geo/` among users.
        directory.chmod(stat.S_IMODE(info.st_mode) & ~OTHERS_WRITE)
        info = directory.lstat()
    why = refusal(info, uid)
    if why is not None:
        raise RecordsRefused(_refused(directory, why))
    return directory


def read_json(path: Path, uid: int | None = None) -> Any:
    """The JSON record at `path` when it is a regular file of user `uid` (default: whoever
    runs this), opened without following a link; None when it is missing, not one, or
    not theirs."""
    uid = os.geteuid() if uid is None else uid
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != uid:
            return None
        try:
            return json.loads(handle.read())
        except (OSError, ValueError):
            return None


def _refused(directory: Path, why: str) -> str:
    return (f"the job's records directory {directory} {why}, so its records cannot be "
            "trusted; none are read or written there: an admin removes it (another user's "
            "may have been made to block these records)")


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"
