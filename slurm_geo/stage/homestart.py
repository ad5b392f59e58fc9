"""The home job's world stager as a FederatedRun takes it (`stage_world`): imports
stage.home (and the stores) only once a key reply grants trees, so a job granted none
starts as fast as before."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slurm_geo.lease.protocol import KeyReply
    from slurm_geo.stage.home import HomeStager


def stage_home_world(reply: KeyReply, generation: int, store_url: str,
                     store_endpoint: str = "") -> HomeStager | None:
    """stage.home.for_key_reply, imported when first called."""
    from slurm_geo.stage.home import for_key_reply  # only a job granted a world

    return for_key_reply(reply, generation, store_url, store_endpoint)
