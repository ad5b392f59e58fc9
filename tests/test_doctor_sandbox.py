"""`slurm-geo doctor` on the real sandbox (issue 33 item 4): clean, it passes; with each
piece broken on purpose, one at a time, it exits DOCTOR_FAILED with exactly one ERROR line
naming the piece and its fix.

Nothing of the sandbox is broken in place: each case writes a copy of the sandbox's config
(and of the file it breaks) into a temporary directory and points the doctor at it.
    slurm.conf line     a copy of onprem's slurm.conf without PlugStackConfig
    plugin mismatch     a plugstack.conf loading a plugin built with Slurm 23.11's number
    munge down          --munge-socket naming a socket no munged listens on
    0644 key            a copy of the master key, chmod 644
    expired JWT         a token whose exp passed an hour ago as rented's token_file
    etcd member down    the state on a 3-member etcd of the test's own, one member stopped
    cert in 3 days      a federation certificate of the sandbox CA ending in 3 days
    read-only store     pfs on a tmpfs mounted read-only
    clock skew 90 s     --clock-offset-s 90, the doctor's hidden option that adds 90 s to
                        this host's clock (the machine's clock is never touched)
    unit not enabled    a systemd root whose federation unit has no *.wants/ link
The daemons' units are checked in a systemd root of the test's own (--systemd-root): the
sandbox starts its daemons itself, not through systemd.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import pytest

import slurm_geo
from slurm_geo.config import load_config
from slurm_geo.exitcodes import ExitCode
from slurm_geo.sandbox.certs import Issued, issue_server

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

ROLES = ("login", "compute", "controller", "daemon")
UNITS = ("slurm-geo-federation.service", "slurm-geo-checkpoint-sync.service")
UNIT_SOURCE = Path(slurm_geo.__file__).parent / "share" / "systemd"


def set_key(text: str, table: str, key: str, value: str | None) -> str:
    """`text` (a TOML file) with `key = value` in [table] (value a TOML literal; None
    removes the key)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"\[{re.escape(table)}\]",
                                                               line))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("[")),
               len(lines))
    body = [line for line in lines[start + 1:end]
            if not re.match(rf"{re.escape(key)}\s*=", line)]
    if value is not None:
        body.insert(0, f"{key} = {value}")
    return "\n".join([*lines[:start + 1], *body, *lines[end:]]) + "\n"


def q(value: object) -> str:
    return json.dumps(str(value))


@pytest.fixture(scope="module")
def base(sandbox, tmp_path_factory) -> dict:
    """The sandbox's config text, and a systemd root with both daemons' units enabled."""
    root = tmp_path_factory.mktemp("doctor-root")
    system = root / "etc" / "systemd" / "system"
    wants = system / "multi-user.target.wants"
    wants.mkdir(parents=True)
    for unit in UNITS:
        shutil.copy(UNIT_SOURCE / unit, system / unit)
        (wants / unit).symlink_to(system / unit)
    return {"text": sandbox.layout.site_config.read_text(), "root": root,
            "env": {**os.environ, **sandbox.s3_env()}}


def doctor(base: dict, tmp: Path, text: str, *extra: str) -> subprocess.CompletedProcess:
    config = tmp / "config.toml"
    config.write_text(text)
    roles = [arg for role in ROLES for arg in ("--role", role)]
    argv = [sys.executable, "-m", "slurm_geo", "doctor", "--config", str(config), *roles,
            "--systemd-root", str(base["root"]), *extra]
    return subprocess.run(argv, env=base["env"], capture_output=True, text=True, timeout=120,
                          check=False)


def errors(done: subprocess.CompletedProcess) -> list[str]:
    return [line for line in done.stdout.splitlines() if line.startswith("ERROR")]


def test_the_sandbox_passes(base, tmp_path):
    done = doctor(base, tmp_path, base["text"])
    assert done.returncode == 0, done.stdout + done.stderr
    assert errors(done) == [] and "all good" in done.stdout
    as_json = json.loads(doctor(base, tmp_path, base["text"], "--json").stdout)
    assert as_json["ok"] is True and set(as_json["roles"]) == set(ROLES)
    checked = {f["check"].split(" (")[0] for f in as_json["findings"]}
    assert {"slurm.conf", "spank plugin", "munge", "master key", "tls", "token",
            "clock", "store pfs", "store offsite", *(f"unit {u}" for u in UNITS)} <= checked


# --- the breaks: each a context manager yielding (config text, extra args, words) ----

def _slurm_conf_copy(sandbox, tmp: Path, change: Callable[[str], str]) -> Path:
    source = sandbox.layout.onprem.slurm_conf
    copy = tmp / "slurm.conf"
    copy.write_text(change(source.read_text()))
    return copy


@contextmanager
def no_plugstack_line(base, tmp, sandbox):
    copy = _slurm_conf_copy(sandbox, tmp, lambda text: "\n".join(
        line for line in text.splitlines() if not line.startswith("PlugStackConfig")) + "\n")
    yield set_key(base["text"], "clusters.onprem", "slurm_conf", q(copy)), (), \
        ["slurm.conf (onprem)", "PlugStackConfig", "scontrol reconfigure"]


