"""The daemons' own account (docs/security.md, "Who runs with which rights").

The federation daemon, checkpoint-sync and billing run as `slurm-geo`, a system user and
group `make install` creates; only that group may run slurm-geo-submit-as. Stores trust
what it makes as they trust root's (ckpt.store): it writes the run keys, fences, probes and
the directories runs share.
"""

from __future__ import annotations

import pwd

SERVICE_ACCOUNT = "slurm-geo"


def service_uid() -> int | None:
    """The service account's uid on this host, None where there is none."""
    try:
        return pwd.getpwnam(SERVICE_ACCOUNT).pw_uid
    except KeyError:
        return None
