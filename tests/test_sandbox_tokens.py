"""The JWTs the sandbox mints for its rented cluster (slurmrestd): none for root, none
living longer than the bound docs/sandbox.md gives (a day; every `up` mints them again)."""

from __future__ import annotations

import base64
import json
import re

import pytest

from slurm_geo.sandbox import lifecycle, users
from slurm_geo.sandbox.layout import REST_USER

BOUND_S = 24 * 3600  # docs/sandbox.md, Files: "a day each"
JWT = re.compile(r"^[A-Za-z0-9_-]+\.([A-Za-z0-9_-]+)\.[A-Za-z0-9_-]+$")


def claims(token: str) -> dict | None:
    """The payload of a JWT (its middle part), None for text that is not one."""
    found = JWT.match(token.strip())
    if found is None:
        return None
    part = found.group(1)
    try:
        payload = json.loads(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)))
    except ValueError:
        return None
    return payload if isinstance(payload, dict) else None


@pytest.mark.parametrize("payload, fits", [
    ({"sun": "slurm-geo", "iat": 1000, "exp": 1000 + BOUND_S}, True),
    ({"sun": "alice", "iat": 1000, "exp": 1000 + 3600}, True),
    ({"sun": "root", "iat": 1000, "exp": 1000 + 3600}, False),  # root's
    ({"sun": "slurm-geo", "iat": 1000, "exp": 1000 + 30 * 86400}, False),  # 30 days
    ({"sun": "slurm-geo", "iat": 1000}, False),  # never expires
])
def test_which_tokens_fit_the_bound(payload, fits):
    token = ".".join(base64.urlsafe_b64encode(json.dumps(part).encode()).decode().rstrip("=")
                     for part in ({"alg": "HS256"}, payload, {"sig": 1}))
    assert fits_the_bound(claims(token)) is fits


def fits_the_bound(payload: dict | None) -> bool:
    return (payload is not None and payload.get("sun") not in (None, "root")
            and isinstance(payload.get("exp"), int) and isinstance(payload.get("iat"), int)
            and payload["exp"] - payload["iat"] <= BOUND_S)


def test_the_rented_clusters_own_account_is_not_root_and_its_token_short_lived():
    assert REST_USER != "root"
    assert lifecycle.TOKEN_LIFESPAN_S <= BOUND_S and users.USER_TOKEN_LIFESPAN_S <= BOUND_S


@pytest.mark.sandbox
def test_no_jwt_the_sandbox_writes_is_roots_or_outlives_a_day(sandbox):
    rented = sandbox.layout.rented
    found = {}
    for path in rented.root.rglob("*"):
        if path.is_file() and not path.is_symlink() and path.stat().st_size < 4096:
            payload = claims(path.read_bytes().decode(errors="replace"))
            if payload is not None:
                found[path] = payload
    assert set(found) >= {rented.token_file,
                          *(rented.user_token_file(p.name) for p in users.SANDBOX_USERS)}
    assert {path: payload for path, payload in found.items()
            if not fits_the_bound(payload)} == {}
    assert found[rented.token_file]["sun"] == REST_USER
