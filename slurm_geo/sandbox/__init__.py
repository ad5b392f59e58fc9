"""A real two-cluster Slurm sandbox on one machine: see docs/sandbox.md."""

from slurm_geo.sandbox.layout import SandboxLayout, root_from_env
from slurm_geo.sandbox.lifecycle import ComponentStatus, Sandbox

__all__ = ["ComponentStatus", "Sandbox", "SandboxLayout", "root_from_env"]
