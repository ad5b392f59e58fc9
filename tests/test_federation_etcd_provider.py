"""The rented provider against the replicated state: holding what its etcd member holds
(the member's certificates and keys, read from the sandbox's tls directory as the
provider's admin would), it reads, writes and deletes nothing of the control plane, over
the JSON gateway or gRPC, at any member, its own included; the replicas, with their own
client certificate and password, work as before. On the sandbox's own certificates, command
lines and auth (sandbox.certs, sandbox.etcd_members), three members on loopback."""

from __future__ import annotations

import base64
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from slurm_geo.ckpt.format.keys import KeyFile
from slurm_geo.federation.state.etcd.kv import ABSENT, EtcdKV, EtcdRefused, EtcdTLS
from slurm_geo.federation.state.etcd.state import EtcdFederationState
from slurm_geo.sandbox.sites import Site
from tests.etcd_server import (
    MASTER_KEY,
    SANDBOX_PREFIX,
    SecureCluster,
    open_replica,
    start_sandbox_cluster,
)
from tests.kit.builders import HOME, NAME, NOW
from tests.kit.builders import logical_job as job

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def secure(tmp_path_factory) -> Iterator[SecureCluster]:
    cluster = start_sandbox_cluster(tmp_path_factory.mktemp("etcd-provider"))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def leader(secure: SecureCluster) -> Iterator[EtcdFederationState]:
    replica = open_replica(list(secure.cluster.client_endpoints), SANDBOX_PREFIX, "home-a",
                           tls=secure.replica_tls())
    assert replica.leadership.campaign()
    try:
        yield replica
    finally:
        replica.leadership.resign()
        replica.close()


def everything(replica: EtcdFederationState) -> dict[str, tuple[bytes, int]]:
    """Every key of the federation as etcd holds it: its sealed value and mod_revision."""
    return {item.key: (item.sealed, item.mod_revision)
            for item in replica.kv.range_sealed(SANDBOX_PREFIX + "/")}


def the_providers_files(secure: SecureCluster) -> list[tuple[Path, Path]]:
    """Every certificate and key the remote site's member holds."""
    files = secure.files
    return [(files.member_cert(Site.REMOTE), files.member_key(Site.REMOTE)),
            (files.peer_cert(Site.REMOTE), files.peer_key(Site.REMOTE))]


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def gateway_attempts(key: str) -> list[tuple[str, dict]]:
    start, end = SANDBOX_PREFIX + "/", SANDBOX_PREFIX + "0"  # every key of the federation
    return [("/v3/kv/range", {"key": _b64(start), "range_end": _b64(end)}),
            ("/v3/kv/put", {"key": _b64(key), "value": _b64("forged")}),
            ("/v3/kv/deleterange", {"key": _b64(start), "range_end": _b64(end)}),
            ("/v3/auth/authenticate", {"name": "root", "password": ""})]


def test_the_providers_member_files_read_write_and_delete_nothing(secure, leader) -> None:
    leader.add_job(job())
    leader.begin_generation(NAME, 0, HOME, 200, NOW)
    before = everything(leader)
    key = leader.layout.job(NAME)
    assert key in before
    files = secure.files
    refused = []
    for cert, private in the_providers_files(secure):
        for member in secure.cluster.members:
            for path, body in gateway_attempts(key):
                try:
                    reply = requests.post(member.client_url + path, json=body, timeout=5,
                                          verify=str(files.ca), cert=(str(cert), str(private)))
                except requests.exceptions.RequestException as exc:
                    refused.append(type(exc).__name__)  # the TLS handshake: not a client
                    continue
                assert reply.status_code != 200, (cert.name, member.name, path, reply.text)
                refused.append(reply.status_code)
            for args in (["get", "--prefix", SANDBOX_PREFIX + "/"], ["put", key, "forged"],
                         ["del", "--prefix", SANDBOX_PREFIX + "/"]):
                ctl = subprocess.run(
                    ["etcdctl", "--endpoints", member.client_url, "--cacert", str(files.ca),
                     "--cert", str(cert), "--key", str(private), "--command-timeout=1s",
                     "--dial-timeout=1s", *args],
                    capture_output=True, text=True, timeout=20, check=False)
                assert ctl.returncode != 0, (cert.name, member.name, args, ctl.stdout)
                assert NAME not in ctl.stdout
    assert len(refused) == 2 * 3 * 4
    # the same request with the replicas' certificate and token reads the state: what
    # refused the provider was its files, not the request
    token = leader.kv._clients[0].session.headers["Authorization"]
    home = secure.cluster.member(Site.HOME).client_url
    reply = requests.post(home + gateway_attempts(key)[0][0], json=gateway_attempts(key)[0][1],
                          timeout=5, verify=str(files.ca), headers={"Authorization": token},
                          cert=(str(files.client_cert), str(files.client_key)))
    assert reply.status_code == 200 and _b64(key) in reply.text
    assert everything(leader) == before  # nothing written, nothing deleted
    assert leader.job(NAME).generation == 1


