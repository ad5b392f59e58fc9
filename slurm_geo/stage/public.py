"""Which roots may be staged in a shared domain (issue 31 item 2: deduplicated across jobs
and users; docs/format.md §11.2, docs/security.md).

A root qualifies when every user of the site may read it at home: every directory above
it searchable by everyone, and everything in it readable by everyone. Then a job of any
user that declares it may be given the shared domain's key without learning anything it
could not read at home. "Everyone" is decided from the permission bits alone, and only
where no ACL can take away what they seem to give:

* a directory in the tree: read and search for owner, group and others (`0o555`);
* a regular file in the tree: read for owner, group and others (`0o444`) (all three:
  a member of the file's group is judged by the group bits, not the others' bits);
* a directory above the root: search for owner, group and others (`0o111`);
* a symbolic link: its text is readable by whoever may search its directory, and it is
  never followed; a device, FIFO or socket is never staged: neither makes a tree private;
* anything with a POSIX or NFSv4 ACL is private (a named user's entry can deny what the
  mode bits allow; the bits of an ACL'd file show its mask, not what others get);
* an ancestor that is not a directory (a link on the way) makes the root private: the
  path another user's job names could resolve elsewhere.

The stager (the job, as its owner) judges every entry as it walks it, by `fstat` of what
it opened, before it reads a byte of it; one private entry and the root is staged in its
owner's domain instead, this pass (slurm_geo.stage.home). What is not judged (SELinux and
other mandatory access control, a mount's options, a root-squashing export) is said in
docs/security.md.

`entry_private` and `ancestors_private` are pure; `has_acl` and `ancestors` do the I/O.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Sequence
from pathlib import PurePosixPath

from slurm_geo.stage.manifest import DIR, FILE, SYMLINK

READ_ALL = 0o444
READ_SEARCH_ALL = 0o555
SEARCH_ALL = 0o111
ACL_XATTRS = frozenset({"system.posix_acl_access", "system.nfs4_acl", "system.richacl"})


def entry_private(kind: str, mode: int, acl: bool) -> str | None:
    """Why an entry of kind `kind` (dir, file, symlink, other) with `mode` and, where
    `acl`, an ACL is not readable by every user; None where it is. Pure."""
    if kind in (SYMLINK, "other"):
        return None
    if acl:
        return "it has an ACL"
    if kind == DIR:
        need = READ_SEARCH_ALL
    elif kind == FILE:
        need = READ_ALL
    else:
        return f"it is a {kind}"
    if mode & need != need:
        return f"its mode {stat.S_IMODE(mode):04o} lacks {need & ~mode:04o}"
    return None


Ancestor = tuple[str, int, bool]  # (path, st_mode as lstat gave it, has an ACL)


def ancestors_private(found: Sequence[Ancestor]) -> str | None:
    """Why the directories above a root (from '/' down, as lstat found them) keep others
    out; None where everyone may search every one. Pure."""
    for path, mode, acl in found:
        if not stat.S_ISDIR(mode):
            return f"{path} is not a directory"
        if acl:
            return f"{path} has an ACL"
        if mode & SEARCH_ALL != SEARCH_ALL:
            return f"{path} (mode {stat.S_IMODE(mode):04o}) is not searchable by everyone"
    return None


def has_acl(target: int | str, listxattr: Callable[..., list[str]] = os.listxattr) -> bool:
    """Whether the open file `target` (or the path, not followed) has an access ACL. A
    file system without extended attributes has none."""
    try:
        names = listxattr(target) if isinstance(target, int) else \
            listxattr(target, follow_symlinks=False)
    except OSError:
        return False
    return any(name in ACL_XATTRS for name in names)


def ancestors(path: str) -> list[Ancestor]:
    """The directories above the absolute `path`, from '/', as this process sees them."""
    parents = list(reversed(PurePosixPath(path).parents))
    found = []
    for parent in parents:
        info = os.lstat(parent)
        found.append((str(parent), info.st_mode, has_acl(str(parent))))
    return found


def root_private(path: str) -> str | None:
    """Why the directories above `path` keep some user out (or cannot be looked at)."""
    try:
        return ancestors_private(ancestors(path))
    except OSError as exc:
        return f"{exc.filename}: {exc.strerror or exc}"
