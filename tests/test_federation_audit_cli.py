"""`slurm-geo audit verify|show` over a real audit database."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys

import pytest
from click.testing import CliRunner

from slurm_geo.cli import cli
from slurm_geo.errors import SlurmGeoError
from slurm_geo.federation.state.audit import AuditChainBroken, AuditLog


@pytest.fixture
def db(tmp_path):
    path = tmp_path / "audit.db"
    with AuditLog(path, clock=lambda: 1_795_975_200.0) as log:
        log.append("decision", "onprem:42", "move to rented", "home onprem is down",
                   checkpoint={"run": "llm", "step": 1200}, clusters=["onprem", "rented"])
        log.append("transfer", "onprem:42", "copied 50 GB to offsite", "replication",
                   bytes=50 * 10**9)
        log.append("requeue", "onprem:43", "requeued on rented", "line\nbreak")
    return path


def tamper(path):
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("DROP TRIGGER audit_no_update")
    conn.execute("UPDATE audit SET why = 'all fine' WHERE seq = 2")
    conn.close()


def invoke(*args: str):
    return CliRunner().invoke(cli, ["audit", *args])


def test_verify_an_intact_log(db):
    result = invoke("verify", "--db", str(db))
    assert result.exit_code == 0, result.output
    assert "3 entries, chain intact; head 3:" in result.output
    head = result.output.strip().rsplit("head ", 1)[1]
    assert invoke("verify", "--db", str(db), "--expect-head", head).exit_code == 0


def test_verify_json(db):
    data = json.loads(invoke("verify", "--db", str(db), "--json").output)
    assert (data["ok"], data["entries"], data["first_bad_seq"], data["head"]["seq"]) == (
        True, 3, None, 3)
    tamper(db)
    result = invoke("verify", "--db", str(db), "--json")
    assert result.exit_code == AuditChainBroken.exit_code
    assert json.loads(result.output)["first_bad_seq"] == 2


def test_verify_a_tampered_log_fails_naming_the_entry(db):
    tamper(db)
    result = invoke("verify", "--db", str(db))
    assert isinstance(result.exception, AuditChainBroken)
    assert "first bad entry 2" in str(result.exception)


def test_verify_a_tampered_log_from_the_command_line_is_one_line(db):
    tamper(db)
    result = subprocess.run([sys.executable, "-m", "slurm_geo", "audit", "verify", "--db",
                             str(db)], capture_output=True, text=True, timeout=60)
    assert result.returncode == AuditChainBroken.exit_code
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"slurm-geo: error: audit log {db}: first bad entry 2: "
                                    "entry 2 does not match its hash")


def test_verify_with_a_head_from_before_a_cut(db, tmp_path):
    head = AuditLog(db).head()
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("DROP TRIGGER audit_no_delete")
    conn.execute("DELETE FROM audit WHERE seq = 3")
    conn.close()
    assert invoke("verify", "--db", str(db)).exit_code == 0
    result = invoke("verify", "--db", str(db), "--expect-head", f"{head[0]}:{head[1]}")
    assert "first bad entry 3" in str(result.exception)
    bad = invoke("verify", "--db", str(db), "--expect-head", "three")
    assert bad.exit_code == 2 and "expected SEQ:HASH" in bad.output


def test_show_table_and_filters(db):
    lines = invoke("show", "--db", str(db)).output.splitlines()
    assert lines[0].split() == ["SEQ", "TIME", "KIND", "LOGICAL_JOB", "WHAT", "WHY"]
    assert len(lines) == 4 and lines[3].endswith("line?break")
    job = invoke("show", "--db", str(db), "--job", "onprem:43").output.splitlines()
    assert [line.split()[0] for line in job[1:]] == ["3"]
    data = json.loads(invoke("show", "--db", str(db), "--json", "--since", "1").output)
    assert [e["seq"] for e in data] == [2, 3]
    assert data[0]["detail"] == {"bytes": 50 * 10**9}
    assert invoke("show", "--db", str(db), "--job", "nobody").output == "no entries\n"


def test_a_missing_database_is_an_error_not_a_new_file(tmp_path):
    result = invoke("show", "--db", str(tmp_path / "absent.db"))
    assert "no audit log at" in str(result.exception)
    assert not (tmp_path / "absent.db").exists()


def test_without_db_the_config_must_name_the_log(tmp_path, monkeypatch):
    config = tmp_path / "site.toml"
    config.write_text('[clusters.onprem]\nregion = "home"\naccess = "cli"\n'
                      'slurm_conf = "/etc/slurm/slurm.conf"\n')
    monkeypatch.setenv("SLURM_GEO_CONFIG", str(config))
    result = invoke("verify")      # no [federation] table (or, once it exists, no log)
    assert isinstance(result.exception, SlurmGeoError)
    assert "give --db PATH" in str(result.exception)
    monkeypatch.setenv("SLURM_GEO_CONFIG", str(tmp_path / "absent.toml"))
    assert "or give --db PATH" in str(invoke("show").exception)
