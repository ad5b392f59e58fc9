"""Compute nodes never hold the master key (docs/security.md, "Where each secret lives").

Every hook Slurm runs (the node Prolog and Epilog, PrologSlurmctld and EpilogSlurmctld,
the SPANK plugin's validator) runs here as the installed script, in a fresh interpreter,
under an audit hook that records every open of the master key file, for a resumed
incarnation of a geo job whose directory is one checkpoint-sync replicates and whose
newest checkpoint is damaged: the key file is there, readable, and named by the config
and by $SLURM_GEO_KEY_FILE, and no hook opens it. Then the job resumes as a job does,
with only its run's data key (what the federation daemon releases to it), under the
same audit: it skips the damaged step and restores the older one, bit for bit.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from slurm_geo.ckpt import LocalDirStore, Repository, create_master_key_file
from slurm_geo.ckpt.repo.runkey import unwrap_run_keys
from slurm_geo.torch.checkpointer import Checkpointer

try:
    from slurm_geo.site import HOOKS
except ImportError:  # a tree from before the hooks became package data
    HOOKS = Path(__file__).resolve().parents[1] / "prolog_epilog"

RUN = "resumed-1"
HOOK_SCRIPTS = ("prolog", "epilog", "prolog_slurmctld", "epilog_slurmctld")

# Runs `argv[2]` (a script, or "-" for the code in argv[3]) as __main__ with every open of
# the key file (argv[1]) recorded: a line on stderr, read back by the test.
AUDITED = """
import os, runpy, sys
key = os.path.realpath(sys.argv[1])
out = os.dup(2)

def audit(event, args):
    if event in ("open", "os.open") and args and isinstance(args[0], (str, bytes)):
        path = os.fsdecode(args[0])
        if os.path.basename(path) == os.path.basename(key) and \\
                os.path.realpath(path) == key:
            os.write(out, f"KEY-OPENED {event} {path}\\n".encode())

sys.addaudithook(audit)
script = sys.argv[2]
if script == "-":
    code, sys.argv = sys.argv[3], ["<job>", *sys.argv[4:]]
    exec(compile(code, "<job>", "exec"), {"__name__": "__main__"})
else:
    sys.argv = sys.argv[2:]
    runpy.run_path(script, run_name="__main__")
"""

# The job's side: its run's key ring only (hex in argv[2]), as FederatedRun gets it.
JOB_RESUMES = """
import hashlib, json, sys
import torch
from slurm_geo.ckpt import LocalDirStore
from slurm_geo.ckpt.format.keys import RunKeyRing
from slurm_geo.ckpt.repo.runkey import RunKeyRepository
from slurm_geo.torch.checkpointer import Checkpointer

store, run, ring = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3])
torch.manual_seed(1)
model = torch.nn.Linear(8, 2)
optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
repository = RunKeyRepository(LocalDirStore(store), run, RunKeyRing.from_payload(ring, run))
resumed = Checkpointer(repository, run).resume(model, optimizer)
print(json.dumps({"step": resumed.step,
                  "weight": model.weight.detach().flatten().tolist(),
                  "bias": model.bias.detach().flatten().tolist()}))
"""


def audited(key_file: Path, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", AUDITED, str(key_file), *argv], env=env,
                          capture_output=True, text=True, timeout=300, check=False)


def save_10_and_20(store_dir: Path, key: bytes) -> dict[str, Any]:
    """Steps 10 and 20 of RUN; the model as saved at step 10."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)

    def train() -> None:
        optimizer.zero_grad()
        model(torch.randn(4, 8)).square().sum().backward()
        optimizer.step()

    with Checkpointer(Repository(LocalDirStore(store_dir), key), RUN) as checkpointer:
        for _ in range(10):
            train()
        checkpointer.save(10, model, optimizer)
        at_10 = copy.deepcopy(model.state_dict())
        for _ in range(10):
            train()
        checkpointer.save(20, model, optimizer)
    return {"weight": at_10["weight"].flatten().tolist(),
            "bias": at_10["bias"].flatten().tolist()}


def damage_step_20s_own_pack(store_dir: Path, key: bytes) -> None:
    repo = Repository(LocalDirStore(store_dir), key)
    older = {ref.pack for ref in repo.manifest(RUN, 10).refs()}
    (own,) = {ref.pack for ref in repo.manifest(RUN, 20).refs()} - older
    pack = store_dir / repo.manifest(RUN, 20).pack_object(own)
    data = bytearray(pack.read_bytes())
    data[len(data) // 2] ^= 0x01
    pack.write_bytes(bytes(data))
    assert repo.verify(RUN, 20) and not repo.verify(RUN, 10)


@pytest.fixture
def site(tmp_path: Path) -> dict[str, Path]:
    """A site whose checkpoint-sync replicates `pfs` to `offsite`, its master key file
    readable here and named both ways a hook could find it."""
    paths = {name: tmp_path / name for name in ("pfs", "offsite", "registry")}
    for path in paths.values():
        path.mkdir()
    paths["key"] = tmp_path / "master.key"
    create_master_key_file(paths["key"])
    paths["config"] = tmp_path / "site.toml"
    paths["config"].write_text(f'''
[stores.pfs]
url = "file://{paths['pfs']}"
region = "home"
[stores.offsite]
url = "file://{paths['offsite']}"
region = "remote"
[sync]
roots = ["pfs"]
destination = "offsite"
key_file = "{paths['key']}"
state = "{tmp_path / 'sync.db'}"
[registry]
path = "{paths['registry'] / 'registry.db'}"
''')
    paths["log"] = tmp_path / "hooks.log"
    return paths


def hook_env(site: dict[str, Path], restart: int) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
            "SLURM_GEO_CONFIG": str(site["config"]), "SLURM_GEO_KEY_FILE": str(site["key"]),
            "SLURM_GEO_HOOK_LOG": str(site["log"]),
            "SLURM_JOB_ID": "42", "SLURM_CLUSTER_NAME": "onprem", "SLURMD_NODENAME": "n1",
            "SLURM_JOB_RESTART_COUNT": str(restart), "SLURM_JOB_UID": str(os.getuid()),
            "SLURM_JOB_GID": str(os.getgid()), "SLURM_JOB_USER": "alice",
            "SLURM_JOB_NAME": "train", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_EXIT_CODE": "0:0",
            "SPANK_GEO_CKPT_DIR": str(site["pfs"]), "SPANK_GEO_RESIDENCY": "home,remote"}


