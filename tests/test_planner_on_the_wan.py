"""The planner's choice over the sandbox's real, shaped WAN: the bandwidth model learns the
link from objects timed crossing it to the remote site's S3 server, as it learns from
checkpoint-sync's replications, and the same job at the same queue waits stays home over a
slow link (moving its checkpoint would take longer than the queue) and moves over a fast
one."""

from __future__ import annotations

import os
import time
import uuid

import pytest

from slurm_geo.ckpt.stores.s3store import S3Store, make_s3_client
from slurm_geo.config.model import Prices
from slurm_geo.federation.decide.bandwidth import BandwidthModel
from slurm_geo.federation.decide.planner import ClusterView, JobNeeds, plan
from slurm_geo.policy.directives import Directives
from slurm_geo.policy.geo import GeoPolicy, GeoRules
from slurm_geo.sandbox import netns
from slurm_geo.sandbox.layout import S3_BUCKET, S3_PREFIX

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

MIB = 2**20
SAMPLE_BYTES = 8 * MIB
CHECKPOINT_BYTES = 2 * 10**9  # newest verified at home only: it would have to cross
HOME_QUEUE_S = 800.0
RULES = GeoRules(GeoPolicy(), {"onprem": "home", "rented": "remote"})
CLUSTERS = [
    ClusterView("onprem", "home", "pfs", Prices(), up=True, queue_wait_s=HOME_QUEUE_S,
                fits=True),
    ClusterView("rented", "remote", "offsite", Prices(cpu_hour=0.04), up=True,
                queue_wait_s=0.0, fits=True),
]
JOB = JobNeeds(logical_job="onprem-1", home="onprem", current="onprem", nodes=1, cpus=2,
               gpus=0, remaining_s=3600.0, checkpoint_bytes=CHECKPOINT_BYTES,
               checkpoint_store="pfs",
               directives=Directives(ckpt_dir="/pfs/ckpt/run", failover="auto"))


def learned_over_the_wan(sandbox, s3_env, mbit: int) -> BandwidthModel:
    """A model fed two 8 MiB objects put from the login host (the path crosses home and
    the WAN) to the remote site's S3 server, the WAN shaped at `mbit`."""
    topo = sandbox.layout.topology
    netns.set_wan_rate(topo, mbit)
    store = S3Store(S3_BUCKET, S3_PREFIX, make_s3_client(
        sandbox.layout.s3_endpoint, "us-east-1", access_key_id=s3_env["AWS_ACCESS_KEY_ID"],
        secret_access_key=s3_env["AWS_SECRET_ACCESS_KEY"],
        ca_file=s3_env["AWS_CA_BUNDLE"]))  # 8 MiB: one PUT
    model, payload = BandwidthModel(), os.urandom(SAMPLE_BYTES)
    name = f"probes/{uuid.uuid4().hex}"
    try:
        for _ in range(2):
            started = time.monotonic()
            store.put(name, payload)
            model.observe("pfs", "offsite", SAMPLE_BYTES, time.monotonic() - started)
    finally:
        store.delete(name)
        netns.set_wan_rate(topo, netns.remembered_wan_mbit(sandbox.layout))
    return model


@pytest.mark.parametrize("mbit, moves", [(20, False), (1000, True)])
def test_a_big_checkpoint_waits_for_home_over_a_slow_link_and_moves_over_a_fast_one(
        sandbox, s3_env, mbit, moves):
    model = learned_over_the_wan(sandbox, s3_env, mbit)
    learned = model.estimate("pfs", "offsite")
    assert learned is not None and learned.bits_per_s < mbit * 1e6 * 1.15  # it is the link

    decision = plan(JOB, CLUSTERS, RULES, model.predict_seconds)

    transfer_s = decision.candidate("rented").transfer_s
    assert transfer_s is not None
    assert decision.moves() is moves, decision.reason
    if moves:
        assert decision.choice == "rented" and transfer_s < HOME_QUEUE_S
    else:
        # Two GB at 20 Mbit/s: some 800 s of transfer, against 800 s of queue at home.
        assert decision.choice == "onprem" and transfer_s > HOME_QUEUE_S - 60
        assert "stay on onprem" in decision.reason and "rented (the soonest elsewhere)" \
            in decision.reason