@contextmanager
def plugin_for_another_slurm(base, tmp, sandbox):
    source = tmp / "plugin.c"
    source.write_text("const char plugin_name[] = \"geo_directives\";\n"
                      "const char plugin_type[] = \"spank\";\n"
                      "const unsigned int plugin_version = 0x170b02;\n")
    plugin = tmp / "geo_directives.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(plugin), str(source)], check=True)
    plugstack = tmp / "plugstack.conf"
    plugstack.write_text(f"required {plugin} config={sandbox.layout.site_config}\n")
    copy = _slurm_conf_copy(sandbox, tmp, lambda text: re.sub(
        r"(?m)^PlugStackConfig=.*$", f"PlugStackConfig={plugstack}", text))
    yield set_key(base["text"], "clusters.onprem", "slurm_conf", q(copy)), (), \
        ["spank plugin", "23.11.2", "22.05", "rebuild"]


@contextmanager
def munge_down(base, tmp, sandbox):
    yield base["text"], ("--munge-socket", str(tmp / "no-munged.socket")), \
        ["munge", "no-munged.socket", "munged"]


@contextmanager
def key_0644(base, tmp, sandbox):
    key = tmp / "master.key"
    shutil.copy(sandbox.layout.master_key, key)
    key.chmod(0o644)
    text = set_key(base["text"], "federation", "key_file", q(key))
    yield set_key(text, "sync", "key_file", q(key)), (), ["master key", "0644", "chmod 600"]


@contextmanager
def expired_jwt(base, tmp, sandbox):
    import base64

    claims = json.dumps({"exp": int(time.time()) - 3600, "sun": "slurm-geo"}).encode()
    token = tmp / "expired.jwt"
    token.write_text("eyJhbGciOiJIUzI1NiJ9." + base64.urlsafe_b64encode(claims).decode()
                     .rstrip("=") + ".c2ln\n")
    token.chmod(0o600)
    yield set_key(base["text"], "clusters.rented", "token_file", q(token)), (), \
        ["token", "expired", "scontrol token"]


@contextmanager
def etcd_member_down(base, tmp, sandbox):
    from tests.etcd_server import start_cluster, stop_cluster

    members = start_cluster(tmp, 3)
    try:
        url = load_config(sandbox.layout.site_config).federation.url
        text = base["text"]
        for key in ("state", "audit_path", "etcd_ca_file", "etcd_cert", "etcd_key",
                    "etcd_user", "etcd_password_file"):
            text = set_key(text, "federation", key, None)
        text = set_key(text, "federation", "etcd_endpoints",
                       json.dumps([m.client_url for m in members]))
        if "[[federation.replicas]]" not in text:
            text = set_key(text, "federation", "replica", q("home"))
            text += f'\n[[federation.replicas]]\nname = "home"\nsite = "home"\nurl = {q(url)}\n'
        members[2].stop()
        yield text, (), ["etcd", members[2].client_url, "quorum held (2 of 3)"]
    finally:
        stop_cluster(members)


@contextmanager
def cert_in_three_days(base, tmp, sandbox):
    layout = sandbox.layout
    ca = Issued(layout.ca_key.read_bytes(), layout.ca_cert.read_bytes())
    issued = issue_server(ca, ["127.0.0.1"], datetime.now(UTC), days=3)
    cert, key = tmp / "federation.pem", tmp / "federation.key"
    cert.write_bytes(issued.cert_pem)
    key.write_bytes(issued.key_pem)
    key.chmod(0o600)
    text = set_key(base["text"], "federation", "tls_cert", q(cert))
    yield set_key(text, "federation", "tls_key", q(key)), (), \
        ["tls ([federation] tls_cert)", "expires in 3 days", "new certificate"]


@contextmanager
def read_only_store(base, tmp, sandbox):
    mount = tmp / "ro"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(mount)],
                   check=True)
    try:
        yield set_key(base["text"], "stores.pfs", "url", q(f"file://{mount}")), (), \
            ["store pfs", "refuses write", "file://"]
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@contextmanager
def clock_90_s_ahead(base, tmp, sandbox):
    # "90 s ahead" give or take the second the Date header is rounded to
    yield base["text"], ("--clock-offset-s", "90"), ["clock: this host's clock is",
                                                      "s ahead of the daemon", "NTP"]


@contextmanager
def unit_not_enabled(base, tmp, sandbox):
    root = tmp / "root"
    shutil.copytree(base["root"], root, symlinks=True)
    (root / "etc/systemd/system/multi-user.target.wants" / UNITS[0]).unlink()
    yield base["text"], ("--systemd-root", str(root)), \
        [UNITS[0], "not enabled", f"systemctl enable --now {UNITS[0]}"]


BREAKS = [no_plugstack_line, plugin_for_another_slurm, munge_down, key_0644, expired_jwt,
          etcd_member_down, cert_in_three_days, read_only_store, clock_90_s_ahead,
          unit_not_enabled]


@pytest.mark.parametrize("broken", BREAKS, ids=lambda b: b.__name__)
def test_each_broken_piece_is_one_error_line_with_its_fix(base, tmp_path, sandbox, broken):
    with broken(base, tmp_path, sandbox) as (text, extra, words):
        done = doctor(base, tmp_path, text, *extra)
    assert done.returncode == ExitCode.DOCTOR_FAILED, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    found = errors(done)
    assert len(found) == 1, done.stdout
    assert "; fix: " in found[0]
    for word in words:
        assert word in found[0], (word, found[0])
