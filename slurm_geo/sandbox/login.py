"""The sandbox users' login shell, as a site's /etc/profile.d gives it to its users.

A real site installs a profile.d snippet (or a module file) that puts its slurm-geo on
PATH and names its config (docs/install.md, "What users get"). The sandbox does the same
with one file it owns, PROFILE: the site Python's bin/ (with `slurm-geo` in it) first on
PATH, and what `slurm-geo sandbox env` tells a user of the home cluster (SLURM_CONF,
SLURM_GEO_CONFIG, the site CA, the URLs; never a secret). sbatch hands that environment to
the user's jobs, so `python` in a job script is the site's without the script saying so.

One machine, one PROFILE: the sandbox brought up last names itself there. `down --purge`
removes it only when it names that sandbox; a login shell then has no slurm-geo, as on a
host the site never installed it on.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable
from pathlib import Path

from slurm_geo.atomic import write_if_changed
from slurm_geo.sandbox.layout import SandboxLayout

PROFILE = Path("/etc/profile.d/slurm-geo-sandbox.sh")
_MARK = "# slurm-geo sandbox "


def profile_text(layout: SandboxLayout, exports: Iterable[str]) -> str:
    """The profile.d script: `exports` are `export NAME=VALUE` lines (a user's
    `sandbox env` for the home cluster); comments among them are left out."""
    bin_dir = shlex.quote(str(layout.site_python.parent))
    lines = [
        f"{_MARK}{layout.root}: what a site's /etc/profile.d gives its users",
        "# (written by `slurm-geo sandbox up`, removed by `slurm-geo sandbox down --purge`)",
        f'case ":$PATH:" in *:{bin_dir}:*) ;; *) PATH={bin_dir}:"$PATH" ;; esac',
        "export PATH",
        *(line for line in exports if line.startswith("export ")),
    ]
    return "\n".join(lines) + "\n"


def ensure_profile(layout: SandboxLayout, exports: Iterable[str],
                   path: Path = PROFILE) -> bool:
    """Write the profile.d script for this sandbox (0644: every login shell reads it);
    whether it changed."""
    return write_if_changed(path, profile_text(layout, exports), 0o644)


def names_sandbox(layout: SandboxLayout, path: Path = PROFILE) -> bool:
    try:
        first = path.read_text().splitlines()[:1]
    except (FileNotFoundError, UnicodeDecodeError):
        return False
    return bool(first) and first[0].startswith(f"{_MARK}{layout.root}:")


def remove_profile(layout: SandboxLayout, path: Path = PROFILE) -> None:
    """Remove the profile.d script if it is this sandbox's (another's stays)."""
    if names_sandbox(layout, path):
        path.unlink(missing_ok=True)
