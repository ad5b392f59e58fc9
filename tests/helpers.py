"""Helpers for tests against real Slurm: polling, and sbatch as a sandbox user."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def eventually(probe: Callable[[], T], accept: Callable[[T], bool], timeout_s: float = 60,
               interval_s: float = 0.5) -> T:
    """Call `probe` until `accept` holds for its result; fail with the last result seen."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if accept(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"still not accepted after {timeout_s} s: {value!r}")
        time.sleep(interval_s)


def sbatch_as(sandbox, person, script: str, *args: str, cluster: str = "onprem",
              slurm_conf=None, timeout_s: float = 60):
    """`sbatch --parsable ARGS` as `person` types it at their shell on the sandbox: their
    uid (MUNGE says so to Slurm), their login environment, nothing of root's."""
    from slurm_geo.sandbox.users import job_environment, run_as

    layout = sandbox.layout
    env = {**job_environment(layout, person),
           "SLURM_CONF": str(slurm_conf or layout.cluster(cluster).slurm_conf)}
    # From their home directory, as from their login shell (the job's working directory,
    # where the daemon restarts it at home), never the test runner's.
    return run_as(person, ["sbatch", "--parsable", *args], input=script, text=True,
                  capture_output=True, timeout=timeout_s, check=False, env=env,
                  cwd=str(person.home))


def as_uid(uid: int, action: Callable[[], object], gid: int | None = None) -> str:
    """Run `action` in a forked child as `uid` (and `gid`, by default the same number), no
    supplementary groups: "ok", or the exception's class and message (its traceback when
    the message is empty), as one string the test asserts on."""
    import os
    import traceback

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(read)
        try:
            os.setgroups([])
            os.setresgid(*(3 * [uid if gid is None else gid]))
            os.setresuid(uid, uid, uid)
            action()
            answer = "ok"
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, whatever it is
            answer = f"{type(exc).__name__}: {exc}" if str(exc) else traceback.format_exc()
        os.write(write, answer.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        answer = pipe.read().decode()
    os.waitpid(pid, 0)
    return answer


def incarnation_environment(logical_job: str, generation: int) -> dict[str, str] | None:
    """The environment of a running process of that incarnation, read from /proc."""
    import psutil

    wanted = {"SLURM_GEO_LOGICAL_JOB": logical_job, "SLURM_GEO_GENERATION": str(generation)}
    for pid in psutil.pids():
        env = process_environment(pid)
        if env is not None and all(env.get(k) == v for k, v in wanted.items()):
            return env
    return None


def process_environment(pid: int) -> dict[str, str] | None:
    from pathlib import Path

    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    return dict(entry.split("=", 1) for entry in raw.decode(errors="replace").split("\0")
                if "=" in entry)


def stored_packs(store) -> list[str]:
    """Every pack object of a checkpoint store, under either prefix (the shared `packs/`
    of formats 1-3, a run's `run-packs/<run>/` of formats 4 and 5), sorted."""
    from slurm_geo.ckpt.ops.usage import pack_sizes

    return sorted(pack_sizes(store))


def pack_files(root) -> list:
    """The pack files of a directory store at `root` (a Path), either layout."""
    return sorted(path for top in ("packs", "run-packs") for path in (root / top).rglob("*")
                  if path.is_file() and not path.name.startswith("."))


def daemon_pid(sandbox, name: str) -> int | None:
    """The pid of sandbox daemon `name`, whether the host runs it or the provider's
    machine (`--remote-slurm provider`: rented's Slurm)."""
    from slurm_geo.sandbox import remote_site

    if remote_site.provider_daemon(sandbox.layout, name) is not None:
        return remote_site.running_pid(sandbox.layout, name)
    return sandbox.processes.running_pid(name)


def stop_daemon(sandbox, name: str) -> None:
    """Stop sandbox daemon `name` wherever it runs; the sandbox's `up` starts it again."""
    from slurm_geo.sandbox import remote_site

    if remote_site.provider_daemon(sandbox.layout, name) is not None:
        remote_site.stop_daemon(sandbox.layout, name)
    else:
        sandbox.processes.stop(name)


def with_directive(script: str, directive: str) -> str:
    """A drill training script (drill.training_script) with one more `#SBATCH` line."""
    return script.replace("#SBATCH --geo-failover=auto",
                          f"#SBATCH --geo-failover=auto\n#SBATCH {directive}")


def teed_trainer(script: str) -> tuple[list[str], int]:
    """The script's lines, its trainer's output going to the job's Slurm output too (which
    a provider's cluster writes on its own disk: its "started at step N" is the
    incarnation's first step), and the trainer's line number."""
    lines = script.splitlines()
    trainer = next(i for i, line in enumerate(lines) if "slurm_geo.examples.train " in line)
    lines[trainer] = lines[trainer].replace(
        ' >> "$work/train-$SLURM_CLUSTER_NAME-$SLURM_JOB_ID.out" 2>&1',
        ' 2>&1 | tee -a "$work/train-$SLURM_CLUSTER_NAME-$SLURM_JOB_ID.out"')
    return lines, trainer


@contextmanager
def reachable_dir(prefix: str, mode: int = 0o755, under: str = "/tmp") -> Iterator[Path]:
    """A fresh directory under `under` with `mode` (0755: every uid can reach what is made
    in it; 1777: alice and bob may both create in it, as in /scratch), unlike pytest's
    tmp_path, which is root's alone; removed after, whatever the users left in it."""
    path = Path(tempfile.mkdtemp(prefix=f"slurm-geo-{prefix}-", dir=under))
    path.chmod(mode)
    try:
        yield path
    finally:
        subprocess.run(["chmod", "-R", "u+rwX", str(path)], check=False)
        shutil.rmtree(path, ignore_errors=True)
