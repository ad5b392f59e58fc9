"""What a replica says that does not lead, and what any replica says of leadership. Pure.

A lease or key request to a follower is answered with the way to the leader, never a
grant, a wait, a fence or a key (docs/federation.md, "Replicas"): `307 Temporary Redirect`
with the leader's URL of the same path in Location, or, while no replica leads (an
election, at most about leader_ttl_s and a third), `503` with Retry-After. Neither
authenticates the request, so a follower consumes no nonce, MUNGE credential or token.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

from slurm_geo.federation.engine.leaseservice import Reply
from slurm_geo.federation.model import Replica


def retry_after_s(leader_ttl_s: float) -> int:
    """A follower campaigns every third of the leader's TTL: a leader is there that soon
    after the key went."""
    return max(1, math.ceil(leader_ttl_s / 3))


def follower_reply(leader: Replica | None, path: str, retry_s: int) -> Reply:
    """The answer to a lease or key request (at `path`) that this replica does not lead."""
    if leader is None:
        return Reply(503, {"reason": "no replica of the federation daemon leads right now "
                           "(an election is under way); ask again", "leader": None},
                     headers={"Retry-After": str(retry_s)})
    return Reply(307, {"reason": f"this replica does not lead: {leader.name} at site "
                       f"{leader.site} does; ask it", "leader": asdict(leader)},
                 headers={"Location": leader.url.rstrip("/") + path})


def leader_status(me: Replica, term: int | None, leader: Replica | None,
                  replicated: bool) -> dict[str, Any]:
    """`GET /v1/leader`, on every replica: who it is, whether it leads, who does."""
    return {"replica": asdict(me), "replicated": replicated, "leading": term is not None,
            "term": term, "leader": None if leader is None else asdict(leader)}
