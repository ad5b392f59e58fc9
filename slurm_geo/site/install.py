"""`slurm-geo site install`: the hooks, the systemd units, the SPANK plugin built against
the installed Slurm, the submit-as helper, man pages and bash completion, from the
installed package, under a root (default /).

Idempotent: every item is planned first (the two C programs compiled into a temporary
directory; gcc's output is the same bytes for the same source and flags), compared with
what is there (content, mode, owner), and only what differs is written, each file
atomically. It edits no configuration: slurm.conf and plugstack.conf lines are returned
for the admin to add (slurm_geo.site.plan).
"""

from __future__ import annotations

import grp
import importlib.metadata
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from slurm_geo.errors import SlurmGeoError
from slurm_geo.exitcodes import ExitCode
from slurm_geo.site import HOOKS, SPANK_SOURCE, SUBMIT_AS_SOURCE, UNITS, plan


class SiteInstallError(SlurmGeoError):
    """A piece cannot be put in place: a missing compiler, header, group or package file."""

    exit_code = ExitCode.SITE_INSTALL


@dataclass(frozen=True, kw_only=True)
class Options:
    """What to install where. The man pages ({file name: roff}) and the bash completion
    script come from the command line's own tree, which passes them in."""

    man_pages: Mapping[str, str]
    completion: str
    root: Path = Path("/")
    prefix: PurePosixPath = PurePosixPath("/usr/local")
    slurm_include: Path = Path("/usr/include")
    dry_run: bool = False


@dataclass
class Report:
    root: Path
    layout: plan.Layout
    setuid: bool
    done: list[tuple[plan.Item, str]] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {
            "root": str(self.root), "prefix": str(self.layout.prefix),
            "items": [{"kind": item.kind, "path": str(item.path),
                       "installed_at": str(_under(self.root, item.path)), "action": act,
                       "mode": f"{item.mode:04o}"} for item, act in self.done],
            "setuid": self.setuid,
            "slurm_conf": plan.slurm_conf_lines(self.layout),
            "plugstack_conf": plan.plugstack_line(self.layout),
            "next": plan.next_steps(self.layout, self.setuid),
        }


def install(options: Options) -> Report:
    """Plan every item, then write those that differ (none with dry_run)."""
    layout = plan.Layout(prefix=options.prefix)
    gid = service_gid()
    setuid = plan.setuid_helper(os.geteuid(), str(options.root.resolve()), gid)
    items = planned(layout, options, gid if setuid else None)
    report = Report(options.root, layout, setuid)
    for item in items:
        target = _under(options.root, item.path)
        act = plan.action(item, _present(target))
        if act != plan.UNCHANGED and not options.dry_run:
            _write(target, item)
        report.done.append((item, act))
    return report


def service_gid() -> int | None:
    """The service account's group, which alone may run the setuid helper; None without it."""
    try:
        return grp.getgrnam(plan.SERVICE_GROUP).gr_gid
    except KeyError:
        return None


def planned(layout: plan.Layout, options: Options, gid: int | None) -> list[plan.Item]:
    """Every item, checked and built; raises SiteInstallError before anything is written.
    With `gid`, the helper is setuid root and that group's; without, neither."""
    for source in (SPANK_SOURCE, SUBMIT_AS_SOURCE, UNITS):
        if not source.exists():
            raise SiteInstallError(f"{source} is missing from the installed package; "
                                   "reinstall slurm-geo (pip install --force-reinstall)")
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SiteInstallError("building the SPANK plugin and submit-as needs a C compiler; "
                               "install one with: apt-get install gcc")
    if not (options.slurm_include / "slurm" / "spank.h").is_file():
        raise SiteInstallError(f"{options.slurm_include}/slurm/spank.h is missing: the SPANK "
                               "plugin is built against the installed Slurm's headers; "
                               "install them with: apt-get install libslurm-dev "
                               "(or name them with --slurm-include DIR)")
    scripts = console_scripts()
    python = sys.executable
    items = [plan.Item("hook", layout.hook(name),
                       plan.render_hook((HOOKS / f"{name}.py").read_text(), python).encode(),
                       0o755)
             for name in plan.HOOK_NAMES]
    for unit in sorted(UNITS.iterdir()):
        text = unit.read_text()
        if unit.name == plan.DROP_IN:
            items.append(plan.Item("drop-in", layout.share / unit.name, text.encode(), 0o644))
            continue
        missing = [name for name in plan.unit_programs(text) if name not in scripts]
        if missing:
            raise SiteInstallError(f"{unit.name} runs {missing[0]}, which is not installed "
                                   f"next to {python}; reinstall slurm-geo with pip")
        items.append(plan.Item("unit", layout.unit_dir / unit.name,
                               plan.render_unit(text, scripts).encode(), 0o644))
    spank, submit_as = _build(compiler, options.slurm_include)
    items.append(plan.Item("spank", layout.spank_plugin, spank, 0o755))
    items.append(plan.Item("submit-as", layout.submit_as, submit_as,
                           0o755 if gid is None else plan.SETUID_MODE,
                           None if gid is None else 0, gid))
    items += [plan.Item("man", layout.man1 / name, text.encode(), 0o644)
              for name, text in sorted(options.man_pages.items())]
    items.append(plan.Item("completion", layout.completions / "slurm-geo",
                           options.completion.encode(), 0o644))
    return items


