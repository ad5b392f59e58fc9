"""Issue 28 in the real sandbox: its S3 server at the remote site, as the attacker sees it
(alice, with no S3 key, on the remote site's loopback the rented cluster's jobs share), and
its S3 traffic across the WAN from home, on TLS verified against the site CA."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import pytest

from slurm_geo.ckpt.stores.s3store import make_s3_client
from slurm_geo.config import load_config
from slurm_geo.sandbox import netns
from slurm_geo.sandbox.seaweed import SeaweedServer
from slurm_geo.sandbox.sites import Site
from slurm_geo.sandbox.users import ALICE

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

# Run by alice in the remote site: each internal port over TLS without a certificate, in
# clear, and weed's unix sockets; one JSON line of what answered.
ATTACKER = """
import json, socket, ssl, sys, glob
ports, answered, refused = json.loads(sys.argv[1]), {}, []
for port in ports:
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    request = b"GET /col/delete?collection=slurm-geo HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n"
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \\
                context.wrap_socket(raw) as tls:
            tls.sendall(request)
            answered[f"tls {port}"] = tls.recv(32).decode("latin-1")
    except ssl.SSLError as exc:  # reached, and refused for want of a certificate
        if "CERTIFICATE_REQUIRED" in str(exc) or "certificate required" in str(exc):
            refused.append(port)
    except OSError:
        pass
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            raw.sendall(request)
            first = raw.recv(32)
            if first and not first.startswith((b"HTTP/1.0 400", b"HTTP/1.1 400")):
                answered[f"clear {port}"] = first.decode("latin-1")
    except OSError:
        pass
for path in glob.glob("/tmp/seaweedfs-*.sock"):
    if int(path.rsplit("-", 1)[1].split(".")[0]) in ports:
        sock = socket.socket(socket.AF_UNIX)
        try:
            sock.connect(path)
            answered[path] = "connected"
        except OSError:
            pass
print(json.dumps({"answered": answered, "refused": refused}))
"""


def test_as_alice_at_the_remote_site_the_s3_servers_internals_refuse_her(sandbox):
    server = SeaweedServer.of_sandbox(sandbox.layout)
    ports = list(server.internal_ports)  # the S3 port itself checks keys: its job
    done = netns.exec_in(sandbox.layout.topology, Site.REMOTE, [
        "setpriv", "--reuid", ALICE.name, "--regid", ALICE.name, "--clear-groups",
        str(sandbox.layout.site_python), "-c", ATTACKER, json.dumps(ports)], timeout=120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["answered"] == {}, done.stdout
    assert sorted(seen["refused"]) == sorted(ports), done.stdout  # reached, then refused
    # The S3 port itself listens at the site's address, not on loopback.
    assert server.s3_address == sandbox.layout.address(Site.REMOTE)


def test_the_sandboxs_s3_across_the_wan_is_tls_verified_against_the_site_ca(sandbox, s3_env):
    offsite = load_config(sandbox.layout.site_config).stores["offsite"]
    assert offsite.endpoint_url.startswith("https://") and offsite.ca_file == \
        sandbox.layout.ca_cert
    assert offsite.job_keys == "per-run"
    keys = {"access_key_id": s3_env["AWS_ACCESS_KEY_ID"],
            "secret_access_key": s3_env["AWS_SECRET_ACCESS_KEY"]}
    trusted = make_s3_client(offsite.endpoint_url, "us-east-1", ca_file=offsite.ca_file,
                             connect_timeout_s=5, read_timeout_s=10, **keys)
    assert "slurm-geo" in [b["Name"] for b in trusted.list_buckets()["Buckets"]]
    certifi_only = make_s3_client(offsite.endpoint_url, "us-east-1", connect_timeout_s=5,
                                  read_timeout_s=10, **keys)
    with pytest.raises(Exception, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
        certifi_only.list_buckets()
    # In clear from home across the WAN, the port answers nothing but a 400.
    endpoint = urlsplit(offsite.endpoint_url)
    with socket.create_connection((endpoint.hostname, endpoint.port), timeout=5) as raw:
        raw.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        first = raw.recv(32)
    assert first == b"" or first.startswith((b"HTTP/1.0 400", b"HTTP/1.1 400")), first


def test_the_sandboxs_federation_config_mints_keys_that_keep_runs_apart(sandbox, s3_env):
    """What the daemon does at a move (job_environment with the offsite store's job_keys),
    against the sandbox's own server: run A's key cannot touch run B's objects."""
    from slurm_geo.ckpt.stores.s3store import S3Store, S3Unavailable
    from slurm_geo.federation.act.credentials import bucket_and_prefix, job_environment

    offsite = load_config(sandbox.layout.site_config).stores["offsite"]
    bucket, prefix = bucket_and_prefix(offsite.url)
    tag = f"{time.time_ns()}"

    def store_of(run: str) -> S3Store:
        env = job_environment(offsite, s3_env, run)
        return S3Store(bucket, prefix, make_s3_client(
            offsite.endpoint_url, "us-east-1", access_key_id=env["AWS_ACCESS_KEY_ID"],
            secret_access_key=env["AWS_SECRET_ACCESS_KEY"], ca_file=env["AWS_CA_BUNDLE"]))

    a, b = store_of(f"iso-a-{tag}"), store_of(f"iso-b-{tag}")
    theirs = f"manifests/iso-b-{tag}/00000000000000000001"
    b.put(theirs, b"b's")
    for call in (lambda: a.put(theirs, b"evil"), lambda: a.delete(theirs),
                 lambda: a.put(f"latest/iso-b-{tag}", b"evil")):
        with pytest.raises(S3Unavailable, match="AccessDenied"):
            call()
    assert b.get(theirs) == b"b's"
    daemons = S3Store(bucket, prefix, make_s3_client(
        offsite.endpoint_url, "us-east-1", access_key_id=s3_env["AWS_ACCESS_KEY_ID"],
        secret_access_key=s3_env["AWS_SECRET_ACCESS_KEY"], ca_file=offsite.ca_file))
    daemons.delete(theirs)
