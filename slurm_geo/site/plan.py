"""What `slurm-geo site install` puts where, and what it prints: pure functions, no I/O.

Every path here is the path on the target system; `--root` is prepended only when a file
is written (slurm_geo.site.install), so the files installed under a staging root name
the paths they will have on the site (the hooks' interpreter, the units' programs, the
plugstack.conf line).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath

# The console scripts of setup.cfg: the units run them.
CONSOLE_SCRIPTS = ("slurm-geo", "slurm-geo-checkpoint-sync", "slurm-geo-federation")
# The hook scripts of slurm_geo/share/hooks/, and the slurm.conf setting naming each.
HOOK_SETTINGS = {"prolog": "Prolog", "epilog": "Epilog",
                 "prolog_slurmctld": "PrologSlurmctld", "epilog_slurmctld": "EpilogSlurmctld"}
VALIDATOR = "check_directives"
HOOK_NAMES = (*HOOK_SETTINGS, VALIDATOR)
# The optional drop-in of docs/install.md, "Sealed at rest": shipped, never enabled here.
DROP_IN = "sealed-master-key.conf"
SPANK_PLUGIN = "geo_directives.so"
SERVICE_GROUP = "slurm-geo"
SPANK_CFLAGS = ("-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror", "-std=gnu11")
SUBMIT_AS_CFLAGS = ("-O2", "-Wall", "-Wextra", "-Werror", "-std=gnu11", "-D_FORTIFY_SOURCE=2",
                    "-fstack-protector-strong", "-fPIE", "-pie", "-Wl,-z,relro,-z,now")
SETUID_MODE = 0o4750

CREATE, UPDATE, UNCHANGED = "create", "update", "unchanged"


@dataclass(frozen=True)
class Layout:
    """Where each piece goes on the target system."""

    prefix: PurePosixPath = PurePosixPath("/usr/local")
    unit_dir: PurePosixPath = PurePosixPath("/etc/systemd/system")
    slurm_etc: PurePosixPath = PurePosixPath("/etc/slurm")
    config: PurePosixPath = PurePosixPath("/etc/slurm-geo/config.toml")

    @property
    def libexec(self) -> PurePosixPath:
        return self.prefix / "libexec" / "slurm-geo"

    @property
    def lib(self) -> PurePosixPath:
        return self.prefix / "lib" / "slurm-geo"

    @property
    def share(self) -> PurePosixPath:
        return self.prefix / "share" / "slurm-geo"

    @property
    def man1(self) -> PurePosixPath:
        return self.prefix / "share" / "man" / "man1"

    @property
    def completions(self) -> PurePosixPath:
        return self.prefix / "share" / "bash-completion" / "completions"

    def hook(self, name: str) -> PurePosixPath:
        return self.libexec / f"{name}.py"

    @property
    def spank_plugin(self) -> PurePosixPath:
        return self.lib / SPANK_PLUGIN

    @property
    def submit_as(self) -> PurePosixPath:
        return self.libexec / "submit-as"


@dataclass(frozen=True)
class Item:
    """One file to install: its bytes, mode, and owner (None: whoever installs it)."""

    kind: str  # hook, unit, drop-in, spank, submit-as, man, completion
    path: PurePosixPath
    content: bytes
    mode: int
    uid: int | None = None
    gid: int | None = None


@dataclass(frozen=True)
class Present:
    """What is at an item's path now."""

    content: bytes
    mode: int  # the permission bits, setuid included (stat.S_IMODE)
    uid: int
    gid: int


def action(item: Item, present: Present | None) -> str:
    """create, update (any of content, mode or owner differ) or unchanged."""
    if present is None:
        return CREATE
    same = (present.content == item.content and present.mode == item.mode
            and item.uid in (None, present.uid) and item.gid in (None, present.gid))
    return UNCHANGED if same else UPDATE


def setuid_helper(euid: int, root: str, service_gid: int | None) -> bool:
    """The helper is setuid root only when installed by root onto the running system and
    its group exists: under a staging root, or by another user, it could not be (nor
    should a package's build make it so)."""
    return euid == 0 and root == "/" and service_gid is not None


def render_hook(source: str, python: str) -> str:
    """The hook with its first line naming `python`: Slurm runs it with no PATH."""
    lines = source.split("\n")
    if lines and lines[0].startswith("#!"):
        lines = lines[1:]
    return "\n".join([f"#!{python}", *lines])


_PROGRAM = re.compile(r"^(Exec[A-Za-z]*=[-@:+!]*)(\S*/)?(slurm-geo[\w-]*)(?=\s|$)", re.M)


def render_unit(source: str, scripts: Mapping[str, str]) -> str:
    """The unit with each Exec*= line that runs a console script naming where it is
    installed (a virtualenv's bin/, /usr/local/bin, ...). KeyError for a script not in
    `scripts`."""
    return _PROGRAM.sub(lambda m: f"{m.group(1)}{scripts[m.group(3)]}", source)


def unit_programs(source: str) -> list[str]:
    """The console scripts a unit runs."""
    return [m.group(3) for m in _PROGRAM.finditer(source)]


def spank_build_argv(compiler: str, source: str, output: str,
                     include: str = "/usr/include") -> list[str]:
    return [compiler, *SPANK_CFLAGS, f"-I{include}", "-o", output, source]


def submit_as_build_argv(compiler: str, source: str, output: str, sbatch: str,
                         group: str = SERVICE_GROUP) -> list[str]:
    return [compiler, *SUBMIT_AS_CFLAGS, f'-DSBATCH_PATH="{sbatch}"',
            f'-DSERVICE_GROUP="{group}"', "-o", output, source]


def slurm_conf_lines(layout: Layout) -> list[str]:
    """What slurm.conf needs (docs/admin-slurm.md, "4. slurm.conf")."""
    return [f"PlugStackConfig={layout.slurm_etc / 'plugstack.conf'}",
            "JobSubmitPlugins=lua",
            "CliFilterPlugins=cli_filter/lua",
            *(f"{setting}={layout.hook(hook)}" for hook, setting in HOOK_SETTINGS.items()),
            "JobRequeue=1",
            "AccountingStoreFlags=job_env"]


def plugstack_line(layout: Layout, cluster: str = "CLUSTER") -> str:
    """plugstack.conf's line (docs/admin-slurm.md, "3. Files next to slurm.conf")."""
    return (f"required {layout.spank_plugin} validator={layout.hook(VALIDATOR)} "
            f"config={layout.config} cluster={cluster}")


def next_steps(layout: Layout, setuid: bool) -> list[str]:
    """What the admin does by hand after the install: nothing above was edited."""
    steps = [
        f"slurm-geo policy export-lua --cluster CLUSTER --dir {layout.slurm_etc}"
        "   # job_submit.lua, cli_filter.lua, geo_policy.lua next to slurm.conf",
        "scontrol reconfigure   # after adding the lines above",
        "systemctl daemon-reload && systemctl enable --now slurm-geo-federation "
        "slurm-geo-checkpoint-sync slurm-geo-billing-ingest.timer   # on the daemons' hosts",
    ]
    if not setuid:
        steps.append(f"chown root:{SERVICE_GROUP} {layout.submit_as} && chmod 4750 "
                     f"{layout.submit_as}   # as root on the daemons' hosts: the helper was "
                     "installed without setuid")
    return steps
