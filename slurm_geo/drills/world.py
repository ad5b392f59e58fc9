"""`slurm-geo drill --world`: the drill's job carries a world (issue 31) and must find it
where it moves.

The world is the owner's, made at home before the job is submitted, under
`<home>/geo-drill-<id>/`: `data/` a dataset of random bytes (`--world-mb`, default 256 MiB,
in files of at most 64 MiB), `project/train.py` a copy of the drill's trainer
(slurm_geo.examples.train), `venv/` a virtualenv made as the owner from the site
Python's interpreter (its packages through a .pth file: the venv exists only at home),
`outputs/` where the job writes its per-incarnation files (its `--geo-outputs`), and
`job/` its working directory. The job declares `--geo-inputs=data,project --geo-env=venv
--geo-outputs=outputs`, prints the SHA-256 of the dataset it reads at start (on its log
and its trainer's output), and runs `venv/bin/python project/train.py`.

The drill strikes only once the world is complete off-site (checkpoint-sync's worlds
table) as well as two checkpoints, and afterwards, home back, checks as the owner: the
dataset's hash each incarnation printed is home's; `slurm-geo outputs fetch` brings the
moved incarnation's outputs home (into `fetched/`, beside the home ones, from which the
drill reads its trace and final weights); `slurm-geo logs` shows its log from home.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from slurm_geo.config.model import SiteConfig
from slurm_geo.drills.settings import MIB, DrillSettings
from slurm_geo.drills.waits import wait_or_none
from slurm_geo.sandbox.layout import SandboxLayout
from slurm_geo.sandbox.users import SandboxUser, job_environment, run_as

DEFAULT_WORLD_MB = 256.0
FILE_MB = 64
# Training lasts this many times what staging the world and copying it off-site (twice
# over the link: the copy and its read-back) should take, and at least MIN_TRAINING_S,
# so the world is off-site while the job still runs at home.
TRAINING_OVER_STAGING = 4.0
MIN_TRAINING_S = 90.0
HOME_STAGING_MBIT = 400.0  # a conservative rate of the home job's own staging pass
SHA_LINE = re.compile(r"^data-sha ([0-9a-f]{64})$", re.MULTILINE)


@dataclass(frozen=True)
class DrillWorld:
    root: Path
    sha256: str  # of the dataset's files, concatenated in name order
    bytes: int
    files: int

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def project(self) -> Path:
        return self.root / "project"

    @property
    def venv(self) -> Path:
        return self.root / "venv"

    @property
    def outputs(self) -> Path:
        return self.root / "outputs"

    @property
    def job_dir(self) -> Path:
        return self.root / "job"

    @property
    def fetched(self) -> Path:
        """Where the drill fetches the moved incarnations' outputs to (--to)."""
        return self.root / "fetched"

    @property
    def remote_work(self) -> Path:
        """The outputs directory as `outputs fetch --to fetched` writes it."""
        return self.fetched / self.outputs.relative_to("/")

    def directives(self) -> list[str]:
        return [f"#SBATCH --geo-inputs={self.data},{self.project}",
                f"#SBATCH --geo-env={self.venv}",
                f"#SBATCH --geo-outputs={self.outputs}"]

    def work_line(self) -> str:
        """The job's `work`: its outputs directory, where its world presents it."""
        return f'work="${{SLURM_GEO_OUTPUT_0:-{self.outputs}}}"'

    def run_lines(self, trainer_args: str, out: str) -> list[str]:
        """Hash the dataset, then train with the project's script in the venv; the exit
        code is the trainer's. Each `SLURM_GEO_*` is the path the job's world gives it (at
        home: unset, the home path)."""
        return [
            f'data="${{SLURM_GEO_INPUT_0:-{self.data}}}"',
            f'project="${{SLURM_GEO_INPUT_1:-{self.project}}}"',
            f'venv="${{SLURM_GEO_ENV:-{self.venv}}}"',
            'sha=$(cat "$data"/tokens-*.bin | sha256sum | cut -d" " -f1)',
            f'echo "data-sha $sha"; echo "data-sha $sha" >> {out}',
            f'"$venv/bin/python" "$project/train.py" {trainer_args} >> {out} 2>&1',
        ]


