"""The blocks of docs/training.md's first-job walk, as the doc tests run them."""

from __future__ import annotations

import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[2] / "docs" / "training.md"


def text() -> str:
    return PAGE.read_text()


def first_job_blocks() -> tuple[str, str]:
    """The page's first geo job: its trainer and its job script."""
    section = text().split("## Your first geo job", 1)[1].split("\n## ", 1)[0]
    python = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    bash = re.findall(r"```bash\n(.*?)```", section, re.S)[0]
    return python, bash
