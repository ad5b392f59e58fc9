"""The controller's record of geo jobs: every incarnation, and the lineage of logical jobs.

Written by PrologSlurmctld and EpilogSlurmctld (slurm_geo/share/hooks/), read by slurm-geo.
"""

from slurm_geo.registry.db import (
    ActiveJob,
    IllegalTransition,
    Incarnation,
    IncarnationState,
    LineageLink,
    RegisteredJob,
    Registry,
    RegistryReader,
    RegistryUnreadable,
)

__all__ = ["ActiveJob", "IllegalTransition", "Incarnation", "IncarnationState", "LineageLink",
           "RegisteredJob", "Registry", "RegistryReader", "RegistryUnreadable"]
