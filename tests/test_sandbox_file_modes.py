"""The real sandbox's daemon state directories, after its daemons ran: every file in them
(databases, their -wal/-shm/-journal, anything else) is private to the daemon's account
(docs/security.md), the job registry 0640 in 0750 for the readers its group names.

A daemon started before its openers made files private still holds what it opened then:
that directory is skipped, saying to bring the sandbox down and up again."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slurm_geo.config import load_config
from slurm_geo.sandbox import Sandbox, root_from_env
from slurm_geo.sandbox.processes import ProcessTable
from tests.kit.files import check_tree

pytestmark = [pytest.mark.slow, pytest.mark.root(reason="reads the sandbox's files")]

PRIVATE_SINCE = (Path(__file__).parents[1] / "slurm_geo" / "private.py").stat().st_mtime


def _sandbox() -> Sandbox:
    box = Sandbox(root_from_env(None))
    if os.geteuid() != 0 or not box.layout.site_config.is_file():
        pytest.skip("needs root and a sandbox that has been up (slurm-geo sandbox up)")
    return box


def _directories() -> list[tuple[str, str | None, str, int, int]]:
    """(what, the daemon that writes it or None, which setting, file bits, dir bits)."""
    return [
        ("checkpoint-sync state", "checkpoint-sync", "sync.state", 0o600, 0o700),
        ("federation state", "federation", "federation.state", 0o600, 0o700),
        ("audit log", "federation", "federation.audit_path", 0o600, 0o700),
        ("billing database", None, "billing.database", 0o600, 0o700),
        ("job registry", None, "registry_path", 0o640, 0o750),
    ]


@pytest.mark.parametrize("what, daemon, setting, file_bits, dir_bits", _directories(),
                         ids=[d[0] for d in _directories()])
def test_every_file_in_the_sandboxs_daemon_state_directories_is_private(
        what: str, daemon: str | None, setting: str, file_bits: int, dir_bits: int) -> None:
    box = _sandbox()
    site = load_config(box.layout.site_config)
    value: object = site
    for part in setting.split("."):
        value = getattr(value, part)
    directory = Path(str(value)).parent
    if not directory.is_dir():
        pytest.skip(f"no {what} in this sandbox yet ({directory})")
    if daemon is not None:
        started = _started(ProcessTable(box.layout.root), daemon)
        if started is not None and started < PRIVATE_SINCE:
            pytest.skip(f"{daemon} runs code from before slurm_geo/private.py; "
                        "`slurm-geo sandbox down && slurm-geo sandbox up` to check it")
    assert check_tree(directory, file_bits, dir_bits) == []


def _started(table: ProcessTable, name: str) -> float | None:
    try:
        _pid, *rest = table.pid_file(name).read_text().split()
        return float(rest[0]) if rest else None
    except (FileNotFoundError, ValueError):
        return None
