"""The --geo-* integration on both sandbox clusters, installed as docs/admin-slurm.md says.

Per cluster, next to its slurm.conf: plugstack.conf (the SPANK plugin, built from the
package's slurm_geo/share/spank/ into the sandbox's lib/), geo_policy.lua, job_submit.lua
and cli_filter.lua (from the sandbox's slurm-geo config, as `slurm-geo policy export-lua`
writes them), and wrappers for the hook scripts (slurm_geo/share/hooks/, the files
`slurm-geo site install` installs) and the validator. The slurm.conf lines come from
`render.geo_slurm_conf_lines`.

Slurm reads most of slurm.conf again on `scontrol reconfigure`, but not all: the settings
in RESTART_SETTINGS (credential lifetime, ports, authentication) are read when a daemon
starts, so a change there restarts that cluster's slurmctld and slurmd. Running jobs
survive both: slurmstepd is not a child of slurmd.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path

from slurm_geo.config import parse_config
from slurm_geo.errors import SandboxError
from slurm_geo.policy.geo import rules_for
from slurm_geo.policy.lua import export_files
from slurm_geo.sandbox import render
from slurm_geo.sandbox.layout import SandboxLayout
from slurm_geo.site import HOOKS as HOOK_SCRIPTS
from slurm_geo.site import SHARE, SPANK_SOURCE

# Where the hooks import slurm_geo from: the package the sandbox was brought up from.
REPO = SHARE.parents[1]
SLURM_INCLUDE = Path("/usr/include")
RESTART_SETTINGS = frozenset({"AuthInfo", "AuthAltTypes", "AuthAltParameters", "AuthType",
                              "CredType", "SlurmctldPort", "SlurmdPort", "NodeName"})

Write = Callable[[Path, str, int], bool]  # (path, text, mode) -> changed


def build_spank_plugin(layout: SandboxLayout) -> Path:
    """The package's geo_directives.c compiled into the sandbox, unless it is up to date."""
    output = render.spank_plugin_path(layout)
    if not SPANK_SOURCE.is_file():
        raise SandboxError(f"the SPANK plugin's source {SPANK_SOURCE} is missing; run the "
                           "sandbox from an installed slurm-geo (pip install slurm-geo)")
    if output.exists() and output.stat().st_mtime >= SPANK_SOURCE.stat().st_mtime:
        return output
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SandboxError("building the SPANK plugin needs a C compiler; install one with: "
                           "apt-get install gcc")
    if not (SLURM_INCLUDE / "slurm" / "spank.h").is_file():
        raise SandboxError(f"building the SPANK plugin needs {SLURM_INCLUDE}/slurm/spank.h; "
                           "install it with: apt-get install libslurm-dev")
    output.parent.mkdir(parents=True, exist_ok=True)
    temp = output.with_name(f".{output.name}.tmp")
    proc = subprocess.run(render.spank_build_argv(compiler, SPANK_SOURCE, temp, SLURM_INCLUDE),
                          capture_output=True, text=True, timeout=120, check=False)
    if proc.returncode != 0:
        raise SandboxError(f"building the SPANK plugin failed: "
                           f"{(proc.stderr or proc.stdout).strip()[-400:]}")
    temp.replace(output)
    return output


def install(layout: SandboxLayout, write: Write) -> set[str]:
    """Write every cluster's geo files; the names of the clusters whose files changed."""
    build_spank_plugin(layout)
    site = parse_config(tomllib.loads(layout.site_config.read_text()),
                        source=str(layout.site_config))
    rules = rules_for(site)
    changed = set()
    for cluster in layout.host_clusters:
        files = {cluster.etc / "plugstack.conf": (render.plugstack_conf(layout, cluster), 0o644)}
        for name, text in export_files(rules, cluster.name, site.source).items():
            files[cluster.etc / name] = (text, 0o644)
        for hook in render.GEO_HOOKS:  # Slurm runs them as root: they get no key
            script = HOOK_SCRIPTS / f"{hook}.py"
            files[render.geo_hook_path(cluster, hook)] = (
                render.hook_wrapper(layout, cluster, sys.executable, script, REPO), 0o755)
        # sbatch runs the validator as the submitting user: the site Python, and a copy of
        # the script where every user can read it (the checkout may be root's alone).
        validator = cluster.etc / f"{render.GEO_VALIDATOR}.py"
        files[validator] = ((HOOK_SCRIPTS / validator.name).read_text(), 0o644)
        files[render.geo_hook_path(cluster, render.GEO_VALIDATOR)] = (
            render.hook_wrapper(layout, cluster, str(layout.site_python), validator), 0o755)
        if any([write(path, text, mode) for path, (text, mode) in files.items()]):
            changed.add(cluster.name)
    return changed


def changed_settings(old: str, new: str) -> set[str]:
    """The slurm.conf keys whose lines differ between two versions."""
    def lines(text: str) -> set[str]:
        return {line.strip() for line in text.splitlines() if "=" in line}
    return {line.split("=", 1)[0] for line in lines(old) ^ lines(new)}


def needs_restart(old: str, new: str) -> bool:
    return bool(changed_settings(old, new) & RESTART_SETTINGS)
