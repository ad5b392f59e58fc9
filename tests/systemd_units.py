"""Reading the unit files under slurm_geo/share/systemd/, and installing them into a
temporary directory as they would be installed on this host (`slurm-geo site install`
renders them so for real: tests/test_site_install.py)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest


def settings(unit: Path) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in unit.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";", "[")):
            key, value = line.split("=", 1)
            found.setdefault(key.strip(), []).append(value.strip())
    return found


def installed_here(unit: Path, tmp_path: Path) -> Path:
    """The unit as it would be installed on this host: where pip put the console script
    when it is not in /usr/local/bin (a virtualenv or pyenv Python)."""
    text = unit.read_text()
    for name in re.findall(r"/usr/local/bin/([\w-]+)", text):
        if not (Path("/usr/local/bin") / name).exists():
            program = Path(sys.executable).parent / name
            if not program.exists():
                pytest.skip(f"{name} is not installed (pip install -e .)")
            text = text.replace(f"/usr/local/bin/{name}", str(program))
    copy = tmp_path / unit.name
    copy.write_text(text)
    return copy
