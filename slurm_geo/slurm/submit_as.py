"""Starting a job as its owner through the one privileged helper, slurm-geo-submit-as.

The daemons run as an unprivileged service account; Slurm lets only root submit for
another user (`sbatch --uid`, root only and deprecated in 26.05). So a submission for an
owner goes to a small setuid-root program (slurm_geo/share/libexec/submit_as.c, installed as
SUBMIT_AS_PATH, mode 4750 root:slurm-geo) as data on its standard input. It clears its
environment, checks the request (the owner's passwd entry, a uid of at least 1000, the
gid one of theirs, every sbatch option from a fixed list), drops to the owner's uid, gid
and groups, and only then runs sbatch with the job's environment and script: everything
the owner controls (their script's `#SBATCH` lines, `--export-file`, PYTHONPATH,
LD_LIBRARY_PATH, the SPANK plugin's validator) is read or run with the owner's rights.

`request` is pure: the bytes of one request, in the helper's format.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from slurm_geo.slurm.models import Owner

SUBMIT_AS_PATH = Path("/usr/local/libexec/slurm-geo/submit-as")
MAGIC = "slurm-geo-submit-as/1"

# The helper's own exit codes (slurm_geo/share/libexec/submit_as.c): anything else is sbatch's.
EXIT_MALFORMED = 64
EXIT_REFUSED = 77
EXIT_SYSTEM = 71
HELPER_EXITS = frozenset({EXIT_MALFORMED, EXIT_REFUSED, EXIT_SYSTEM})


class MalformedRequest(ValueError):
    """A value that cannot travel in a request (a NUL byte, '=' in a variable's name)."""


def request(owner: Owner, slurm_conf: Path, options: Sequence[str],
            environment: Mapping[str, str], script: str) -> bytes:
    """One request: NUL-terminated fields, then the script up to the end."""
    fields = [MAGIC, owner.user, str(owner.uid), str(owner.gid), str(slurm_conf),
              str(len(options)), *options, str(len(environment))]
    for name, value in environment.items():
        if not name or "=" in name:
            raise MalformedRequest(f"environment variable name {name!r}")
        fields.append(f"{name}={value}")
    for text in fields:
        if "\0" in text:
            raise MalformedRequest(f"a NUL byte in {text[:40]!r}")
    return b"".join(text.encode() + b"\0" for text in fields) + script.encode()