def make_world(layout: SandboxLayout, person: SandboxUser, mb: float) -> DrillWorld:
    """The owner's world at home (as above): files theirs, directories 0700."""
    root = person.home / f"geo-drill-{uuid.uuid4().hex[:8]}"
    for path in (root, root / "data", root / "project", root / "outputs", root / "job"):
        path.mkdir(mode=0o700)
    total, digest, files = int(mb * MIB), hashlib.sha256(), 0
    while files * FILE_MB * MIB < total:
        size = min(FILE_MB * MIB, total - files * FILE_MB * MIB)
        with open(root / "data" / f"tokens-{files:03d}.bin", "wb") as handle:
            for offset in range(0, size, MIB):
                block = os.urandom(min(MIB, size - offset))
                handle.write(block)
                digest.update(block)
        files += 1
    from slurm_geo.examples import train as example_train
    shutil.copyfile(example_train.__file__, root / "project" / "train.py")
    subprocess.run(["chown", "-R", f"{person.uid}:{person.uid}", str(root)], check=True)
    subprocess.run(["chmod", "-R", "go-rwx", str(root)], check=True)
    _make_venv(layout, person, root / "venv")
    return DrillWorld(root, digest.hexdigest(), total, files)


def _make_venv(layout: SandboxLayout, person: SandboxUser, venv: Path) -> None:
    """`python -m venv` as the owner, from the interpreter the site Python is a venv of;
    the site Python's packages (torch, slurm_geo) through a .pth file."""
    site = layout.site_python.parent.parent
    config = dict(line.split(" = ", 1) for line in
                  (site / "pyvenv.cfg").read_text().splitlines() if " = " in line)
    base = config.get("executable") or "/usr/bin/python3"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(person.home), "LANG": "C.UTF-8"}
    run_as(person, [base, "-m", "venv", "--without-pip", str(venv)], env=env, check=True,
           capture_output=True)
    (packages,) = site.glob("lib/python3*/site-packages")
    (mine,) = venv.glob("lib/python3*/site-packages")
    run_as(person, ["sh", "-c", f"echo {shlex.quote(str(packages))} > "
                                f"{shlex.quote(str(mine / 'site-python.pth'))}"],
           env=env, check=True)


def paced(settings: DrillSettings, world_mb: float, link_mbit: float | None,
          step_delay_given: bool) -> DrillSettings:
    """The drill's settings with its world: training long enough for the world to be
    staged and off-site before the loss (unless the step delay was given)."""
    megabits = world_mb * MIB * 8 / 1e6
    staging_s = megabits / HOME_STAGING_MBIT + 2 * megabits / (link_mbit or 1000.0)
    training_s = max(MIN_TRAINING_S, TRAINING_OVER_STAGING * staging_s)
    delay = settings.step_delay_s if step_delay_given else \
        max(settings.step_delay_s, round(training_s / settings.steps, 3))
    return replace(settings, world_mb=world_mb, step_delay_s=delay,
                   timeout_s=round(settings.timeout_s + 2 * settings.steps * delay))


def offsite(site: SiteConfig, run: str, world: DrillWorld | None) -> bool:
    """The run's world is complete off-site (no world: True)."""
    if world is None:
        return True
    from slurm_geo.sync.worldstate import read_worlds, world_offsite

    assert site.sync is not None
    return bool(world_offsite(read_worlds(site.sync.state, run), run))


class OffsiteWatch:
    """Whether the run's world is complete off-site (no world: True), and how long after
    the job's submission that was first seen (the drill polls it)."""

    def __init__(self, site: SiteConfig, run: str, world: DrillWorld | None):
        self._site, self._run, self._world = site, run, world
        self.submitted_at = time.time()
        self.seen_at: float | None = None

    def __call__(self) -> bool:
        if self._world is None:
            return True
        if self.seen_at is None and offsite(self._site, self._run, self._world):
            self.seen_at = time.time()
        return self.seen_at is not None

    @property
    def seconds(self) -> float | None:
        return None if self.seen_at is None else round(self.seen_at - self.submitted_at, 1)