def console_scripts() -> dict[str, str]:
    """Where pip put this package's console scripts: as its installation recorded them
    (the distribution the running interpreter finds first), else in the scripts directory
    of the interpreter's scheme (a virtualenv's bin/, /usr/local/bin), else beside it."""
    found: dict[str, str] = {}
    try:
        recorded = importlib.metadata.distribution("slurm-geo").files or []
    except importlib.metadata.PackageNotFoundError:
        recorded = []
    for entry in recorded:
        if entry.name in plan.CONSOLE_SCRIPTS and entry.name not in found:
            path = Path(os.path.normpath(str(entry.locate())))
            if path.is_file():
                found[entry.name] = str(path)
    for directory in (Path(sysconfig.get_path("scripts")), Path(sys.executable).parent):
        for name in plan.CONSOLE_SCRIPTS:
            if name not in found and (directory / name).is_file():
                found[name] = str(directory / name)
    return found


def _build(compiler: str, include: Path) -> tuple[bytes, bytes]:
    sbatch = shutil.which("sbatch") or "/usr/bin/sbatch"
    with tempfile.TemporaryDirectory(prefix="slurm-geo-site-") as tmp:
        out = Path(tmp)
        for argv in (plan.spank_build_argv(compiler, str(SPANK_SOURCE),
                                           str(out / plan.SPANK_PLUGIN), str(include)),
                     plan.submit_as_build_argv(compiler, str(SUBMIT_AS_SOURCE),
                                               str(out / "submit-as"), sbatch)):
            done = subprocess.run(argv, capture_output=True, text=True, timeout=300,
                                  check=False)
            if done.returncode != 0:
                error = (done.stderr or done.stdout).strip().splitlines() or ["no output"]
                raise SiteInstallError(f"building {argv[-1]} failed: {error[0][:300]}")
        return (out / plan.SPANK_PLUGIN).read_bytes(), (out / "submit-as").read_bytes()


def _under(root: Path, path: PurePosixPath) -> Path:
    return root / path.relative_to("/")


def _present(target: Path) -> plan.Present | None:
    try:
        info = target.lstat()
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(info.st_mode):  # a link or a directory: replaced by the file
        return plan.Present(b"", -1, info.st_uid, info.st_gid)
    return plan.Present(target.read_bytes(), stat.S_IMODE(info.st_mode), info.st_uid,
                        info.st_gid)


def _write(target: Path, item: plan.Item) -> None:
    try:
        target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        temp = Path(name)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(item.content)
            if item.uid is not None or item.gid is not None:
                os.chown(temp, -1 if item.uid is None else item.uid,
                         -1 if item.gid is None else item.gid)
            temp.chmod(item.mode)  # after chown, which clears the setuid bit
            if target.is_dir() and not target.is_symlink():
                raise SiteInstallError(f"{target} is a directory; move it away and run "
                                       "slurm-geo site install again")
            temp.replace(target)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
    except PermissionError as exc:
        raise SiteInstallError(f"cannot write {target}: {exc.strerror}; run as root or "
                               "install under --root DIR") from None
