"""Every process of the sandbox against the documented privilege model (docs/security.md,
"Who runs with which rights"): each daemon runs as the account the sandbox table names,
none runs as root unless the table says root, and what the daemons spawn as root is
Slurm's own (slurmstepd, the hooks slurmd and slurmctld run).
"""

from __future__ import annotations

import pwd
import re
from pathlib import Path

import psutil
import pytest

from slurm_geo.sandbox import Sandbox

SECURITY = Path(__file__).resolve().parent.parent / "docs" / "security.md"
CAP_DAC_READ_SEARCH = 1 << 2


def documented_accounts() -> dict[str, str]:
    """{sandbox process: account} from the sandbox table of docs/security.md."""
    text = SECURITY.read_text()
    table = text[text.index("| sandbox process | account |"):].split("\n\n", 1)[0]
    accounts = {}
    for row in table.splitlines()[2:]:
        names, account = (cell.strip() for cell in row.strip("|").split("|"))
        who = re.match(r"`?([\w-]+)`?", account)
        assert who is not None, row
        for name in re.findall(r"`([\w-]+)`", names):
            accounts[name] = who.group(1)
    return accounts


def test_the_table_names_accounts_and_processes():
    accounts = documented_accounts()
    assert accounts["federation"] == "slurm-geo"
    assert accounts["checkpoint-sync"] == "slurm-geo"
    assert accounts["onprem-n1"] == "root"


def user_of(uid: int) -> str:
    return pwd.getpwuid(uid).pw_name


def running(sandbox: Sandbox) -> dict[str, psutil.Process]:
    names = [daemon.name for stage in sandbox._stages(None) for daemon in stage]
    found = {}
    for name in names:
        pid = sandbox.processes.running_pid(name)
        if pid is not None:
            found[name] = psutil.Process(pid)
    return found


def test_every_daemon_runs_as_the_account_the_model_names(sandbox: Sandbox):
    accounts = documented_accounts()
    daemons = running(sandbox)
    assert {"federation", "checkpoint-sync", "munged", "onprem-slurmctld"} <= set(daemons)
    undocumented = sorted(set(daemons) - set(accounts))
    assert undocumented == [], f"processes the model does not name: {undocumented}"
    wrong = {name: (accounts[name], {user_of(uid) for uid in process.uids()})
             for name, process in daemons.items()
             if {user_of(uid) for uid in process.uids()} != {accounts[name]}}
    assert wrong == {}, wrong


def test_no_process_of_the_sandbox_runs_as_root_unless_the_model_says_so(sandbox: Sandbox):
    """Every root process carrying the sandbox's marker is a daemon the table names as
    root, or a child of one of them (slurmd's slurmstepd and the hooks it runs)."""
    accounts = documented_accounts()
    daemons = running(sandbox)
    root_daemons = {process.pid for name, process in daemons.items()
                    if accounts.get(name) == "root"}
    offenders = []
    for process in sandbox.processes.marked_processes():
        try:
            if 0 not in process.uids():
                continue
            lineage = {parent.pid for parent in process.parents()} | {process.pid}
            if not lineage & root_daemons:
                offenders.append((process.pid, process.name(), process.cmdline()[:3]))
        except psutil.NoSuchProcess:
            continue
    assert offenders == []


def capabilities(process: psutil.Process, which: str) -> int:
    for line in Path(f"/proc/{process.pid}/status").read_text().splitlines():
        if line.startswith(f"{which}:"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no {which} for {process.pid}")


def test_the_federation_daemon_has_no_capability_and_checkpoint_sync_one(sandbox: Sandbox):
    daemons = running(sandbox)
    for which in ("CapEff", "CapPrm"):
        assert capabilities(daemons["federation"], which) == 0
        assert capabilities(daemons["checkpoint-sync"], which) == CAP_DAC_READ_SEARCH


@pytest.mark.parametrize("name", ["federation", "checkpoint-sync"])
def test_the_daemons_run_no_code_a_user_controls(sandbox: Sandbox, name):
    """They run the site Python isolated (-I): no PYTHONPATH, user site or working
    directory on their path; and nothing they execute is writable by another account."""
    process = running(sandbox)[name]
    argv = process.cmdline()
    assert argv[1] == "-I", argv
    executable = Path(process.exe())
    info = executable.stat()
    assert info.st_uid == 0 and not info.st_mode & 0o022


def test_the_s3_server_runs_as_its_own_account_with_its_files_private_to_it(sandbox: Sandbox):
    """The object store is not the daemons': SeaweedFS runs as `slurm-geo-s3`, with no
    capability, owning its data, security files, identities and TLS key (0600 in 0700),
    while the daemons' key beside them stays root's; its unix sockets are in a /tmp of its
    own, none in the machine's /tmp, where a user could take their names first."""
    from slurm_geo.sandbox import service_account, stages
    from slurm_geo.sandbox.seaweed import private_tmp, sandbox_tls

    layout = sandbox.layout
    process = running(sandbox)[stages.S3_DAEMON]
    account = pwd.getpwnam(service_account.S3_NAME)
    assert set(process.uids()) == {account.pw_uid} and set(process.gids()) == {account.pw_gid}
    for which in ("CapEff", "CapPrm"):
        assert capabilities(process, which) == 0

    def owner_mode(path: Path) -> tuple[str, int]:
        info = path.lstat()
        return user_of(info.st_uid), info.st_mode & 0o7777

    tls = sandbox_tls(layout)
    assert owner_mode(layout.s3_dir) == ("root", 0o710)
    assert layout.s3_dir.stat().st_gid == account.pw_gid
    assert owner_mode(layout.s3_daemon_credentials) == ("root", 0o600)
    for directory in (layout.s3_data_dir, tls.config_dir, private_tmp(layout)):
        assert owner_mode(directory) == (service_account.S3_NAME, 0o700), directory
    for path in (layout.s3_identities, tls.s3_key, tls.s3_cert, *tls.config_dir.iterdir()):
        assert owner_mode(path) == (service_account.S3_NAME, 0o600), path
    foreign = [path for path in layout.s3_data_dir.rglob("*")
               if path.lstat().st_uid != account.pw_uid]
    assert foreign == []
    ports = {layout.s3_port, *layout.s3_internal_ports}

    def ours(directory: Path) -> list[Path]:
        return [p for p in directory.glob("seaweedfs-*.sock")
                if int(p.stem.rsplit("-", 1)[1]) in ports]

    sockets = ours(private_tmp(layout))
    assert sockets and all(owner_mode(p)[0] == service_account.S3_NAME for p in sockets)
    started = process.create_time()
    assert [p for p in ours(Path("/tmp")) if p.lstat().st_mtime >= started] == []