def offsite_status(site: SiteConfig, run: str) -> str:
    from slurm_geo.sync.worldstate import read_worlds

    assert site.sync is not None
    rows = read_worlds(site.sync.state, run)
    if not rows:
        return "world: not staged off-site yet"
    return "world: " + ", ".join(
        f"{r.destination} {'complete' if r.complete else 'copying'} "
        f"{r.bytes_there / 1e6:.0f}/{r.bytes_total / 1e6:.0f} MB" for r in rows)


def staged_bytes(site: SiteConfig, run: str) -> int:
    """The bytes of the run's world off-site: its pinned packs at each destination, as
    stored (ciphertext), by checkpoint-sync's worlds table. (Not the table's bytes_copied,
    which leaves out what a pass cut short for a checkpoint had copied.)"""
    from slurm_geo.sync.worldstate import read_worlds

    assert site.sync is not None
    return sum(r.bytes_there for r in read_worlds(site.sync.state, run))


def shas(output: str) -> list[str]:
    """The dataset hashes a job's output printed."""
    return SHA_LINE.findall(output)


def check(layout: SandboxLayout, site: SiteConfig, person: SandboxUser, world: DrillWorld,
          logical: str, run: str, outputs: dict[str, str], moved: str,
          timeout_s: float = 180.0) -> dict[str, Any]:
    """What the report says of the world: each incarnation's dataset hash (`outputs`: the
    trainer's output by 'cluster:job'), the moved incarnation's outputs fetched home as
    the owner, its log read from home as the owner. `moved`: 'cluster:job'."""
    env = job_environment(layout, person)
    command = str(layout.site_python.parent / "slurm-geo")
    cluster, _, job_id = moved.partition(":")
    landed = world.remote_work / f"train-{cluster}-{job_id}.out"

    def fetched() -> list[str] | None:
        done = run_as(person, [command, "outputs", "fetch", logical, "--to",
                               str(world.fetched), "--json"], env=env, capture_output=True,
                      text=True)
        if done.returncode != 0 or not landed.exists() or \
                "final step " not in landed.read_text():
            time.sleep(5.0)  # checkpoint-sync looks at a complete world every 30 s
            return None
        return json.loads(done.stdout)
    written = wait_or_none(fetched, time.time() + timeout_s)
    logs = run_as(person, [command, "logs", logical], env=env, capture_output=True, text=True)
    moved_output = landed.read_text() if landed.exists() else outputs.get(moved, "")
    found = {incarnation: shas(text) for incarnation, text in
             {**outputs, moved: moved_output}.items()}
    return {"root": str(world.root), "mb": round(world.bytes / MIB, 1), "files": world.files,
            "sha256": world.sha256, "job_sha256": found,
            "staged_bytes": staged_bytes(site, run),
            "outputs_home": written is not None,
            "outputs_fetched": sorted(p.name for p in world.remote_work.glob("*"))
            if written is not None else [],
            "log_home": logs.returncode == 0 and f"data-sha {world.sha256}" in logs.stdout
            and moved in logs.stdout,
            "log_said": logs.stderr.strip()[-300:] if logs.returncode else ""}


def with_first_step(said: dict[str, Any], lines: list[Any], home: str,
                    killed_at: float) -> dict[str, Any]:
    """`said` with `first_step_s`: the loss to the first step trained elsewhere (the
    drill's RTO ends at the new incarnation's lease, which its preamble takes before it
    materialises the world; this ends after it). `lines`: drill.trace_lines."""
    after = [line.time for line in lines
             if line.time > killed_at and not line.incarnation.startswith(f"{home}:")]
    return {**said, "first_step_s": round(min(after) - killed_at, 1) if after else None}


def remove_dataset(world: DrillWorld) -> None:
    """The dataset and the venv go (the figures stay in the report); the outputs stay."""
    for path in (world.data, world.venv):
        shutil.rmtree(path, ignore_errors=True)
