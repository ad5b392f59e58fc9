"""MUNGE behind its interface (slurm_geo.lease.munge): unmunge's output parsed, the socket
found, the fake munged tests use, and once, where munged is already running, the real
`munge` and `unmunge`."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from slurm_geo.lease.munge import (
    UNAUTHORIZED,
    BadCredential,
    Decoded,
    FakeMunge,
    MungeCommands,
    MungeUnavailable,
    munge_socket,
    parse_unmunge,
    socket_from_slurm_conf,
)

# `unmunge -N` as munge 0.5.15 prints it (Debian 12).
UNMUNGE_N = """STATUS:          0
ENCODE_HOST:     127.0.0.1
ENCODE_TIME:     1796114960
DECODE_TIME:     1796114960
TTL:             300
CIPHER:          4
MAC:             5
ZIP:             0
UID:             2001
GID:             2100
LENGTH:          3

x y"""


def test_unmunge_output_is_parsed():
    assert parse_unmunge(UNMUNGE_N) == Decoded(2001, 2100, "x y")
    assert parse_unmunge(UNMUNGE_N.replace("LENGTH:          3\n\nx y",
                                           "LENGTH:          0\n\n")).payload == ""


@pytest.mark.parametrize("text", ["", "STATUS: 0\n\n", UNMUNGE_N.replace("UID:             2001\n",
                                                                       "UID:  alice (2001)\n")])
def test_unmunge_output_without_numeric_ids_is_a_bad_credential(text):
    with pytest.raises(BadCredential):
        parse_unmunge(text)


def test_a_failed_status_is_a_bad_credential():
    with pytest.raises(BadCredential, match="replayed") as bad:
        parse_unmunge(UNMUNGE_N.replace("STATUS:          0", "STATUS:          17"))
    assert bad.value.status == 17


@pytest.mark.parametrize("conf, socket", [
    ("AuthType=auth/munge\nAuthInfo=socket=/run/x/munge.socket,cred_expire=60\n",
     Path("/run/x/munge.socket")),
    ("authinfo = cred_expire=60,Socket=/s\n", Path("/s")),
    ("# AuthInfo=socket=/commented\nAuthType=auth/munge\n", None),
    ("AuthInfo=cred_expire=60\n", None),
])
def test_the_socket_a_slurm_conf_names(conf, socket):
    assert socket_from_slurm_conf(conf) == socket


def test_the_configured_socket_wins_over_slurm_conf(tmp_path):
    conf = tmp_path / "slurm.conf"
    conf.write_text("AuthInfo=socket=/from/conf\n")
    assert munge_socket(Path("/configured"), conf) == Path("/configured")
    assert munge_socket(None, conf) == Path("/from/conf")
    assert munge_socket(None, tmp_path / "missing.conf") is None
    assert munge_socket(None, None) is None


def test_the_fake_munged_decodes_each_credential_once_as_its_uid():
    munged = FakeMunge()
    alice, bob = munged.as_uid(2001), munged.as_uid(2002)
    credential = alice.encode("payload")
    assert bob.decode(credential) == Decoded(2001, 2001, "payload")
    with pytest.raises(BadCredential) as replay:
        munged.decode(credential)
    assert replay.value.status == 17
    with pytest.raises(BadCredential):
        munged.decode("MUNGE:forged:")


def test_munged_not_running_is_unavailable(tmp_path):
    if shutil.which("munge") is None:
        pytest.skip("munge is not installed")
    with pytest.raises(MungeUnavailable):
        MungeCommands(tmp_path / "no.socket").encode("x")
    with pytest.raises(MungeUnavailable):
        MungeCommands(tmp_path / "no.socket").decode("MUNGE:abc:")


def test_a_missing_program_is_unavailable(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(MungeUnavailable, match="cannot run munge"):
        MungeCommands(None).encode("x")


def running_munge_socket() -> Path | None:
    """A socket a munged already running answers on: $SLURM_GEO_TEST_MUNGE_SOCKET, the
    sandbox's, or munge's default. Nothing is started here."""
    from slurm_geo.sandbox.layout import DEFAULT_ROOT, SandboxLayout

    candidates = [os.environ.get("SLURM_GEO_TEST_MUNGE_SOCKET", ""),
                  str(SandboxLayout(DEFAULT_ROOT).munge_socket), "/run/munge/munge.socket.2"]
    for candidate in filter(None, candidates):
        path = Path(candidate)
        if path.exists() and shutil.which("munge") and subprocess.run(
                ["munge", "-n", "-S", str(path)], capture_output=True, timeout=5).returncode == 0:
            return path
    return None


def test_the_real_munge_and_unmunge_round_trip_once():
    socket = running_munge_socket()
    if socket is None:
        pytest.skip("no munged is running (the sandbox starts one: slurm-geo sandbox up)")
    munge = MungeCommands(socket)
    credential = munge.encode("ab" * 32)
    decoded = munge.decode(credential)
    assert (decoded.uid, decoded.payload) == (os.getuid(), "ab" * 32)
    with pytest.raises(BadCredential) as replay:
        munge.decode(credential)
    assert replay.value.status == 17
    with pytest.raises(BadCredential):
        munge.decode(credential[:20] + "A" + credential[21:])


def test_a_credential_restricted_to_a_uid_opens_for_that_uid_only():
    munged = FakeMunge(2001)
    for_alice = munged.encode("ab" * 32, restrict_uid=2001)
    with pytest.raises(BadCredential) as refused:
        munged.as_uid(2002).decode(for_alice)
    assert refused.value.status == UNAUTHORIZED
    assert munged.as_uid(2001).decode(for_alice).payload == "ab" * 32


def test_the_payload_goes_to_munge_on_stdin_never_in_its_arguments(monkeypatch):
    """A process's arguments are readable by every user of the node (/proc/PID/cmdline):
    the run key rank 0 hands the other ranks must not be among them."""
    seen: list[tuple[list[str], str]] = []

    def run(argv, input, **_kwargs):  # noqa: A002  # subprocess.run's own name
        seen.append((argv, input))
        return subprocess.CompletedProcess(argv, 0, "MUNGE:cred:\n", "")
    monkeypatch.setattr(subprocess, "run", run)
    assert MungeCommands(Path("/run/x.socket")).encode("s3cret-key", restrict_uid=2001) == \
        "MUNGE:cred:"
    (argv, stdin), = seen
    assert stdin == "s3cret-key" and not any("s3cret" in a for a in argv)
    assert argv == ["munge", "-u", "2001", "-S", "/run/x.socket"]
