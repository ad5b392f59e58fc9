"""A real two-cluster Slurm sandbox on one machine: see docs/sandbox.md."""

from typing import Any

from slurm_geo.sandbox.layout import SandboxLayout, root_from_env

__all__ = ["ComponentStatus", "Sandbox", "SandboxLayout", "root_from_env"]


def __getattr__(name: str) -> Any:
    # The lifecycle pulls in requests, psutil and the checkpoint keys: only load it when
    # used, so `slurm-geo sandbox --help` stays fast.
    if name in ("Sandbox", "ComponentStatus"):
        from slurm_geo.sandbox import lifecycle

        return getattr(lifecycle, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
