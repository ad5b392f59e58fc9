"""Run a command with a job's world at its home paths, as the job's own user, in a user and
mount namespace of its own (docs/training.md "A moved job's world"; issue 31 item 3).

    python -m slurm_geo.stage.nsexec -- ARGV...     (the plan in $SLURM_GEO_PRESENT_PLAN)
    python -m slurm_geo.stage.nsexec --probe DIR    (can this node do it? exit 0 if so)

No privilege is used or needed: the process makes a user namespace in which it is root
(mapped to the job's uid and gid, nothing else), and a mount namespace owned by it, so its
mounts are seen by it and its children only. There it binds each materialised tree at
its home path (read-only for inputs and the environment, `MS_RDONLY` on the bind); a
home path whose parent does not exist on the node is made in a tmpfs laid over its
deepest existing ancestor, into which that ancestor's entries are bound back first (so the
node's /home/geo-alice stays where it was when /home/alice is made); an ancestor that is
"/" itself is handled by building a new root (a tmpfs with every entry of "/" bound back)
and `pivot_root` into it. A container image's unpacked root is the new root instead.
Then it makes a second user namespace that maps the job's uid and gid back to themselves,
so the command runs as the job's user (getuid() is the job's uid, files it writes are the
job's on the node's disk) and holds no capability over the mounts: it cannot unmount or
remount them writable. Standard library only, so it starts before anything else.

The plan (JSON): {"uid", "gid", "binds": [{"source", "target", "read_only", "file"}],
"root": null or a directory (a container's root), "carry": [host paths bound into that
root], "cwd": null or a path, "env": {name: value}}. Faults: one line
`slurm-geo: error: ...` on stderr, exit 2 (usage: the node cannot do what was asked).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import platform
import stat
import sys
from typing import Any

PLAN_VARIABLE = "SLURM_GEO_PRESENT_PLAN"
CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203}
OLD_ROOT = ".slurm-geo-oldroot"
EXIT_USAGE = 2

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


class NamespaceError(Exception):
    """What the node does not allow, in one line."""


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise NamespaceError(f"{what}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
    def b(text: str | None) -> bytes | None:
        return None if text is None else os.fsencode(text)
    _check(_libc.mount(b(source), b(target), b(fstype), ctypes.c_ulong(flags), b(data)),
           f"mount {source or fstype} on {target}")


def _write(path: str, text: str) -> None:
    with open(path, "w") as file:
        file.write(text)


def enter_namespaces(uid: int, gid: int) -> None:
    """A new user namespace (root in it is `uid`/`gid` outside) and mount namespace."""
    _check(_libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), "unshare(user, mount namespaces)")
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"0 {uid} 1")
    _write("/proc/self/gid_map", f"0 {gid} 1")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)


def drop_to_user(uid: int, gid: int) -> None:
    """A nested user namespace in which the job's uid and gid are themselves again: the
    command holds no capability over the mount namespace made above."""
    _check(_libc.unshare(CLONE_NEWUSER), "unshare(nested user namespace)")
    try:
        _write("/proc/self/setgroups", "deny")
    except OSError:
        pass  # inherited "deny" from the namespace above
    _write("/proc/self/uid_map", f"{uid} 0 1")
    _write("/proc/self/gid_map", f"{gid} 0 1")


def _locked_flags(path: str) -> int:
    """The flags of the mount holding `path` that a user namespace may not clear."""
    flags = os.statvfs(path).f_flag
    return ((MS_NOSUID if flags & os.ST_NOSUID else 0) | (MS_NODEV if flags & os.ST_NODEV else 0)
            | (MS_NOEXEC if flags & os.ST_NOEXEC else 0))


def bind(source: str, target: str, read_only: bool, recursive: bool = False) -> None:
    _mount(source, target, None, MS_BIND | (MS_REC if recursive else 0))
    if read_only:
        _mount(None, target, None,
               MS_BIND | MS_REMOUNT | MS_RDONLY | _locked_flags(target))


class Layout:
    """Makes home paths exist under `base` ("" for the namespace's root) without writing
    to the node's disk: each missing one in a tmpfs shadow of its deepest existing
    ancestor (which keeps that ancestor's entries, bound back)."""

    def __init__(self, base: str, shadows: set[str] | None = None, direct: bool = False):
        self.base = base
        self.shadows = shadows if shadows is not None else set()
        self.direct = direct  # a container's own root: missing paths made in it as is

    def host(self, path: str) -> str:
        return self.base + path if self.base else path

    def make(self, target: str, file: bool) -> None:
        parts = [p for p in target.split("/") if p]
        existing = "/"
        for index, part in enumerate(parts):
            candidate = existing.rstrip("/") + "/" + part
            try:
                info = os.lstat(self.host(candidate))
            except FileNotFoundError:
                self._create(existing, parts[index:], file)
                return
            if stat.S_ISLNK(info.st_mode):
                raise NamespaceError(f"the home path {target} passes through the link "
                                     f"{candidate} on this node; present it elsewhere")
            existing = candidate

    def _create(self, ancestor: str, missing: list[str], file: bool) -> None:
        if not self.direct and ancestor not in self.shadows:
            shadow(self.host(ancestor))
            self.shadows.add(ancestor)
        path = self.host(ancestor).rstrip("/")
        for part in missing[:-1]:
            path += "/" + part
            os.mkdir(path, 0o755)
        path += "/" + missing[-1]
        if file:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        else:
            os.mkdir(path, 0o755)


def shadow(directory: str) -> None:
    """A tmpfs over `directory` holding its entries, bound back (links recreated)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
        names = os.listdir(fd)
        _mount("slurm-geo-world", directory, "tmpfs", MS_NOSUID | MS_NODEV, f"mode={mode:o}")
        for name in names:
            bind_back(f"/proc/self/fd/{fd}/{name}", f"{directory.rstrip('/')}/{name}")
    finally:
        os.close(fd)


def bind_back(source: str, target: str) -> None:
    info = os.lstat(source)
    if stat.S_ISLNK(info.st_mode):
        os.symlink(os.readlink(source), target)
        return
    if stat.S_ISDIR(info.st_mode):
        os.mkdir(target, 0o755)
    else:
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    bind(source, target, read_only=False, recursive=True)


def new_root(directory: str) -> None:
    """`directory` as a tmpfs holding every entry of "/", bound back."""
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    try:
        _mount("slurm-geo-root", directory, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755")
        for name in os.listdir(fd):
            if name != OLD_ROOT:
                bind_back(f"/{name}", f"{directory}/{name}")
    finally:
        os.close(fd)


def pivot(directory: str) -> None:
    number = SYS_PIVOT_ROOT.get(platform.machine())
    if number is None:
        raise NamespaceError(f"pivot_root: unknown on {platform.machine()}")
    old = f"{directory}/{OLD_ROOT}"
    os.mkdir(old, 0o700)
    _check(_libc.syscall(number, os.fsencode(directory), os.fsencode(old)), "pivot_root")
    os.chdir("/")
    _check(_libc.umount2(os.fsencode(f"/{OLD_ROOT}"), MNT_DETACH), "umount old root")
    os.rmdir(f"/{OLD_ROOT}")


def apply(plan: dict[str, Any]) -> None:
    """Every mount of the plan; on return the namespace shows the world."""
    enter_namespaces(plan["uid"], plan["gid"])
    binds = sorted(plan["binds"], key=lambda b: b["target"].count("/"))
    root = plan.get("root")
    if root:
        bind(root, root, read_only=False)
        layout = Layout(root, direct=True)
        for path in plan.get("carry", []):
            if os.path.exists(path):
                layout.make(path, file=not os.path.isdir(path))
                bind(path, layout.host(path), read_only=False, recursive=True)
    elif any(_deepest_existing(b["target"]) == "/" for b in binds):
        root = plan["scratch_root"]
        new_root(root)
        layout = Layout(root, {"/"})
    else:
        layout = Layout("")
    for entry in binds:
        target = layout.host(entry["target"])
        if not os.path.lexists(target):
            layout.make(entry["target"], entry.get("file", False))
        bind(entry["source"], target, entry["read_only"])
    if root:
        pivot(root)


def _deepest_existing(path: str) -> str:
    existing = "/"
    for part in (p for p in path.split("/") if p):
        candidate = existing.rstrip("/") + "/" + part
        if not os.path.lexists(candidate):
            break
        existing = candidate
    return existing


def probe(directory: str) -> str | None:
    """Why this node cannot present a world in a namespace (None: it can): the whole
    sequence tried in a child process on `directory`, a scratch directory of the user's."""
    uid, gid = os.getuid(), os.getgid()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        why = ""
        try:
            enter_namespaces(uid, gid)
            _mount("slurm-geo-probe", directory, "tmpfs", MS_NOSUID | MS_NODEV, "mode=700")
            os.mkdir(f"{directory}/ro")
            bind(f"{directory}/ro", f"{directory}/ro", read_only=True)
            drop_to_user(uid, gid)
            if os.getuid() != uid:
                why = f"the nested namespace runs as uid {os.getuid()}, not {uid}"
        except (OSError, NamespaceError) as exc:
            why = str(exc)
        os.write(write, why.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        why = pipe.read().decode()
    os.waitpid(pid, 0)
    return why or None


def main(argv: list[str]) -> int:
    if argv[:1] == ["--probe"] and len(argv) == 2:
        why = probe(argv[1])
        if why:
            print(f"slurm-geo: error: no user namespace here: {why}", file=sys.stderr)
            return EXIT_USAGE
        return 0
    if argv[:1] != ["--"] or len(argv) < 2:
        print("usage: python -m slurm_geo.stage.nsexec -- ARGV... (plan in "
              f"${PLAN_VARIABLE}) | --probe DIR", file=sys.stderr)
        return EXIT_USAGE
    plan = json.loads(os.environ.pop(PLAN_VARIABLE))
    try:
        apply(plan)
        drop_to_user(plan["uid"], plan["gid"])
        if plan.get("cwd"):
            os.chdir(plan["cwd"])
    except (OSError, NamespaceError) as exc:
        print(f"slurm-geo: error: cannot present the job's world here: {exc}",
              file=sys.stderr)
        return EXIT_USAGE
    env = {**os.environ, **plan.get("env", {})}
    try:
        os.execvpe(argv[1], argv[1:], env)
    except OSError as exc:
        print(f"slurm-geo: error: cannot run '{argv[1]}': {exc.strerror}", file=sys.stderr)
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