@pytest.mark.root(reason="runs as other users or in namespaces (failed as nobody)")
def test_no_hook_opens_the_master_key_and_the_job_still_resumes_intact(site):
    from slurm_geo.ckpt.format.keys import load_master_key

    key = load_master_key(site["key"])
    expected = save_10_and_20(site["pfs"], key)
    damage_step_20s_own_pack(site["pfs"], key)

    for restart in (0, 1):  # a first start, then the resumed incarnation
        for hook in HOOK_SCRIPTS:
            done = audited(site["key"], [str(HOOKS / f"{hook}.py")], hook_env(site, restart))
            assert done.returncode == 0, (hook, done.stderr)
            assert "KEY-OPENED" not in done.stderr, (hook, done.stderr)
    validator = audited(site["key"], [str(HOOKS / "check_directives.py"),
                                      f"config={site['config']}", "cluster=onprem"],
                        {**hook_env(site, 1), "SPANK_GEO_CKPT_DIR": str(site["pfs"])})
    assert "KEY-OPENED" not in validator.stderr, validator.stderr

    log = site["log"].read_text()
    assert "Traceback" not in log and "prolog done for job onprem-42 (restart 1)" in log
    marker = json.loads((site["pfs"] / ".slurm-geo" / "prolog-onprem-42-1.json").read_text())
    assert marker["newest"] == [{"run": RUN, "step": 20}]  # by name: the job verifies
    assert Repository(LocalDirStore(site["pfs"]), key).verify(RUN, 20)  # left as it was

    # The job: its run key from the daemon (unwrapped here, as the daemon does), no more.
    ring = unwrap_run_keys(LocalDirStore(site["pfs"]), key, RUN).to_payload().hex()
    job = audited(site["key"], ["-", JOB_RESUMES, str(site["pfs"]), RUN, ring],
                  {k: v for k, v in hook_env(site, 1).items() if k != "SLURM_GEO_KEY_FILE"})
    assert job.returncode == 0, job.stderr
    assert "KEY-OPENED" not in job.stderr, job.stderr
    resumed = json.loads(job.stdout)
    assert resumed == {"step": 10, **expected}
    assert "step 20" in job.stderr  # the skipped step is said, never silently passed over


@pytest.mark.root(reason="runs as other users or in namespaces (failed as nobody)")
def test_the_audit_sees_a_hook_that_opens_the_key(site, tmp_path):
    """The test above has teeth: code that loads the master key as the old prolog did
    is caught."""
    opener = tmp_path / "opener.py"
    opener.write_text("import os\nfrom slurm_geo.ckpt import load_master_key\n"
                      "load_master_key(os.environ['SLURM_GEO_KEY_FILE'])\n")
    done = audited(site["key"], [str(opener)], hook_env(site, 1))
    assert done.returncode == 0, done.stderr
    assert "KEY-OPENED" in done.stderr


def test_no_hook_module_names_a_key_loader_or_a_store_opener():
    """What the audit shows at run time, in the source: the hooks' code (slurm_geo.hooks
    and the installed scripts) loads no master key and opens no store but the job's
    directory, as its owner."""
    sources = [*Path(__file__).resolve().parents[1].joinpath("slurm_geo", "hooks").glob("*.py"),
               *HOOKS.glob("*.py")]
    assert len(sources) >= 5
    for source in sources:
        text = source.read_text()
        for name in ("load_master_key", "master_key_path", "MasterKeys", "open_store",
                     "KEY_FILE", "key_file"):
            assert name not in text, f"{source} names {name}"


def secrets_table() -> dict[str, dict[str, str]]:
    """docs/security.md's "Where each secret lives": {secret: {place: cell}}."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "security.md").read_text()
    section = text.split("### Where each secret lives", 1)[1].split("\n### ", 1)[0]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in section.splitlines() if line.startswith("| ")]
    header, body = rows[0], rows[1:]
    return {row[0]: dict(zip(header[1:], row[1:], strict=True)) for row in body}


def test_the_docs_say_no_node_holds_the_master_key_or_a_daemon_credential():
    table = secrets_table()
    places = ("compute nodes", "login nodes", "the provider")
    for secret in ("master key `M`", "fence key `F`, promotion key `P`",
                   "the daemons' S3 keys"):
        (row,) = [cells for name, cells in table.items() if name.startswith(secret)]
        assert all(row[place].startswith("-") for place in places), (secret, row)
