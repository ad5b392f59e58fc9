"""The federation state a test writes to: `state` (on SQLite and on etcd, the leading
replica), `sqlite_state`, the file `path` under the test's directory, and `dump`, every
row or key with its revision (what "nothing was written" compares).

A test module uses the fixtures by importing them under their functions' names
(`from tests.kit.state import state_fixture  # noqa: F401 - the fixture "state"`), so that
a test's parameter `state` shadows nothing; `state` needs conftest's `etcd`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_geo.federation.state.etcd.state import EtcdFederationState
from slurm_geo.federation.state.interface import State
from slurm_geo.federation.state.sqlite import FederationState
from tests.etcd_server import EtcdMember, fresh_prefix, open_replica


@pytest.fixture(name="path")
def path_fixture(tmp_path: Path) -> Path:
    return tmp_path / "federation" / "state.db"


@pytest.fixture(name="sqlite_state")
def sqlite_state_fixture(path: Path) -> Iterator[FederationState]:
    db = FederationState(path)
    yield db
    db.close()


@pytest.fixture(name="state", params=["sqlite", "etcd"])
def state_fixture(request: pytest.FixtureRequest, path: Path) -> Iterator[State]:
    """Each test of the public interface, on SQLite and on etcd (the leading replica)."""
    if request.param == "sqlite":
        yield request.getfixturevalue("sqlite_state")
        return
    etcd: EtcdMember = request.getfixturevalue("etcd")
    replica = open_replica([etcd.client_url], fresh_prefix(), "onprem-a")
    assert replica.leadership.campaign()
    yield replica
    replica.leadership.resign()
    replica.close()


def dump(state: State) -> dict[str, Any]:
    """Every row of every table, or every key under the prefix with its revision: what
    "nothing was written" compares."""
    if isinstance(state, EtcdFederationState):
        return {f.key: (f.value, f.mod_revision)
                for f in state.kv.range(state.layout.prefix + "/")}
    tables = [r[0] for r in state.db.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
    return {t: sorted(tuple(r) for r in state.db.execute(f"SELECT * FROM {t}"))
            for t in tables}