def test_without_a_password_the_replicas_certificate_reads_nothing(secure, leader) -> None:
    leader.add_job(job(logical_job="onprem-9"))
    files = secure.files
    no_password = EtcdKV(list(secure.cluster.client_endpoints), KeyFile(MASTER_KEY),
                         tls=EtcdTLS(files.ca, files.client_cert, files.client_key))
    try:
        with pytest.raises(EtcdRefused, match="user name is empty"):
            no_password.get(leader.layout.job("onprem-9"))
    finally:
        no_password.close()
    wrong = files.directory / "wrong.password"
    wrong.write_text("not-it\n")
    wrong.chmod(0o600)
    with pytest.raises(EtcdRefused, match="refused etcd user 'slurm-geo-replica'.*"
                                          "etcd_password_file"):
        EtcdKV(list(secure.cluster.client_endpoints), KeyFile(MASTER_KEY),
               tls=EtcdTLS(files.ca, files.client_cert, files.client_key,
                           "slurm-geo-replica", wrong)).get("/slurm-geo/federation/leader")


def test_the_replicas_user_writes_the_federation_prefix_alone(secure, leader) -> None:
    kv = leader.kv
    with pytest.raises(EtcdRefused, match="permission denied"):
        kv.commit([], [kv.put("/elsewhere/x", b"v", at=ABSENT)], [])
    with pytest.raises(EtcdRefused, match="permission denied"):
        kv.get("/elsewhere/x")


def test_federation_status_reads_each_trusted_member_with_auth_on(secure, leader) -> None:
    from slurm_geo.federation.operator.replication import member_views

    members = leader.kv.ask_each_member("/cluster/member/list")
    views = member_views(leader.kv.ask_each_member("/maintenance/status"), members[0][1])
    assert [(v.endpoint, v.healthy, v.name) for v in views] == [
        (secure.cluster.member(site).client_url, True, site.value)
        for site in (Site.HOME, Site.CONTROL)]


def test_a_replica_whose_token_lapsed_gets_another(secure, leader) -> None:
    leader.add_job(job(logical_job="onprem-10"))
    for client in leader.kv._clients:  # as the member forgets it, auth-token-ttl after use
        client.session.headers["Authorization"] = "lapsed.1"
    assert leader.job("onprem-10").logical_job == "onprem-10"


def test_a_follower_on_the_other_trusted_member_reads_and_takes_over(secure, leader) -> None:
    leader.add_job(job(logical_job="onprem-11"))
    control = secure.cluster.member(Site.CONTROL).client_url
    follower = open_replica([control], SANDBOX_PREFIX, "control-b", site="control",
                            tls=secure.replica_tls())
    try:
        assert not follower.leadership.campaign()
        assert follower.job("onprem-11").generation == 0
        leader.leadership.resign()
        assert follower.leadership.campaign()
        assert follower.begin_generation("onprem-11", 0, HOME, 200, NOW).generation == 1
    finally:
        follower.leadership.resign()
        follower.close()
