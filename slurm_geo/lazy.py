"""Names a package offers, imported from their modules when first used (PEP 562).

A package whose `__init__` imported every module it offers made every importer pay for
all of them: `slurm_geo.ckpt` loaded numpy for a command that pushes a file (95 ms of a
0.27 s push). A package lists where each name lives and takes its `__getattr__` from here;
its `if TYPE_CHECKING:` imports of the same names keep them typed.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def module_getattr(package: str, homes: Mapping[str, str]) -> Callable[[str], object]:
    """The `__getattr__` of `package`: a name of `homes` from `package.<its module>`."""

    def __getattr__(name: str) -> object:
        module = homes.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    return __getattr__
