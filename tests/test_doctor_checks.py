"""`slurm-geo doctor`'s judgements, table-driven on facts (no file, socket or clock), and
its pure readers: slurm.conf and plugstack.conf lines, a JWT's exp, a plugin's ELF."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from slurm_geo.doctor import checks
from slurm_geo.doctor.checks import ERROR, OK, WARN, Finding
from slurm_geo.doctor.elf import NotAPlugin, plugin_version_in
from slurm_geo.doctor.facts import (
    ClockFact,
    EtcdFact,
    JwtFact,
    MemberHealth,
    MungeFact,
    SecretFileFact,
    SlurmConfFact,
    SpankFact,
    StoreFact,
    TlsFact,
    UnitFact,
)
from slurm_geo.doctor.gather import (
    jwt_expiry,
    parse_slurm_conf,
    plugstack_plugin,
    short_reason,
)

NOW = 2_000_000_000.0
DAY = 86400.0
CONF = Path("/etc/slurm/slurm.conf")
HOOK = "/etc/slurm/geo-prolog"
FULL = {"plugstackconfig": "/etc/slurm/plugstack.conf", "jobsubmitplugins": "lua",
        "clifilterplugins": "cli_filter/lua", "prolog": HOOK, "epilog": HOOK,
        "prologslurmctld": HOOK, "epilogslurmctld": HOOK}
PLUGIN = Path("/usr/lib/slurm-geo/geo_directives.so")
PLUGSTACK = Path("/etc/slurm/plugstack.conf")


def levels(findings: list[Finding]) -> list[str]:
    return [f.level for f in findings]


def only_error(findings: list[Finding], *words: str) -> None:
    """Exactly one finding, an error, whose line names each of `words` and a fix."""
    assert levels(findings) == [ERROR], findings
    line = findings[0].line()
    assert "; fix: " in line
    for word in words:
        assert word in line, (word, line)


def conf(**changes: str | None) -> SlurmConfFact:
    settings = {k: v for k, v in {**FULL, **changes}.items() if v is not None}
    return SlurmConfFact("onprem", CONF, settings, hooks_runnable={HOOK: True})


@pytest.mark.parametrize("fact, controller, words", [
    (conf(plugstackconfig=None), False, ["PlugStackConfig", str(CONF)]),
    (conf(plugstackconfig=None), True, ["PlugStackConfig"]),
    (conf(jobsubmitplugins=None), True, ["JobSubmitPlugins"]),
    (conf(clifilterplugins="cli_filter/syslog"), True, ["CliFilterPlugins", "lacks lua"]),
    (conf(prolog="/nowhere/prolog"), True, ["Prolog=/nowhere/prolog", "not an executable"]),
    (SlurmConfFact("onprem", CONF, error="No such file"), True, ["cannot be read"]),
])
def test_a_slurm_conf_lacking_one_line_is_one_error(fact, controller, words):
    only_error(checks.check_slurm_conf(fact, controller), *words)


def test_a_login_node_needs_plugstack_only_and_a_full_conf_is_fine():
    assert levels(checks.check_slurm_conf(conf(prolog=None, jobsubmitplugins=None),
                                          controller=False)) == [OK]
    assert levels(checks.check_slurm_conf(conf(), controller=True)) == [OK]


def spank(**changes) -> SpankFact:
    fields = dict(cluster="onprem", plugstack=PLUGSTACK, plugin=PLUGIN,
                  plugin_version=0x160508, slurm_version=(22, 5))
    return SpankFact(**{**fields, **changes})


@pytest.mark.parametrize("fact, words", [
    (spank(plugin_version=0x170B02), ["23.11.2", "22.05", "rebuild"]),
    (spank(plugin_version=0x150801), ["21.08.1"]),
    (spank(plugin=None), ["loads no geo_directives.so", str(PLUGSTACK)]),
    (spank(plugin_error="No such file or directory"), [str(PLUGIN), "site install"]),
    (spank(plugstack_error="Permission denied"), [str(PLUGSTACK)]),
])
def test_a_plugin_not_for_this_slurm_is_one_error(fact, words):
    only_error(checks.check_spank(fact), *words)


def test_a_plugin_of_another_micro_release_is_fine_and_no_plugstack_line_is_silent():
    assert levels(checks.check_spank(spank(plugin_version=0x160502))) == [OK]
    assert checks.check_spank(spank(plugstack=None)) == []  # check_slurm_conf says it
    assert levels(checks.check_spank(spank(slurm_version=None, slurm_error="x"))) == [WARN]


def test_munge():
    assert levels(checks.check_munge(MungeFact("/run/munge/munge.socket.2", True))) == [OK]
    only_error(checks.check_munge(MungeFact("/nowhere", False, "munge failed: Socket")),
               "/nowhere", "munged")


def secret(**changes) -> SecretFileFact:
    fields = dict(what="master key", path=Path("/etc/slurm-geo/master.key"), exists=True,
                  mode=0o600, uid=0, owner="root", owners=("root", "slurm-geo"))
    return SecretFileFact(**{**fields, **changes})


@pytest.mark.parametrize("fact, level, words", [
    (secret(), OK, []),
    (secret(owner="slurm-geo"), OK, []),
    (secret(mode=0o400), OK, []),
    (secret(mode=0o644), ERROR, ["0644", "chmod 600 /etc/slurm-geo/master.key"]),
    (secret(mode=0o640), ERROR, ["0640"]),
    (secret(owner="alice"), ERROR, ["owned by alice", "chown root"]),
    (secret(exists=False), ERROR, ["does not exist"]),
])
def test_secret_files(fact, level, words):
    found = checks.check_secret_file(fact)
    assert levels(found) == [level]
    for word in words:
        assert word in found[0].line()


def test_a_secret_a_role_need_not_hold_may_be_absent():
    assert checks.check_secret_file(secret(exists=False, required=False)) == []


@pytest.mark.parametrize("expires, level", [
    (NOW - 60, ERROR), (NOW - 30 * DAY, ERROR), (NOW + 3600, WARN),
    (NOW + 30 * DAY, OK), (None, OK)])
def test_token_expiry(expires, level):
    found = checks.check_jwt(JwtFact("rented", Path("/t.jwt"), expires, renew="scontrol token"),
                             NOW)
    assert levels(found) == [level]
    if level == ERROR:
        assert "expired" in found[0].line() and "scontrol token" in found[0].line()


def cert(**changes) -> TlsFact:
    fields = dict(what="[federation] tls_cert", path=Path("/etc/slurm-geo/tls.pem"),
                  not_before=NOW - DAY, not_after=NOW + 365 * DAY, ca=Path("/ca.pem"),
                  signed_by_ca=True, key=Path("/tls.key"), key_matches=True)
    return TlsFact(**{**fields, **changes})


@pytest.mark.parametrize("fact, level, words", [
    (cert(), OK, []),
    (cert(not_after=NOW + 3 * DAY), ERROR, ["expires in 3 days"]),
    (cert(not_after=NOW + 20 * DAY), WARN, ["expires in 20 days"]),
    (cert(not_after=NOW - DAY), ERROR, ["expired"]),
    (cert(signed_by_ca=False), ERROR, ["not signed by /ca.pem"]),
    (cert(key_matches=False), ERROR, ["do not match"]),
    (cert(key_matches=None, signed_by_ca=None), OK, []),
    (cert(not_before=NOW + DAY), ERROR, ["not valid for another"]),
    (TlsFact("x", Path("/gone.pem"), error="cannot read it"), ERROR, ["/gone.pem"]),
])
def test_certificates(fact, level, words):
    found = checks.check_tls(fact, NOW)
    assert levels(found) == [level]
    for word in words:
        assert word in found[0].line()


@pytest.mark.parametrize("fact, level, words", [
    (UnitFact("u.service", Path("/"), Path("/etc/systemd/system/u.service"), True), OK, []),
    (UnitFact("u.service", Path("/"), Path("/lib/systemd/system/u.service"), False), ERROR,
     ["not enabled", "systemctl enable --now u.service"]),
    (UnitFact("u.service", Path("/"), None), ERROR, ["not installed"]),
    (UnitFact("u.service", Path("/"), Path("/u"), True, "slurm-geo", False), ERROR,
     ["useradd --system slurm-geo"]),
])
def test_units(fact, level, words):
    found = checks.check_unit(fact)
    assert levels(found) == [level]
    for word in words:
        assert word in found[0].line()


def members(*healthy: bool) -> tuple[MemberHealth, ...]:
    return tuple(MemberHealth(f"https://m{i}:2379", ok, "" if ok else "refused")
                 for i, ok in enumerate(healthy))


def test_etcd_a_member_down_is_one_error_naming_it_and_the_quorum():
    only_error(checks.check_etcd(EtcdFact(members(True, True, False), 3)),
               "https://m2:2379", "quorum held (2 of 3)")
    lost = checks.check_etcd(EtcdFact(members(True, False, False), 3))
    assert levels(lost) == [ERROR, ERROR] and "quorum LOST" in lost[0].line()
    assert levels(checks.check_etcd(EtcdFact(members(True, True, True), 3))) == [OK]
    # an endpoint etcd's member list lacks still counts against the quorum it states
    only_error(checks.check_etcd(EtcdFact(members(True, True, True, False), 3)),
               "quorum held (3 of 4)")


def test_stores_name_the_first_operation_refused():
    only_error(checks.check_store(StoreFact("pfs", "file:///pfs", (
        ("write", "Read-only file system"),))), "store pfs", "refuses write")
    only_error(checks.check_store(StoreFact("s3", "s3://b/p", (
        ("write", ""), ("read", ""), ("list", "AccessDenied")))), "refuses list")
    assert levels(checks.check_store(StoreFact("pfs", "file:///pfs", (
        ("write", ""), ("read", ""), ("list", ""), ("delete", ""))))) == [OK]


@pytest.mark.parametrize("ours, offset, level", [
    (NOW, 0.0, OK), (NOW + 3, 0.0, OK), (NOW, 10.0, WARN), (NOW, 90.0, ERROR),
    (NOW, -90.0, ERROR), (NOW - 120, 0.0, ERROR)])
def test_clock_skew(ours, offset, level):
    found = checks.check_clock([ClockFact("https://fed:9852", ours, NOW)], offset)
    assert levels(found) == [level]
    if level == ERROR:
        assert "+-60 s" in found[0].line() and "NTP" in found[0].line()


def test_an_unreachable_daemon_is_an_error_with_no_clock_verdict():
    only_error(checks.check_clock([ClockFact("https://fed:9852", error="refused")]),
               "federation daemon", "does not answer")


def test_a_daemon_not_asked_for_want_of_its_ca_file_says_so(tmp_path):
    from slurm_geo.doctor.gather import clock_fact

    fact = clock_fact("https://fed:9852", tmp_path / "site-ca.pem")
    only_error(checks.check_clock([fact]), "federation daemon", "https://fed:9852",
               "cannot be asked", f"{tmp_path / 'site-ca.pem'} cannot be read",
               "No such file or directory", "[federation] ca_file")


def test_the_clock_is_one_verdict_on_the_replica_it_is_furthest_from():
    replicas = [ClockFact("https://home:9852", NOW, NOW - 2),
                ClockFact("https://control:9852", NOW, NOW + 1),
                ClockFact("https://gone:9852", error="refused")]
    found = checks.check_clock(replicas, 90.0)
    assert levels(found) == [ERROR, ERROR]
    assert "https://gone:9852" in found[0].line()
    assert "92 s ahead of the daemon at https://home:9852" in found[1].line()
    assert levels(checks.check_clock(replicas[:2])) == [OK]


def test_slurm_conf_parsing():
    text = ("# comment\nClusterName=onprem\nplugstackconfig=/a/plugstack.conf # trailing\n"
            "NodeName=n1 CPUs=2\nProlog=/x\nProlog=/y\n")
    settings = parse_slurm_conf(text)
    assert settings["plugstackconfig"] == "/a/plugstack.conf"
    assert settings["prolog"] == "/y"  # a later line wins
    assert settings["nodename"] == "n1 CPUs=2"


def test_plugstack_parsing():
    assert plugstack_plugin("# x\noptional /usr/lib/other.so\nrequired "
                            "/usr/lib/slurm-geo/geo_directives.so config=/c\n") == PLUGIN
    assert plugstack_plugin("include /etc/slurm/plugstack.conf.d/*\n") is None


def _jwt(claims: dict) -> str:
    body = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    return f"eyJhbGciOiJIUzI1NiJ9.{body}.c2ln"


def test_jwt_expiry_is_read_without_the_key():
    assert jwt_expiry(_jwt({"exp": 1796675858, "sun": "slurm-geo"})) == 1796675858.0
    assert jwt_expiry(_jwt({"sun": "x"})) is None
    for bad in ("not-a-token", "a.b.c", _jwt({"exp": "soon"})):
        with pytest.raises(ValueError):
            jwt_expiry(bad)


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_plugin_version_is_read_from_the_elf_without_loading_it(tmp_path):
    source = tmp_path / "p.c"
    source.write_text("const unsigned int plugin_version = 0x170b02;\n"
                      "const char plugin_type[] = \"spank\";\n")
    built = tmp_path / "p.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(built), str(source)], check=True)
    assert plugin_version_in(built.read_bytes()) == 0x170B02
    with pytest.raises(NotAPlugin):
        plugin_version_in(b"\x7fELF" + bytes(100))
    with pytest.raises(NotAPlugin):
        plugin_version_in(b"#!/bin/sh\n" * 10)


@pytest.mark.parametrize("text, short", [
    ("HTTPConnectionPool(host='127.0.0.1', port=1): Max retries exceeded (Caused by "
     "NewConnectionError(\"...: Failed to establish a new connection: [Errno 111] "
     "Connection refused\"))", "Connection refused"),
    ("<urlopen error [Errno 111] Connection refused>", "Connection refused"),
    ("HTTPSConnectionPool(host='10.77.15.3', port=27860): Max retries exceeded (Caused by "
     "ConnectTimeoutError(<HTTPSConnection(host='10.77.15.3', port=27860) at 0x7f27",
     "no answer in time (timed out)"),
    ("<urlopen error timed out>", "no answer in time (timed out)"),
    ("store cannot access 'doctor/x' (Read-only file system)",
     "store cannot access 'doctor/x' (Read-only file system)"),
])
def test_failures_are_said_in_the_os_words(text, short):
    assert short_reason(text) == short


def test_a_host_is_a_daemon_host_where_the_key_or_a_daemons_enabled_unit_is(tmp_path):
    from slurm_geo.config import parse_config
    from slurm_geo.doctor.examine import detect_roles

    site = parse_config({
        "site": {"home_cluster": "onprem"},
        "clusters": {"onprem": {"region": "home", "access": "cli",
                                "slurm_conf": str(tmp_path / "slurm.conf"), "store": "pfs"}},
        "stores": {"pfs": {"url": "file:///pfs", "region": "home"}},
        "federation": {}})
    key = tmp_path / "master.key"
    env = {"SLURM_GEO_KEY_FILE": str(key)}
    assert "daemon" not in detect_roles(site, tmp_path, env)
    assert detect_roles(site, tmp_path, env)[0] == "login"
    key.write_bytes(b"k")
    assert "daemon" in detect_roles(site, tmp_path, env)
    key.unlink()
    unit = tmp_path / "lib/systemd/system/slurm-geo-federation.service"
    unit.parent.mkdir(parents=True)
    unit.write_text("[Service]\nUser=slurm-geo\n")
    assert "daemon" not in detect_roles(site, tmp_path, env)  # site install: every host
    wants = tmp_path / "etc/systemd/system/multi-user.target.wants"
    wants.mkdir(parents=True)
    (wants / unit.name).symlink_to(unit)
    assert "daemon" in detect_roles(site, tmp_path, env)


def test_a_link_rate_is_reported_never_judged():
    from slurm_geo.doctor.checks import INFO, check_link
    from slurm_geo.doctor.facts import LinkFact

    found = check_link(LinkFact("offsite", "s3://b/p", 4_000_000, 0.5, 0.25))
    assert levels(found) == [INFO]
    assert "4 MB up at 8 MB/s, read back at 16 MB/s" in found[0].line()
    assert check_link(LinkFact("offsite", "s3://b/p", error="refused")) == []
    assert not checks.failed(found)


def test_a_certificate_is_checked_against_its_ca_and_its_key(tmp_path):
    from datetime import UTC, datetime

    from slurm_geo.doctor.gather import tls_fact
    from slurm_geo.sandbox.certs import issue_server, make_ca

    now = datetime.now(UTC)
    ca, other = make_ca("site CA", now), make_ca("another CA", now)
    server, stranger = issue_server(ca, ["127.0.0.1"], now, days=3), \
        issue_server(other, ["127.0.0.1"], now)
    files = {"ca.pem": ca.cert_pem, "other.pem": other.cert_pem, "tls.pem": server.cert_pem,
             "tls.key": server.key_pem, "stranger.key": stranger.key_pem}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    fact = tls_fact("t", tmp_path / "tls.pem", tmp_path / "ca.pem", tmp_path / "tls.key")
    assert (fact.signed_by_ca, fact.key_matches) == (True, True)
    only_error(checks.check_tls(fact, now.timestamp()), "expires in 3 days")
    assert tls_fact("t", tmp_path / "tls.pem", tmp_path / "other.pem").signed_by_ca is False
    assert tls_fact("t", tmp_path / "tls.pem", key=tmp_path / "stranger.key").key_matches \
        is False
    assert "cannot read" in tls_fact("t", tmp_path / "none.pem").error


def test_a_compute_or_login_node_holding_the_master_key_is_an_error():
    only_error(checks.check_not_held(secret(), "compute"), "master key", "compute host",
               "shred -u /etc/slurm-geo/master.key")
    assert levels(checks.check_not_held(secret(exists=False), "login")) == [OK]


def test_a_user_on_a_daemon_host_is_told_the_daemon_checks_need_root():
    assert checks.daemon_checks_skipped(roles_given=False).level == WARN  # found, not asked
    asked = checks.daemon_checks_skipped(roles_given=True)
    assert asked.level == ERROR and "sudo slurm-geo doctor" in asked.line()


@pytest.mark.parametrize("level_found, level", [
    ("Operator", OK), ("Administrator", OK), ("None", ERROR), ("", ERROR)])
def test_the_daemons_account_is_a_slurm_operator(level_found, level):
    from slurm_geo.doctor.facts import OperatorFact

    found = checks.check_operator(OperatorFact("onprem", "slurm-geo", level_found))
    assert levels(found) == [level]
    if level == ERROR:
        assert "adminlevel=Operator" in found[0].line()
